"""--learn-conversations with real server processes and real files (pages poisoned with NaN): a conversation's
state written at SIGTERM is read by a new server process on the same --learn-dir, and a conversation pushed out
of the device and host tiers by a filler is read back from disk; either way the next turn's token ids equal a
fresh server's, and cached_tokens is the row it resumed at (the previous turn's history end)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tensorfold.testing.process import serving, tail

SYSTEM = "You are a helpful assistant who answers in full sentences."
FIRST = "What is the capital of France, and why?"
SECOND = "Tell me more about its rivers."
FILLER = [{"role": "system", "content": "You are a patient tutor. " * 6},
          {"role": "user", "content": "Tell me everything about rivers. " * 9}]
GRID = ["--context", "1024", "--page-rows", "16", "--prefill-chunk", "128", "--min-chunk", "16", "--parallel", "2"]
# device: the conversation's two states (59 rows of pages and copies) fit, the filler's system end (86) beside
# them does not; host: both conversation states (91 rows) fit, the filler's history end (237) beside either not
SMALL_TIERS = ["--prompt-cache-gib", "0.000105", "--host-cache-gib", "0.00025"]
ENV = {"TF_KV_POISON": "1", "TF_IMPRINT_VERIFY": "1", "PYTHONUNBUFFERED": "1"}
pytestmark = pytest.mark.slow


def serve_args(model: Path, *extra: str) -> list[str]:
    return ["--family", "example", "--model", str(model), *GRID, *extra]


def learn_args(root: Path) -> list[str]:
    return ["--learn-conversations", "--learn-dir", str(root), "--learn-min-free-gib", "0"]


def ask(url: str, messages: list[dict]) -> dict:
    reply = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"messages": messages, "max_tokens": 8, "temperature": 0.7, "seed": 3,
                             "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def memory(url: str) -> dict:
    return httpx.get(f"{url}/memory", timeout=10).json()


def written(url: str, states: int) -> dict:
    """/memory once the disk tier's I/O thread is idle with at least `states` states on disk."""
    deadline = time.monotonic() + 20
    while True:
        now = memory(url)["now"]
        if (now["disk_waiting"] == 0 and now["disk_states"] >= states) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def turns(first: dict) -> tuple[list[dict], list[dict]]:
    """The conversation's first turn, and its second with the first reply in it."""
    one = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": FIRST}]
    two = [*one, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
           {"role": "user", "content": SECOND}]
    return one, two


@pytest.fixture(scope="module")
def fresh(tiny_checkpoint, tokenizer, tmp_path_factory) -> dict:
    """A server that keeps nothing: the conversation's two turns, and where its first turn's history ends."""
    log = tmp_path_factory.mktemp("fresh") / "server.log"
    one, _ = turns({"choices": [{"message": {"content": ""}}]})
    with serving(serve_args(tiny_checkpoint, "--prompt-cache-gib", "0", "--host-cache-gib", "0"), log,
                 env=ENV) as url:
        first = ask(url, one)
        two = turns(first)[1]
        second = ask(url, two)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    history = len(tokenizer.encode(tokenizer.render(one, False)))
    return {"first": first, "second": second, "history": history, "messages": two}


def check_resumed(second: dict, fresh: dict) -> None:
    assert second["choices"][0]["token_ids"] == fresh["second"]["choices"][0]["token_ids"]
    assert second["usage"]["prompt_tokens"] == fresh["second"]["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == fresh["history"]


def test_a_state_written_at_sigterm_is_read_by_a_new_server_process(tiny_checkpoint, tmp_path, fresh):
    root, log = tmp_path / "learned", tmp_path / "server.log"
    one, _ = turns(fresh["first"])
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        first = ask(url, one)
        assert first["choices"][0]["token_ids"] == fresh["first"]["choices"][0]["token_ids"]
        assert memory(url)["now"]["disk_states"] == 0  # RAM keeps it: nothing is written yet
    text = log.read_text()  # the server got SIGTERM: what RAM kept is on disk
    assert f"kept at {fresh['history']} (history end) on disk" in text, tail(log)
    assert "disk tier closed: 2 states written at shutdown" in text and ", 0 dropped" in text, tail(log)
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        second = ask(url, fresh["messages"])
        now = memory(url)["now"]
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    check_resumed(second, fresh)
    assert 'tensorfold_tier_hits_total{tier="disk"} 1.0' in metrics
    assert f'tensorfold_prompt_tokens_cached_total{{tier="disk"}} {float(fresh["history"])}' in metrics
    assert now["tiers"]["disk"]["hits"] == 1 and now["tiers"]["disk"]["cached_tokens"] == fresh["history"]
    assert now["disk_failed_reads"] == now["disk_declined"] == 0 and now["integrity_when_idle"] == "ok"
    assert f"resumed at {fresh['history']} of {second['usage']['prompt_tokens']} from disk" in log.read_text()


def test_a_conversation_pushed_out_by_a_filler_resumes_from_disk(tiny_checkpoint, tmp_path, fresh):
    root, log = tmp_path / "learned", tmp_path / "server.log"
    one, _ = turns(fresh["first"])
    with serving(serve_args(tiny_checkpoint, *SMALL_TIERS, *learn_args(root)), log, env=ENV) as url:
        ask(url, one)
        ask(url, FILLER)
        now = written(url, 2)
        assert now["tiers"]["device"]["evicted"] >= 2 and now["tiers"]["host"]["evicted"] >= 2, now
        assert now["disk_written"] >= 2 and now["disk_verified"] == now["disk_written"], now
        assert now["disk_verify_mismatches"] == 0
        second = ask(url, fresh["messages"])
        after = memory(url)["now"]
    check_resumed(second, fresh)
    assert after["tiers"]["disk"]["hits"] == 1 and after["tiers"]["host"]["hits"] == 0
    text = log.read_text()
    assert f"kept at {fresh['history']} (history end) on disk" in text, tail(log)
    assert f"resumed at {fresh['history']} of {second['usage']['prompt_tokens']} from disk" in text, tail(log)


def test_tensorfold_learned_reads_what_a_server_wrote(tiny_checkpoint, tmp_path, fresh):
    """The `tensorfold learned` command, as a real process, on a store a real server wrote: ls and show list the
    states, verify passes, and gc is refused while a server holds the store."""
    import json
    import subprocess
    import sys

    root, log = tmp_path / "learned", tmp_path / "server.log"
    one, _ = turns(fresh["first"])

    def learned(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tensorfold", "learned", *args, "--learn-dir", str(root)],
                              capture_output=True, text=True, timeout=60)

    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        ask(url, one)
    listed = json.loads(learned("ls", "--json").stdout)
    assert len(listed) == 1 and listed[0]["states"] == 2 and listed[0]["facts"]["dtype"]
    shown = json.loads(learned("show", listed[0]["identity"][:10], "--json").stdout)
    assert fresh["history"] in {s["tokens"] for s in shown["states"]}
    assert learned("verify").returncode == 0
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV):
        refused = learned("gc")
        assert refused.returncode == 1 and "in use by another tensorfold server" in refused.stderr
        assert learned("ls").returncode == 0
    assert learned("gc").returncode == 0
