"""--learn-conversations with real server processes and real files (pages poisoned with NaN): a conversation's
state written at SIGTERM is read by a new server process on the same --learn-dir, and a conversation pushed out
of the device and host tiers by a filler is read back from disk; either way the next turn's token ids equal a
fresh server's, and cached_tokens is the row it resumed at (the previous turn's history end)."""

from __future__ import annotations

import httpx
import pytest
from learn_cases import (
    ENV,
    FILLER,
    FIRST,
    SECOND,
    SMALL_TIERS,
    SYSTEM,
    ask,
    check_resumed,
    fresh_server,
    learn_args,
    memory,
    sample,
    serve_args,
    turns,
    written,
)
from learn_files import learned

from tensorfold.testing.process import serving, tail

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fresh(tiny_checkpoint, tokenizer, tmp_path_factory) -> dict:
    """A server that keeps nothing: the conversation's two turns, and where its first turn's history ends."""
    return fresh_server(tiny_checkpoint, tmp_path_factory.mktemp("fresh") / "server.log", tokenizer,
                        (SYSTEM, FIRST, SECOND))[0]


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
    assert sample(metrics, "tensorfold_disk_read_seconds_total") > 0
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

    root, log = tmp_path / "learned", tmp_path / "server.log"
    one, _ = turns(fresh["first"])

    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        ask(url, one)
    listed = json.loads(learned(root, "ls", "--json").stdout)
    assert len(listed) == 1 and listed[0]["states"] == 2 and listed[0]["facts"]["dtype"]
    shown = json.loads(learned(root, "show", listed[0]["identity"][:10], "--json").stdout)
    assert fresh["history"] in {s["tokens"] for s in shown["states"]}
    assert learned(root, "verify").returncode == 0
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV):
        refused = learned(root, "gc")
        assert refused.returncode == 1 and "in use by another tensorfold server" in refused.stderr
        assert learned(root, "ls").returncode == 0
    assert learned(root, "gc").returncode == 0
