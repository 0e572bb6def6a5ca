"""Partitions through a real engine (the example family, pages poisoned with NaN): a request resumes only from a
state kept under its own partition (Request.partition); the same prompt in another partition, or in the shared
one, prefills from row 0; within a partition the resumed reply is bitwise a fresh engine's; on disk the partition's
states are found again after a restart, under names no other partition's prompt makes, and `learned verify`
passes."""

from __future__ import annotations

import pytest
from resume_cases import Client, ask, engine, fresh, memory, tokens

from tensorfold import learned
from tensorfold.engine.api import DoneEvent, Sampling
from tensorfold.engine.runner import Engine
from tensorfold.server.isolation import partition_of
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import check_memory, open_disk, running
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.disk import DiskTier

SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=10)
A = partition_of("salt a", None)
B = partition_of("salt b", None)
FIRST = tokens(45, 0)


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def send(eng: Engine, name: str, prompt: tuple[int, ...], starts: tuple[int, ...], partition: str,
         disk: DiskTier | None = None) -> tuple[DoneEvent, list[int]]:
    """One request in `partition`; its done event and reply (after the disk's I/O thread wrote what it kept)."""
    client = Client(name, prompt, SEEDED, starts)
    client.request.partition = partition
    done = ask(eng, client)
    if disk is not None:
        assert disk.writer.settle(30)
    return done, client.tokens


def second_turn(reply: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chat's next prompt after FIRST and its reply, and its starts (it cuts where FIRST ends)."""
    return FIRST + tuple(reply) + tokens(30, 1), (len(FIRST), len(FIRST) + len(reply))


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_turn_resumes_only_in_its_own_partition_and_equals_a_fresh_run(subject, pages):
    mem = memory(subject, pages=pages)
    device = DeviceTier(mem, budget=1 << 30)
    host = HostTier(mem, budget=1 << 30)
    with running(engine(subject, mem, device, host)) as eng:
        done, reply = send(eng, "a0", FIRST, (), A)
        assert done.cached_tokens == 0
        prompt, starts = second_turn(reply)
        replies = {}
        for name, partition, cached in (("b1", B, 0), ("shared1", "", 0), ("a1", A, len(FIRST))):
            done, replies[name] = send(eng, name, prompt, starts, partition)
            assert done.cached_tokens == cached, name
        check_memory(mem, eng.tiers)
    assert reply == fresh(subject, FIRST, SEEDED)
    want = fresh(subject, prompt, SEEDED, starts)
    assert replies == {"b1": want, "shared1": want, "a1": want}
    assert device.hits == 1 and host.hits == 0
    # A's first turn, then the second prompt's end in B, in the shared partition and in A: four states
    assert sorted((s.at, s.partition) for s in device.states) == sorted(
        [(len(FIRST), A), (len(prompt), B), (len(prompt), ""), (len(prompt), A)])


def test_a_partitions_states_on_disk_resume_after_a_restart_only_in_that_partition(subject, tmp_path):
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path)
    with running(engine(subject, mem, disk=disk)) as eng:    # no RAM tier: every kept state is written
        done, reply = send(eng, "a0", FIRST, (), A, disk)
    assert done.cached_tokens == 0 and disk.stats().kept == 1
    prompt, starts = second_turn(reply)
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path)                 # a restart on the same directory
    replies = {}
    with running(engine(subject, mem, disk=disk)) as eng:
        for name, partition, cached in (("b1", B, 0), ("shared1", "", 0), ("a1", A, len(FIRST))):
            done, replies[name] = send(eng, name, prompt, starts, partition, disk)
            assert done.cached_tokens == cached, name
    assert disk.hits == 1 and disk.failed_reads == 0
    want = fresh(subject, prompt, SEEDED, starts)
    assert replies == {"b1": want, "shared1": want, "a1": want}
    ends = [entry for entry in disk.store.entries() if entry.at == len(prompt)]
    assert len(ends) == 3 and len({entry.key for entry in ends}) == 3    # one state per partition, each named apart
    blocks = [set(entry.blocks) for entry in ends]
    assert all(blocks[i].isdisjoint(blocks[j]) for i in range(3) for j in range(i + 1, 3)) and all(blocks)
    identity = disk.store.identity      # the engine closed the disk tier and its store
    assert learned.verify(tmp_path) == {identity: []}
