"""Kept states at TP=2 (the template family, gloo, real spawned processes): rank 0's device and host tiers decide,
the follower mirrors each keep, move, restore, promotion and drop on its own part (tiers/mirror.py). Turns resumed
from either tier give the tokens and the decode logits, bit for bit, of the same world with every tier off, and at
the end the follower holds a part for exactly the states rank 0 keeps, in the same tiers. With pages and with one
window per slot; each world is a few seconds (two spawned processes)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.plugins import load_families
from tensorfold.testing.tp_world import Job, run_world

A1, B1, E1 = tuple(range(1, 25)), tuple(range(40, 64)), tuple(range(100, 190))
A2 = A1 + tuple(range(200, 216))
B2 = B1 + tuple(range(300, 311))
A3 = A2 + (7, 8, 9, 10, 11)
TURNS = (A1, B1, E1, A2, B2, A3)   # A2, B2 and A3 resume; E1 takes most of the 8 pages and is larger than the
                                    # tight device tier (kept on the host), so states go down and come back up
ROOMY, TIGHT, HOST = 1 << 20, 30_000, 1 << 20    # bytes of one rank (a state at 24 rows is 12,288 at TP=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-example")
    load_families(["example"])["example"].make_tiny(directory, seed=0)
    return directory


def world(tiny, out, device_bytes: int, host_bytes: int, paged: bool = True) -> tuple[dict, dict | None]:
    job = Job(family="example", model=tiny, prompts=TURNS, pages=8, device_bytes=device_bytes,
              host_bytes=host_bytes, together=False, paged=paged)
    result, codes = run_world(2, job, out)
    assert codes == [0, 0], (codes, [p.read_text() for p in out.glob("*.error")])
    assert result["failure"] is None
    follower = torch.load(out / "rank1.pt")
    return result, follower


@pytest.fixture(scope="module")
def fresh(tiny, tmp_path_factory):
    result, _ = world(tiny, tmp_path_factory.mktemp("off"), 0, 0)
    return result


def tokens(result):
    return [reply["tokens"] for reply in result["alone"]]


def check_resumed_equals_fresh(result, follower, fresh) -> None:
    assert all(len(t) == 12 for t in tokens(fresh))
    assert tokens(result) == tokens(fresh)
    assert len(result["decode_logits"]) == len(fresh["decode_logits"]) == 6 * 11
    assert all(torch.equal(a, b) for a, b in zip(result["decode_logits"], fresh["decode_logits"], strict=True))
    keys = result["keys"]
    assert follower["device"] == keys.get("device", []) and follower["host"] == keys.get("host", [])


def test_device_and_host_tiers_resume_as_fresh_at_tp2(tiny, tmp_path, fresh):
    result, follower = world(tiny, tmp_path, ROOMY, HOST)
    check_resumed_equals_fresh(result, follower, fresh)
    tiers = result["tiers"]
    assert tiers["prompt_cache_hits"] == 1 and tiers["host_cache_hits"] == 2   # the pool's 8 pages push states down
    assert tiers["prompt_cache_promoted"] == 2
    assert (len(follower["device"]), len(follower["host"])) == (5, 1)


def test_states_moved_down_and_promoted_up_resume_as_fresh_at_tp2(tiny, tmp_path, fresh):
    result, follower = world(tiny, tmp_path, TIGHT, HOST)
    check_resumed_equals_fresh(result, follower, fresh)
    tiers = result["tiers"]
    assert tiers["host_cache_hits"] == 3 and tiers["prompt_cache_promoted"] == 1
    assert tiers["prompt_cache_evicted"] == 5 and tiers["host_cache_evicted"] == 1
    assert (len(follower["device"]), len(follower["host"])) == (1, 5)


def test_the_host_tier_alone_resumes_as_fresh_at_tp2(tiny, tmp_path, fresh):
    result, follower = world(tiny, tmp_path, 0, HOST)
    check_resumed_equals_fresh(result, follower, fresh)
    assert result["tiers"]["host_cache_hits"] == 3 and follower["device"] == []
    assert len(follower["host"]) == result["tiers"]["host_cache_states"] == 6


def test_window_stores_keep_move_and_resume_as_fresh_at_tp2(tiny, tmp_path, fresh):
    result, follower = world(tiny, tmp_path, TIGHT, HOST, paged=False)
    check_resumed_equals_fresh(result, follower, fresh)
    tiers = result["tiers"]
    assert tiers["prompt_cache_hits"] == 1 and tiers["host_cache_hits"] == 2 and tiers["prompt_cache_evicted"] == 4
    assert (len(follower["device"]), len(follower["host"])) == (1, 5)
