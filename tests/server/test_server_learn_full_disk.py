"""`--learn-conversations` on a real 4 MiB tmpfs with no byte left (mounted as root, as CI runs; skipped, saying why,
where mounting is not permitted), through real `tensorfold serve` processes: the server starts, answers, says in
one log line and on /memory that the disk tier writes nothing and why, and a state written before the disk filled
is still read back, the reply equal to a fresh server's."""

from __future__ import annotations

import pytest
from learn_cases import ENV, ask, check_resumed, fresh_server, learn_args, memory, serve_args, turns
from learn_files import kept

from tensorfold.testing.process import serving, tail
from tensorfold.testing.served import FIRST, SECOND, SYSTEM
from tensorfold.testing.small_disk import fill, fill_inodes, tmpfs

pytestmark = pytest.mark.slow

FULL = "No space left on device"


@pytest.fixture
def disk(tmp_path):
    with tmpfs(tmp_path / "disk", size="4m") as mounted:
        yield mounted


def writes_nothing(log_text: str) -> list[str]:
    return [line for line in log_text.splitlines() if "rows store: writes nothing to" in line]


def test_a_server_on_a_full_disk_serves_and_says_its_disk_tier_writes_nothing(tiny_checkpoint, tmp_path, disk):
    fill(disk)
    root, log = disk / "learned", tmp_path / "server.log"
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        reply = ask(url, turns(None, SYSTEM, FIRST, SECOND)[0])
        assert reply["choices"][0]["token_ids"]
        seen = memory(url)
    why = f"{root / 'FORMAT'} could not be written: [Errno 28] {FULL}"
    assert seen["plan"]["learn_writes"] is False and seen["plan"]["learn_writes_off"] == why, seen["plan"]
    assert seen["now"]["disk_staged"] == 0 and seen["now"]["disk_write_failed"] == 0, seen["now"]
    text = log.read_text()
    assert writes_nothing(text) == [next(line for line in text.splitlines() if why in line)], tail(log)
    assert f"{why}; serving goes on" in text, tail(log)
    assert "writes nothing (the warning above says why)" in text and "Traceback" not in text, tail(log)
    assert "disk tier closed: 0 states written at shutdown" in text, tail(log)


def test_a_state_kept_before_the_disk_filled_is_read_back_by_a_server_that_writes_nothing(
        tiny_checkpoint, tokenizer, tmp_path, disk):
    fresh = fresh_server(tiny_checkpoint, tmp_path / "fresh.log", tokenizer, (SYSTEM, FIRST, SECOND))[0]
    root, log = disk / "learned", tmp_path / "server.log"
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        ask(url, fresh["one"])
    assert fresh["history"] in kept(root), tail(log)
    fill(disk)
    with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
        second = ask(url, fresh["messages"])
        seen = memory(url)
    check_resumed(second, fresh)
    assert seen["plan"]["learn_writes"] is False and FULL in seen["plan"]["learn_writes_off"], seen["plan"]
    assert seen["now"]["tiers"]["disk"]["hits"] == 1 and seen["now"]["disk_staged"] == 0, seen["now"]
    text = log.read_text()
    assert len(writes_nothing(text)) == 1 and "read probe's scratch file" in writes_nothing(text)[0], tail(log)
    assert "Traceback" not in text, tail(log)


def test_a_disk_that_cannot_even_make_the_learn_dir_serves_without_the_disk_tier(tiny_checkpoint, tmp_path):
    with tmpfs(tmp_path / "disk", size="4m", inodes=64) as disk:
        fill_inodes(disk)
        root, log = disk / "learned", tmp_path / "server.log"
        with serving(serve_args(tiny_checkpoint, *learn_args(root)), log, env=ENV) as url:
            assert ask(url, turns(None, SYSTEM, FIRST, SECOND)[0])["choices"][0]["token_ids"]
            seen = memory(url)
        assert "learn" not in seen["plan"] and "disk" not in seen["now"]["tiers"], seen
        assert not root.exists()
    text = log.read_text()
    assert (f"kept prompt states on disk: none: --learn-dir {root} cannot be made: [Errno 28] {FULL}: '{root}'; "
            "serving goes on") in text, tail(log)
    assert "Traceback" not in text, tail(log)
