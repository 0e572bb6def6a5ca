"""Fuzz cases sent to a real server and each answer judged: never a 5xx, every refusal in OpenAI's envelope, and
an engine that still answers, exactly as before, once the fuzz is over.

Only tests and benchmarks import this module: it needs httpx, which `pip install 'tensorfold[testing]'` brings.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from typing import Any

import attrs

from tensorfold.testing.extras import need
from tensorfold.testing.fuzz import Case

httpx = need("httpx", __name__)

ENVELOPE_KEYS = {"message", "type", "param", "code"}
HANG_UP_S = 0.05          # how long a case that hangs up before any answer waits first
PROBE = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}


@attrs.frozen
class Outcome:
    """What one case got: its status (None without an HTTP answer) and what was wrong, None when nothing."""

    case: Case
    status: int | None
    problem: str | None = None


def envelope_problem(body: bytes) -> str | None:
    """What is wrong with an error answer's body; None when it is OpenAI's {"error": {message, type, param, code}}."""
    try:
        payload = json.loads(body)
    except ValueError:
        return f"the error body is not JSON: {body[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or set(error) != ENVELOPE_KEYS or set(payload) != {"error"}:
        return f"the error body is not OpenAI's envelope: {body[:200]!r}"
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return f"the envelope's message and type must be strings: {body[:200]!r}"
    if not all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")):
        return f"the envelope's param and code must be strings or null: {body[:200]!r}"
    return None


def judge(status: int, body: bytes) -> str | None:
    """A whole (non-SSE) answer: a 5xx is a failure, a 4xx must be in the envelope, a 2xx must be a JSON object."""
    if status >= 500:
        try:
            return f"{status}: {json.loads(body)['error']['message'][:300]}"
        except (ValueError, TypeError, KeyError):
            return f"{status}: {body[:300].decode('utf-8', 'replace')}"
    if status >= 400:
        return envelope_problem(body)
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:200]!r}"
    return None if isinstance(payload, dict) else f"{status} with a body that is not a JSON object"


def read_events(reply: httpx.Response, hang_up_after: int | None) -> str | None:
    """An SSE answer: every event a JSON object without an error, ending in [DONE] unless we hang up first."""
    seen = 0
    for line in reply.iter_lines():
        if not line.startswith("data: "):
            continue
        seen += 1
        if line == "data: [DONE]":
            return None
        try:
            chunk = json.loads(line[6:])
        except ValueError:
            return f"an event that is not JSON: {line[:200]!r}"
        if "error" in chunk:
            return f"an error event mid-stream: {line[:300]}"
        if hang_up_after is not None and seen >= hang_up_after:
            return None
    return "the stream ended without [DONE]"


def send(client: httpx.Client, url: str, case: Case, timeout_s: float) -> Outcome:
    """Send one case and judge what came back. A kept-alive connection the server closed after the previous case
    (uvicorn does after an unhandled exception, which that case's 500 reports) is tried again on a new one."""
    outcome = send_once(client, url, case, timeout_s)
    if outcome.status is None and outcome.problem is not None and "no answer:" in outcome.problem:
        with httpx.Client() as fresh:
            return send_once(fresh, url, case, timeout_s)
    return outcome


def send_once(client: httpx.Client, url: str, case: Case, timeout_s: float) -> Outcome:
    """Send one case and judge what came back; hanging up early is the case's own doing, not a problem."""
    headers = {"content-type": case.content_type} if case.content_type is not None else {}
    request = client.build_request(case.method, url + case.path, content=case.body, headers=headers,
                                   timeout=httpx.Timeout(timeout_s, read=HANG_UP_S if case.hang_up_after == 0
                                                         else timeout_s))
    try:
        reply = client.send(request, stream=True)
    except httpx.ReadTimeout:
        if case.hang_up_after == 0:
            return Outcome(case, None)
        return Outcome(case, None, f"no answer within {timeout_s:g} s")
    except httpx.TimeoutException:
        return Outcome(case, None, f"no answer within {timeout_s:g} s")
    except httpx.TransportError as err:
        return Outcome(case, None, f"no answer: {type(err).__name__}: {err}")
    try:
        sse = reply.headers.get("content-type", "").startswith("text/event-stream")
        if case.hang_up_after == 0 and reply.status_code < 300:
            return Outcome(case, reply.status_code)
        if sse and reply.status_code == 200:
            return Outcome(case, 200, read_events(reply, case.hang_up_after))
        return Outcome(case, reply.status_code, judge(reply.status_code, reply.read()))
    except httpx.TimeoutException:
        if case.hang_up_after == 0:     # the status came, we hung up before its body: only a 5xx is a problem
            status = reply.status_code
            return Outcome(case, status, f"{status} (body not read: the case hangs up)" if status >= 500 else None)
        return Outcome(case, reply.status_code, f"the answer stopped for {timeout_s:g} s")
    except httpx.TransportError as err:
        return Outcome(case, reply.status_code, f"the answer broke off: {type(err).__name__}: {err}")
    finally:
        reply.close()


def run_cases(url: str, cases: Iterable[Case], workers: int = 3, timeout_s: float = 30.0) -> list[Outcome]:
    """Send every case from `workers` clients at once, in case order; stop early when the engine stops answering
    (a case with no answer, then a plain greedy completion with none either), naming the cases then in flight
    (the one that stopped it may be one whose client hung up early, so none of them got an answer)."""
    pending = iter(cases)
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    in_flight: dict[int, Case] = {}
    recent: list[int] = []  # cases finished lately: the one that stopped the engine may have hung up already
    dead = threading.Event()

    def work() -> None:
        with httpx.Client() as client:
            while not dead.is_set():
                with lock:
                    case = next(pending, None)
                    if case is not None:
                        in_flight[case.index] = case
                if case is None:
                    return
                outcome = send(client, url, case, timeout_s)
                with lock:
                    outcomes.append(outcome)
                    del in_flight[case.index]
                    recent[:] = [*recent[-2 * workers:], case.index]
                if outcome.status is None and outcome.problem is not None and greedy(client, url, timeout_s) is None:
                    with lock:
                        if not dead.is_set():
                            suspects = sorted({*in_flight, *recent, case.index})
                            outcomes.append(Outcome(case, None, "the engine stopped answering; cases sent just "
                                                                f"before: {suspects}"))
                        dead.set()

    threads = [threading.Thread(target=work, name=f"fuzz-{i}") for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sorted(outcomes, key=lambda outcome: outcome.case.index)


def greedy(client: httpx.Client, url: str, timeout_s: float = 30.0) -> list[int] | None:
    """The token ids of a fixed greedy completion; None when the server does not give one."""
    try:
        reply = client.post(url + "/v1/completions", json=PROBE, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    return reply.json()["choices"][0]["token_ids"]


def idle_memory(client: httpx.Client, url: str, wait_s: float = 30.0) -> dict[str, Any]:
    """/memory's `now` once nothing runs or waits (cancelled streams leave at the engine's next step)."""
    deadline = time.monotonic() + wait_s
    while True:
        now = client.get(url + "/memory", timeout=wait_s).json()["now"]
        if (now["running"] == 0 and now["waiting"] == 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def health_problems(url: str, before: list[int] | None) -> list[str]:
    """What is wrong with the server after a fuzz: /health, the same greedy tokens as before, an idle engine whose
    memory checks out."""
    found = []
    with httpx.Client() as client:
        try:
            health = client.get(url + "/health", timeout=10).status_code
        except httpx.HTTPError as err:
            return [f"/health did not answer: {type(err).__name__}: {err}"]
        if health != 200:
            found.append(f"/health answered {health}")
        after = greedy(client, url)
        if after is None or after != before:
            found.append(f"the greedy probe gave {after} after the fuzz, {before} before")
        try:
            now = idle_memory(client, url)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            return [*found, f"/memory did not answer: {type(err).__name__}: {err}"]
        if now["running"] != 0 or now["waiting"] != 0:
            found.append(f"/memory shows {now['running']} running and {now['waiting']} waiting after the fuzz")
        if now["integrity_when_idle"] != "ok":
            found.append(f"/memory's integrity_when_idle is {now['integrity_when_idle']!r}")
    return found


def report(outcomes: list[Outcome], health: list[str]) -> str:
    """The failures by kind and symptom, each with one reproducer, for a test's message or a bench's log."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.problem is not None:
            symptom = outcome.problem.split(";")[0][:60]
            groups.setdefault((outcome.case.kind, symptom), []).append(outcome)
    lines = [f"{len(group)} x {kind} -> {symptom}; case {group[0].case.index}: {group[0].problem[:200]}\n"
             f"    {group[0].case.reproducer()}" for (kind, symptom), group in sorted(groups.items())]
    return "\n".join([*lines, *(f"after the fuzz: {problem}" for problem in health)])
