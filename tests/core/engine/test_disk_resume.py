"""The disk tier under a real engine and real files: a chat's turns resume from states on disk (pages poisoned with
NaN) with the replies of a fresh engine, across an engine restart on the same directory; the state on disk is the
image a fresh prefill makes, and one put back reads out byte-equal (example, and qwen's fixed states); a read the
payoff rule declines prefills instead; boot builds the tier from --learn-conversations, its identity probe is
stable, and a server of another identity (dtype, config) never reads a state."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
from resume_cases import CHUNK, MIN_CHUNK, USERS, Client, ask, fresh, memory, tokens

from tensorfold.engine.api import KeepMarks, Sampling
from tensorfold.engine.cuts import plan_cuts
from tensorfold.engine.runner import Engine
from tensorfold.image import read_out, row_offset
from tensorfold.plugins import load_families
from tensorfold.rows.store import RowsStore
from tensorfold.settings import Settings
from tensorfold.testing import kit
from tensorfold.tiers import DeviceTier, HostTier
from tensorfold.tiers.disk import DiskTier

SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=10)
CONTEXT = 256


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def open_disk(subject, mem, root, **kwargs) -> DiskTier:
    declarations = subject.declarations
    store = RowsStore(root, {"model": "tiny"}, row_offset=partial(row_offset, declarations.layout,
                                                                  declarations.image),
                      block_rows=16, min_free_bytes=0)
    return DiskTier(mem, store, declarations.image, **{"read_bytes_per_s": 1e12, "prefill_rows_per_s": 1.0,
                                                       **kwargs})


def disk_engine(subject, mem, disk, device=None, host=None) -> Engine:
    return Engine(subject.model, mem, prefill_chunk=CHUNK, context=CONTEXT, max_waiting=8, min_chunk=MIN_CHUNK,
                  tier=device, host=host, disk=disk)


def chat(eng: Engine, disk: DiskTier, turns: list, users, salt: int = 0) -> list:
    """Turns of a chat (each prompt the last one, its reply and a new message; starts at every message), waiting
    for the I/O thread after each, so the next turn finds what it wrote."""
    for user in users:
        prompt, starts = (turns[-1][0] + tuple(turns[-1][2]), turns[-1][1]) if turns else ((), ())
        if turns:
            starts += (len(turns[-1][0]), len(prompt))
        marks = KeepMarks(rewind=len(prompt) or None)
        prompt += tokens(user, salt + len(turns))
        client = Client(f"t{len(turns)}", prompt, SEEDED, starts, marks=marks)
        done = ask(eng, client)
        assert disk.writer.settle(30)
        turns.append((prompt, starts, client.tokens, done))
    return turns


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_resumes_from_disk_across_a_restart_as_fresh_runs(subject, tmp_path, pages):
    mem = memory(subject, pages=pages)
    disk = open_disk(subject, mem, tmp_path)
    eng = disk_engine(subject, mem, disk)  # no RAM tier: every kept state is written
    eng.start()
    try:
        turns = chat(eng, disk, [], USERS[:2])
    finally:
        eng.close()
    assert disk.stats().kept >= 2 and disk.hits == 1
    mem = memory(subject, pages=pages)
    disk = open_disk(subject, mem, tmp_path)  # a restart: a new store on the same directory
    device = DeviceTier(mem, budget=1 << 30)
    eng = disk_engine(subject, mem, disk, device=device)
    eng.start()
    try:
        turns = chat(eng, disk, turns, USERS[2:])
    finally:
        eng.close()
    assert [done.cached_tokens for *_, done in turns] == [0, len(turns[0][0]), len(turns[1][0])]
    assert disk.hits == 1 and device.misses == 1  # the third turn came from disk, after the restart
    for prompt, starts, reply, _ in turns:
        assert reply == fresh(subject, prompt, SEEDED, starts)


def kept_image(subject, prompt, cuts, at) -> bytes:
    """The image of a fresh prefill of prompt[:at] cut at `cuts`, read out of a fresh store."""
    kv = subject.store(1, CONTEXT)
    kit.prefill(subject, kv, 0, prompt, 0, at, [c for c in cuts if c <= at])
    return read_out(kv, 0, at, subject.declarations.image).to_bytes()


def check_state_bytes(subject, tmp_path) -> None:
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path)
    eng = disk_engine(subject, mem, disk)
    eng.start()
    try:
        (prompt, starts, _, _), = chat(eng, disk, [], USERS[:1])
    finally:
        eng.close()
    disk = open_disk(subject, mem, tmp_path)
    (entry,) = disk.store.entries()
    written = disk.store.read(entry).to_bytes()
    assert written == kept_image(subject, prompt, plan_cuts(len(prompt), starts, CHUNK, MIN_CHUNK), entry.at)
    nxt = prompt + tokens(9, 77)
    state = disk.find(nxt, plan_cuts(len(nxt), (*starts, len(prompt)), CHUNK, MIN_CHUNK))
    claim = mem.take("resumer", CONTEXT)
    assert disk.restore(state, claim, "resumer") == entry.at == len(prompt)
    assert read_out(mem.kv, claim.slot, entry.at, subject.declarations.image).to_bytes() == written
    mem.release(claim)
    disk.close()


def test_the_state_on_disk_is_a_fresh_prefills_image_and_comes_back_byte_equal(subject, tmp_path):
    check_state_bytes(subject, tmp_path)


def test_qwen_fixed_states_on_disk_are_a_fresh_prefills_and_come_back_byte_equal(tmp_path):
    pytest.importorskip("tensorfold_qwen")
    family = load_families(["qwen"])["qwen"]
    family.make_tiny(tmp_path / "m", seed=3)
    subject = kit.load(family, tmp_path / "m")
    assert any(layer.fixed for layer in subject.declarations.layout.layers)
    check_state_bytes(subject, tmp_path / "learned")


def test_a_declined_read_prefills_and_equals_a_fresh_run(subject, tmp_path):
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path, read_bytes_per_s=1.0, prefill_rows_per_s=1e9)
    host = HostTier(mem, budget=1)  # refuses everything: states go to the disk
    eng = disk_engine(subject, mem, disk, host=host)
    eng.start()
    try:
        turns = chat(eng, disk, [], USERS[:2])
    finally:
        eng.close()
    assert [done.cached_tokens for *_, done in turns] == [0, 0] and disk.declined == 1 and disk.hits == 0
    assert host.refused >= 1 and disk.stats().kept >= 1
    for prompt, starts, reply, _ in turns:
        assert reply == fresh(subject, prompt, SEEDED, starts)


# -- boot: --learn-conversations, the identity ----------------------------------------------------------------


def learning(model, root, **flags) -> Settings:
    switches = {"TF_KV_PAGES": True, "TF_KV_POISON": True, "TF_EXAMPLE_REQUEST_STARTS": True,
                "TF_IMPRINT_VERIFY": True}
    return Settings(family="example", model=model, context=CONTEXT, prefill_chunk=CHUNK, min_chunk=MIN_CHUNK,
                    page_rows=16, learn=True, learn_dir=root, learn_min_free_gib=0, switches=switches,
                    **flags)


def one_turn(example, settings, prompt, starts=()) -> tuple[list[int], int, dict]:
    from tensorfold.boot import boot

    loaded = boot(settings, example)
    eng = loaded.engine
    eng.start()
    try:
        client = Client("turn", prompt, SEEDED, starts)
        done = ask(eng, client)
        now = eng.snapshot()
    finally:
        eng.close()
    return client.tokens, done.cached_tokens, {"now": now, "plan": loaded.service.plan}


def test_boot_learns_and_only_the_same_identity_reads_a_state(example, tiny_dir, tmp_path):
    root = tmp_path / "learned"
    first = tokens(80, 5)
    second = first + tokens(12, 6)
    _, cached, seen = one_turn(example, learning(tiny_dir, root), first)
    assert cached == 0 and seen["plan"]["learn"] and seen["plan"]["learn_verify"]
    identity = seen["plan"]["learn_identity"]
    assert (root / identity / "identity.json").is_file() and "disk" in seen["now"]["tiers"]
    reply, cached, seen = one_turn(example, learning(tiny_dir, root), second, starts=(80,))  # the same server again
    assert cached == 80 and seen["plan"]["learn_identity"] == identity and seen["now"]["tiers"]["disk"]["hits"] == 1
    fresh_reply, cached, _ = one_turn(example, learning(tiny_dir, tmp_path / "elsewhere"), second, starts=(80,))
    assert cached == 0 and reply == fresh_reply
    other_config = tmp_path / "edited"
    shutil.copytree(tiny_dir, other_config)
    config = json.loads((other_config / "config.json").read_text())
    (other_config / "config.json").write_text(json.dumps({**config, "note": "edited"}))
    for settings in (learning(tiny_dir, root, dtype="bfloat16"), learning(other_config, root)):
        _, cached, seen = one_turn(example, settings, second, starts=(80,))
        assert cached == 0 and seen["plan"]["learn_identity"] != identity
        assert seen["now"]["tiers"]["disk"]["hits"] == 0
    assert len([p for p in root.iterdir() if p.is_dir()]) == 3
    assert seen["now"]["disk_verify_mismatches"] == 0


def test_learn_flags_without_learn_conversations_are_logged_and_build_no_disk_tier(example, tiny_dir, tmp_path,
                                                                                  caplog):
    from tensorfold.boot import boot

    switches = {"TF_KV_PAGES": True, "TF_KV_POISON": False, "TF_EXAMPLE_REQUEST_STARTS": True}
    loaded = boot(Settings(family="example", model=tiny_dir, context=64, learn_dir=tmp_path / "x", learn_gib=1,
                           switches=switches), example)
    assert loaded.engine.disk is None and "disk" not in loaded.engine.snapshot().get("tiers", {})
    assert "--learn-dir, --learn-gib given without --learn-conversations" in caplog.text
    assert not (tmp_path / "x").exists() and "learn" not in loaded.service.plan
