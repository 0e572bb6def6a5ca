"""`tensorfold learned` on a real store written by RowsStore: ls and show list what is kept, verify finds every
damaged byte without removing anything, gc and rm tidy under the lock and are refused while a server holds it."""

from __future__ import annotations

import json

import pytest
from rows_cases import files, open_store, tokens, write
from typer.testing import CliRunner

from tensorfold import learned
from tensorfold.learned_cli import app
from tensorfold.rows.api import StoreRefused

RUNNER = CliRunner()


@pytest.fixture
def kept(tmp_path):
    """Two identities: three states (two sharing a prefix) and one state."""
    root = tmp_path / "learned"
    with open_store(root) as store:
        shared = tokens(1, 40)
        write(store, shared, 24)
        write(store, shared, 40)
        write(store, tokens(2, 30), 17)
    with open_store(root, facts={"family": "other", "dtype": "float32"}) as store:
        write(store, tokens(3, 20), 16)
    return root


def run(*args: str):
    return RUNNER.invoke(app, list(args))


def test_ls_and_show_list_every_state(kept):
    listed = json.loads(run("ls", "--learn-dir", str(kept), "--json").output)
    assert sorted(i["states"] for i in listed) == [1, 3]
    assert all(i["bytes"] > 0 for i in listed)
    three = next(i for i in listed if i["states"] == 3)
    shown = json.loads(run("show", three["identity"][:8], "--learn-dir", str(kept), "--json").output)
    assert sorted(s["tokens"] for s in shown["states"]) == [17, 24, 40] and shown["facts"]["family"] == "rows-test"
    text = run("show", three["identity"][:8], "--learn-dir", str(kept)).output
    assert "3 states" in text and "family: rows-test" in text
    assert run("show", "zzzz", "--learn-dir", str(kept)).exit_code != 0


def test_verify_finds_damage_and_removes_nothing(kept):
    result = run("verify", "--learn-dir", str(kept))
    assert result.exit_code == 0 and "0 problems" in result.output
    block, state = files(kept, ".blk")[0], files(kept, ".st")[-1]
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    block.write_bytes(block.read_bytes()[:-5])
    result = run("verify", "--learn-dir", str(kept))
    assert result.exit_code == 1 and str(block) in result.output and str(state) in result.output
    assert state.exists() and block.exists()


@pytest.mark.parametrize("command", [["verify"], ["gc"], ["rm", "abc"]])
def test_a_store_that_is_not_there_is_an_error_not_a_clean_report(tmp_path, command):
    result = run(*command, "--learn-dir", str(tmp_path / "nothere"))
    said = " ".join(result.output.replace("│", " ").split())  # typer boxes and wraps the message
    assert result.exit_code == 2 and "does not exist: no rows store is there" in said
    assert "0 problems" not in result.output and not (tmp_path / "nothere").exists()


def test_gc_removes_parts_damaged_states_and_orphans(kept):
    (kept / "leftover.blk.part").write_bytes(b"half")
    state = files(kept, ".st")[0]
    state.write_bytes(state.read_bytes()[:10])
    blocks = len(files(kept, ".blk"))
    result = run("gc", "--learn-dir", str(kept))
    assert result.exit_code == 0, result.output
    assert not (kept / "leftover.blk.part").exists() and not state.exists()
    orphans = blocks - len(files(kept, ".blk"))
    assert orphans > 0                                       # the damaged state's own blocks no other state lists
    assert f"1 .part files, 1 damaged states, {orphans} orphan blocks" in result.output
    assert learned.verify(kept) == {i.name: [] for i in learned.identities(kept)}


def test_rm_a_state_then_an_identity(kept):
    big = max(learned.identities(kept), key=lambda i: len(i.states))
    first = big.states[0]
    assert run("rm", big.name[:10], "--state", first.key[:10], "--learn-dir", str(kept)).exit_code == 0
    left = learned.pick(kept, big.name[:10])
    assert first.key not in {s.key for s in left.states} and len(left.states) == 2
    assert learned.verify(kept)[big.name] == []                      # no block a kept state lists is gone
    assert run("rm", big.name[:10], "--learn-dir", str(kept)).exit_code == 0
    assert [i.name for i in learned.identities(kept)] != [] and big.name not in {i.name for i in
                                                                                learned.identities(kept)}


def test_gc_and_rm_are_refused_while_a_server_holds_the_store(kept):
    with open_store(kept):
        with pytest.raises(StoreRefused, match="in use"):
            learned.gc(kept)
        result = run("rm", learned.identities(kept)[0].name[:8], "--learn-dir", str(kept))
        assert result.exit_code != 0 and "in use" in result.output
        assert run("ls", "--learn-dir", str(kept)).exit_code == 0   # reading needs no lock
