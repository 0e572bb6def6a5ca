"""compare: a cache-on run against the cache-off replay of the same requests.

Exact checks (every run; what CI asserts):
    tokens      every prompt's and every reply's token ids (and finish reason) identical in both runs
    fresh       cached_tokens 0 on every request of the cache-off server, which has no tiers
    resumed     cached_tokens on the cache-on server == the resume row the keep policy predicted (gate/policy.py)
    reused      at least MIN_RESUMED requests resumed at least half of a prompt of at least `min_prompt` tokens
    metrics     per step, the tiers' hits and prompt_tokens_cached_total moved by exactly what usage reported, from
                the tier a scenario named (the host after eviction pressure; none once evicted everywhere)
    same        a regenerated request repeats the tokens of the request it regenerates
    budgets     no tier refused a state; in the eviction scenario states left the device and, with a host tier,
                were resumed from it and dropped from it
    integrity   both servers' memory integrity check is "ok" once idle; both ran with TF_KV_POISON=1

A measurement, reported always and checked only when a limit is given (a bench, a release check on a quiet
machine; never CI, where a loaded machine moves it):
    TTFT        over the `reused` requests: median TTFT resumed / median TTFT of the same requests on the
                cache-off server ≤ the limit
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import attrs

from gate.records import Exchange, Run

MIN_PROMPT = 512
MIN_RESUMED = 3


@attrs.define
class Verdict:
    """What compare found: failures (empty: the gate passes) and numbers per scenario."""

    failures: list[str] = attrs.field(factory=list)
    scenarios: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    ttft_ratio: float | None = None       # measured: median resumed TTFT over the same requests' fresh TTFT
    ttft_limit: float | None = None       # the most ttft_ratio may be; None: measured, not checked
    reused: int = 0                       # requests that resumed at least half of a prompt of min_prompt+ tokens

    @property
    def passed(self) -> bool:
        """No failure."""
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {"passed": self.passed, **attrs.asdict(self)}


def where(e: Exchange) -> str:
    """An exchange, for a message."""
    return f"{e.scenario} step {e.step}"


def first_difference(a: Iterable[int], b: Iterable[int]) -> str:
    """Where two token sequences part."""
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"at token {i}: {x} vs {y}"
    return f"in length: {len(a)} vs {len(b)}"


def check_runs(cached: Run, fresh: Run, verdict: Verdict, allow_no_poison: bool) -> None:
    """Both runs' servers: the right tiers, poison on, memory intact."""
    if "device" not in cached.meta["tiers"]:
        verdict.failures.append("the recorded server has no device tier: record against a cache-on server")
    if fresh.meta["tiers"]:
        verdict.failures.append(f"the replay server has tiers {sorted(fresh.meta['tiers'])}: replay against "
                                f"--prompt-cache-gib 0 --host-cache-gib 0")
    for name, run in (("recorded", cached), ("replay", fresh)):
        if not run.meta["poison"] and not allow_no_poison:
            verdict.failures.append(f"the {name} server ran without TF_KV_POISON=1")
        if run.integrity != "ok":
            verdict.failures.append(f"the {name} server's memory integrity when idle: {run.integrity}")


def check_exchange(i: int, c: Exchange, f: Exchange, verdict: Verdict) -> None:
    """One request in both runs."""
    if {**c.body, "model": ""} != {**f.body, "model": ""} or (c.scenario, c.step) != (f.scenario, f.step):
        verdict.failures.append(f"request {i} ({where(c)}) is not the same request in both files")
        return
    if c.reply.prompt_token_ids != f.reply.prompt_token_ids:
        parted = first_difference(c.reply.prompt_token_ids, f.reply.prompt_token_ids)
        verdict.failures.append(f"{where(c)}: prompt tokens differ {parted}")
    if c.reply.token_ids != f.reply.token_ids or c.reply.finish_reason != f.reply.finish_reason:
        verdict.failures.append(f"{where(c)}: generated tokens differ "
                                f"{first_difference(c.reply.token_ids, f.reply.token_ids)} (resumed at "
                                f"{c.reply.cached_tokens}; finish {c.reply.finish_reason} vs {f.reply.finish_reason})")
    if f.reply.cached_tokens != 0:
        verdict.failures.append(f"{where(c)}: the cache-off server reported cached_tokens {f.reply.cached_tokens}")
    if c.reply.cached_tokens != c.expected_cached:
        verdict.failures.append(f"{where(c)}: resumed at {c.reply.cached_tokens}, the keep policy says "
                                f"{c.expected_cached} (prompt of {c.reply.prompt_tokens} tokens)")


def check_steps(cached: Run, verdict: Verdict) -> None:
    """Per step of the cache-on run: the tier counters moved by exactly what the replies' usage says."""
    by_step: dict[int, list[Exchange]] = {}
    for e in cached.exchanges:
        by_step.setdefault(e.step, []).append(e)
    for step in cached.steps:
        exchanges = by_step.get(step.step, [])
        hits = sum(t.get("hits", 0) for t in step.tiers.values())
        tokens = sum(t.get("cached_tokens", 0) for t in step.tiers.values())
        resumed = [e for e in exchanges if e.reply.cached_tokens > 0]
        label = f"{step.scenario} step {step.step}"
        if hits != len(resumed) or tokens != sum(e.reply.cached_tokens for e in exchanges):
            verdict.failures.append(f"{label}: /metrics counted {hits:g} hits and {tokens:g} cached tokens, usage "
                                    f"{len(resumed)} and {sum(e.reply.cached_tokens for e in exchanges)}")
        for e in exchanges:
            if e.expected_tier == "none" and hits:
                verdict.failures.append(f"{label}: expected no tier to serve it, /metrics counted {hits:g} hits")
            elif e.expected_tier not in (None, "none"):
                got = step.tiers.get(e.expected_tier, {})
                if got.get("hits", 0) != 1 or got.get("cached_tokens", 0) != e.reply.cached_tokens:
                    verdict.failures.append(f"{label}: expected a resume from the {e.expected_tier} tier, its "
                                            f"counters moved by {got}")


def check_same(run: Run, name: str, verdict: Verdict) -> None:
    """Regenerated requests repeat the tokens of the request they regenerate."""
    for e in run.exchanges:
        if e.same_as is not None and e.reply.token_ids != run.exchanges[e.same_as].reply.token_ids:
            verdict.failures.append(f"{where(e)} ({name}): a regenerated turn differs from the turn it regenerates")


def check_budgets(cached: Run, verdict: Verdict) -> None:
    """No tier refused a state; the eviction scenario pushed states off the device, and with a host tier resumed
    from it and dropped from it. Elsewhere a drop is only a hint: the predicted rows do not model eviction, so a
    wrong row in a scenario whose last tier dropped states says the budgets were too small for it."""
    last = "host" if cached.meta["tiers"].get("host", 0) > 0 else "device"
    for scenario in cached.scenarios:
        refused = {name: t["refused"] for name, t in scenario.tiers.items() if t.get("refused")}
        if refused:
            verdict.failures.append(f"{scenario.name}: tiers refused states {refused}: a state larger than a tier's "
                                    f"budget; give the cache-on server larger budgets")
        if scenario.drops:
            if not scenario.tiers.get("device", {}).get("evicted"):
                verdict.failures.append(f"{scenario.name}: no state left the device tier")
            host = scenario.tiers.get("host", {})
            if last == "host" and not (host.get("hits") and host.get("evicted")):
                verdict.failures.append(f"{scenario.name}: the host tier served no resume or dropped nothing: {host}")
            continue
        dropped = scenario.tiers.get(last, {}).get("evicted", 0)
        wrong = any(f.startswith(f"{scenario.name} step") and "the keep policy says" in f for f in verdict.failures)
        if dropped and wrong:
            verdict.failures.append(f"{scenario.name}: the {last} tier dropped {dropped:g} states during it, which "
                                    f"the predicted rows do not model: give the cache-on server larger budgets")


def ttft_ratio(pairs: list[tuple[Exchange, Exchange]]) -> float | None:
    """Median resumed TTFT over median fresh TTFT of the same requests (None without pairs)."""
    if not pairs:
        return None
    return statistics.median(c.reply.ttft_s for c, _ in pairs) / statistics.median(f.reply.ttft_s for _, f in pairs)


def prefilled(run: Run, scenario: str) -> int:
    """Prompt rows a run's server prefilled in a scenario: every prompt token it did not resume."""
    return sum(e.reply.prompt_tokens - e.reply.cached_tokens for e in run.exchanges if e.scenario == scenario)


def check_ttft(verdict: Verdict, timed: list[tuple[Exchange, Exchange]], limit: float) -> None:
    """The measured ratio against a limit the caller asked for (a bench or a release check, not CI)."""
    if verdict.ttft_ratio is not None and verdict.ttft_ratio > limit:
        verdict.failures.append(f"median TTFT resumed is {verdict.ttft_ratio:.2f}× the cache-off server's over "
                                f"{len(timed)} requests; --ttft-ratio wants at most {limit}×")


def compare(cached: Run, fresh: Run, ttft_limit: float | None = None, min_prompt: int = MIN_PROMPT,
            allow_no_poison: bool = False) -> Verdict:
    """Every exact check, and the TTFT ratio measured (checked only against `ttft_limit` when one is given); the
    verdict lists each failure and the numbers per scenario."""
    verdict = Verdict(ttft_limit=ttft_limit)
    check_runs(cached, fresh, verdict, allow_no_poison)
    if len(cached.exchanges) != len(fresh.exchanges):
        verdict.failures.append(f"the recorded run has {len(cached.exchanges)} requests, the replay "
                                f"{len(fresh.exchanges)}")
        return verdict
    for i, (c, f) in enumerate(zip(cached.exchanges, fresh.exchanges, strict=True)):
        check_exchange(i, c, f, verdict)
    check_steps(cached, verdict)
    check_same(cached, "recorded", verdict)
    check_same(fresh, "replay", verdict)
    check_budgets(cached, verdict)
    timed = [(c, f) for c, f in zip(cached.exchanges, fresh.exchanges, strict=True)
             if c.reply.prompt_tokens >= min_prompt and c.reply.cached_tokens * 2 >= c.reply.prompt_tokens]
    for scenario in dict.fromkeys(e.scenario for e in cached.exchanges):
        mine = [e for e in cached.exchanges if e.scenario == scenario]
        ratio = ttft_ratio([(c, f) for c, f in timed if c.scenario == scenario])
        verdict.scenarios[scenario] = {"requests": len(mine), "resumed": sum(e.reply.cached_tokens > 0 for e in mine),
                                       "prompt_tokens": sum(e.reply.prompt_tokens for e in mine),
                                       "cached_tokens": sum(e.reply.cached_tokens for e in mine),
                                       "prefilled": prefilled(cached, scenario),
                                       "prefilled_fresh": prefilled(fresh, scenario),
                                       "ttft_ratio": None if ratio is None else round(ratio, 3)}
    verdict.reused = len(timed)
    verdict.ttft_ratio = ttft_ratio(timed)
    if len(timed) < MIN_RESUMED:
        verdict.failures.append(f"only {len(timed)} requests resumed at least half of a prompt of {min_prompt}+ "
                                f"tokens: too few to show reuse (make the scenarios longer with --scale)")
    elif ttft_limit is not None:
        check_ttft(verdict, timed, ttft_limit)
    return verdict
