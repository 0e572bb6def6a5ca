"""The disk tier under a real engine and real files: a chat's turns resume from states on disk (pages poisoned with
NaN) with the replies of a fresh engine, across an engine restart on the same directory; the state on disk is the
image a fresh prefill makes, and one put back reads out byte-equal (example, and qwen's fixed states); a read the
payoff rule declines prefills instead; boot builds the tier from --learn-conversations, its identity probe is
stable, and a server of another identity (dtype, config) never reads a state."""

from __future__ import annotations

import json
import shutil

import pytest
from resume_cases import CHUNK, CONTEXT, MIN_CHUNK, RIG, USERS, Client, ask, fresh, memory, tokens

from tensorfold.engine.api import Sampling
from tensorfold.engine.runner import Engine
from tensorfold.plugins import load_families
from tensorfold.settings import Settings
from tensorfold.testing import engine_gates, kit
from tensorfold.testing.engine_gates import Chat, disk_chat, open_disk, running
from tensorfold.tiers import HostTier

SEEDED = Sampling(temperature=0.9, top_p=0.95, seed=7, max_tokens=10)


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


def disk_engine(subject, mem, disk, device=None, host=None) -> Engine:
    return RIG.engine(subject, mem, device, host, disk)


@pytest.mark.parametrize("pages", [True, False], ids=["pages", "windows"])
def test_a_chat_resumes_from_disk_across_a_restart_as_fresh_runs(subject, tmp_path, pages):
    engine_gates.check_disk_resume_across_restart(subject, RIG, tmp_path, SEEDED, tokens, USERS, pages=pages)


def test_the_state_on_disk_is_a_fresh_prefills_image_and_comes_back_byte_equal(subject, tmp_path):
    engine_gates.check_disk_image(subject, RIG, tmp_path, SEEDED, tokens, USERS[0])


def test_qwen_fixed_states_on_disk_are_a_fresh_prefills_and_come_back_byte_equal(tmp_path):
    pytest.importorskip("tensorfold_qwen")
    family = load_families(["qwen"])["qwen"]
    family.make_tiny(tmp_path / "m", seed=3)
    subject = kit.load(family, tmp_path / "m")
    assert any(layer.fixed for layer in subject.declarations.layout.layers)
    engine_gates.check_disk_image(subject, RIG, tmp_path / "learned", SEEDED, tokens, USERS[0])


def test_a_declined_read_prefills_and_equals_a_fresh_run(subject, tmp_path):
    mem = memory(subject)
    disk = open_disk(subject, mem, tmp_path, read_bytes_per_s=1.0, prefill_rows_per_s=1e9)
    host = HostTier(mem, budget=1)  # refuses everything: states go to the disk
    with running(disk_engine(subject, mem, disk, host=host)) as eng:
        turns = disk_chat(eng, disk, Chat(tokens), SEEDED, USERS[:2]).turns
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
