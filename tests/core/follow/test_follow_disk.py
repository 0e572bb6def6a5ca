"""The disk tier at TP=2 (the template family, gloo, real spawned processes): each rank keeps its own part of every
state in its own rows store (rank 0 in the --learn-dir, rank 1 in `rank-1/` below it, tiers/disk_mirror.py).
A world that served the first turns and stopped leaves both parts on disk; a new world resumes the second turns
from them with the tokens and decode logits, bit for bit, of a world with every tier off. A part damaged on the
follower alone makes every rank forget the state and the turn prefill, with the same tokens. A TP=1 store on the
same directory reads none of the TP=2 parts. Each world is a few seconds (two spawned processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing.tp_world import Job, run_world

A1, B1 = tuple(range(1, 25)), tuple(range(40, 64))
A2 = A1 + tuple(range(200, 216))
B2 = B1 + tuple(range(300, 311))
FIRST, SECOND = (A1, B1), (A2, B2)   # A2 and B2 resume from A1's and B1's states at row 24
HOST = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-example")
    load_families(["example"])["example"].make_tiny(directory, seed=0)
    return directory


def world(tiny: Path, out: Path, prompts, learn: Path | None = None, host_bytes: int = 0, size: int = 2,
          block_rows: int = 8, paged: bool = True) -> dict:
    job = Job(family="example", model=tiny, prompts=prompts, pages=16, host_bytes=host_bytes, together=False,
              learn_dir=learn, learn_block_rows=block_rows, paged=paged)
    result, codes = run_world(size, job, out)
    assert codes == [0] * size, (codes, [p.read_text() for p in out.glob("*.error")])
    assert result["failure"] is None
    return result


@pytest.fixture(scope="module")
def fresh(tiny, tmp_path_factory):
    return world(tiny, tmp_path_factory.mktemp("off"), SECOND)


def tokens(result: dict) -> list[list[int]]:
    return [reply["tokens"] for reply in result["alone"]]


def states(root: Path) -> list[Path]:
    """The state files of every identity directly under `root`."""
    return sorted(root.glob("*/states/*.st"))


@pytest.mark.slow
@pytest.mark.parametrize("block_rows, paged", [(8, True), (64, False)])
def test_states_written_at_shutdown_resume_from_disk_as_fresh_at_tp2(tiny, tmp_path, fresh, block_rows, paged):
    """With 64 rows a block, a state of 24 rows is all put back at its end, after the slot is cleared: in a window
    store (poisoned when cleared) a clear replayed after the follower's read would show."""
    learn = tmp_path / "learn"
    world(tiny, tmp_path / "first", FIRST, learn, HOST, block_rows=block_rows, paged=paged)  # spilled at shutdown
    assert len(states(learn)) == 2 and len(states(learn / "rank-1")) == 2
    assert states(learn)[0].parent.parent.name != states(learn / "rank-1")[0].parent.parent.name
    result = world(tiny, tmp_path / "second", SECOND, learn, HOST, block_rows=block_rows, paged=paged)
    assert tokens(result) == tokens(fresh) and all(len(t) == 12 for t in tokens(fresh))
    assert len(result["decode_logits"]) == len(fresh["decode_logits"]) == 2 * 11
    assert all(torch.equal(a, b) for a, b in zip(result["decode_logits"], fresh["decode_logits"], strict=True))
    tiers = result["tiers"]
    assert tiers["disk_hits"] == 2 and tiers["disk_failed_reads"] == 0
    assert tiers["tiers"]["disk"]["cached_tokens"] == 48

    alone = world(tiny, tmp_path / "tp1", SECOND, learn, HOST, 1, block_rows, paged)  # another identity: reads none
    assert alone["tiers"]["disk_hits"] == 0 and tokens(alone) == tokens(fresh)


@pytest.mark.slow
def test_a_part_damaged_on_the_follower_drops_the_state_on_every_rank(tiny, tmp_path, fresh):
    learn = tmp_path / "learn"
    world(tiny, tmp_path / "first", FIRST, learn)                     # the disk tier alone: staged from the slot
    follower = states(learn / "rank-1")
    assert len(states(learn)) == 2 and len(follower) == 2
    for path in follower:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
    result = world(tiny, tmp_path / "second", SECOND, learn)
    assert tokens(result) == tokens(fresh)
    assert len(result["decode_logits"]) == len(fresh["decode_logits"])
    assert all(torch.equal(a, b) for a, b in zip(result["decode_logits"], fresh["decode_logits"], strict=True))
    tiers = result["tiers"]
    assert tiers["disk_hits"] == 0 and tiers["disk_failed_reads"] == 2
    assert tiers["tiers"]["disk"]["cached_tokens"] == 0
    assert len(states(learn)) == len(states(learn / "rank-1")) == 2   # A1 and B1 forgotten; A2 and B2 kept
