"""The rows store with real files: a state comes back byte-equal (on and off the block grid, with a pooled row
state), states sharing a prefix share its blocks, lookup finds only what a pass may resume from, a reopened store
finds what the last one wrote, another identity's states are never found."""

from __future__ import annotations

import stat
import threading

import pytest
from rows_cases import BLOCK, FACTS, FMT, LAYOUT, OFFSET, files, image, open_store, tokens, write

from tensorfold.image import StateImage, put_back, read_out
from tensorfold.kv import WindowStore
from tensorfold.rows.names import Chain, state_key
from tensorfold.rows.store import list_identities


@pytest.mark.parametrize("at", [3, 4, 8, 13, 24, 29], ids=lambda a: f"at{a}")
def test_write_then_read_is_byte_equal(tmp_path, at):
    prompt = tokens(1, 40)
    with open_store(tmp_path) as store:
        kept = image(prompt, at)
        entry = write(store, prompt, at)
        assert entry is not None and entry.at == at and len(entry.blocks) == at // BLOCK
        back = store.read(entry)
        assert back == kept and back.to_bytes() == kept.to_bytes()
        kv = WindowStore(LAYOUT, slots=1, capacity=at)
        put_back(kv, 0, StateImage.from_bytes(back.to_bytes()), FMT)
        assert read_out(kv, 0, at, FMT) == kept
        stats = store.stats()
        assert (stats.states, stats.written, stats.reads, stats.damaged) == (1, 1, 1, 0)
        assert stats.bytes == sum(p.stat().st_size for p in files(tmp_path, ".st") + files(tmp_path, ".blk"))


def test_the_root_is_private_and_marked(tmp_path):
    root = tmp_path / "learned"
    with open_store(root) as store:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert (root / "FORMAT").read_text() == "1\n"
        assert (store.directory / "identity.json").exists()
        assert (root / "lock").read_text().strip().isdigit()


def test_states_sharing_a_prefix_share_its_blocks(tmp_path):
    first = tokens(1, 40)
    second = first[:16] + tokens(2, 24)
    with open_store(tmp_path) as store:
        a = write(store, first, 20)
        b = write(store, second, 28)
        assert a.blocks == b.blocks[:2] and b.blocks[2] not in a.blocks
        assert len(files(tmp_path, ".blk")) == 3 and len(files(tmp_path, ".st")) == 2
        c = write(store, first, 30)   # first's conversation goes on: its blocks 0 and 1 again, block 2 new
        assert c.blocks[:2] == a.blocks and len(files(tmp_path, ".blk")) == 4
        for entry, prompt in ((a, first), (b, second), (c, first)):
            assert store.read(entry) == image(prompt, entry.at)
        assert store.stats().written_bytes < sum(e.nbytes for e in (a, b, c))


def test_writing_a_kept_state_again_writes_nothing(tmp_path):
    prompt = tokens(3, 20)
    with open_store(tmp_path) as store:
        first = write(store, prompt, 20)
        again = write(store, prompt, 20)
        assert again.key == first.key and again.used > first.used
        assert store.stats().written == 1 and len(store.entries()) == 1


def test_lookup_finds_the_longest_state_a_pass_may_resume_from(tmp_path):
    prompt = tokens(4, 40)
    with open_store(tmp_path) as store:
        eight = write(store, prompt, 8, cuts=(8,))
        sixteen = write(store, prompt, 16, cuts=(8, 16))
        twenty = write(store, prompt, 20, cuts=(8, 16, 20))
        assert store.lookup(prompt[:30], (8, 16, 20, 30)) == twenty
        assert store.lookup(prompt[:20], (8, 16, 20)) == sixteen      # at < len(prompt): a row is left to run
        assert store.lookup(prompt[:17], (8, 16, 17)) == sixteen
        assert store.lookup(prompt[:30], (8, 16, 30)) == sixteen      # 20 is not a cut of this pass
        assert store.lookup(prompt[:30], (8, 30)) == eight
        assert store.lookup(prompt[:30], (6, 16, 20, 30)) is None     # cuts below 16 differ: not resumable
        assert store.lookup(prompt[:8], (8,)) is None
        changed = prompt[:3] + (prompt[3] + 1,) + prompt[4:30]
        assert store.lookup(changed, (8, 16, 20, 30)) is None         # tokens differ inside every state
        late = prompt[:18] + (prompt[18] + 1,) + prompt[19:30]
        assert store.lookup(late, (8, 16, 20, 30)) == sixteen         # they differ only past 16


def test_equal_tokens_cut_differently_are_two_states(tmp_path):
    prompt = tokens(5, 20)
    with open_store(tmp_path) as store:
        grid = write(store, prompt, 16, cuts=(8, 16))
        starts = write(store, prompt, 16, cuts=(5, 16))
        assert grid.key != starts.key and grid.blocks == starts.blocks
        assert store.lookup(prompt, (5, 16, 20)) == starts
        assert store.lookup(prompt, (8, 16, 20)) == grid


def test_a_reopened_store_finds_what_the_last_one_wrote(tmp_path):
    prompt = tokens(6, 40)
    with open_store(tmp_path) as store:
        older = write(store, prompt, 13)
        newer = write(store, tokens(7, 40), 24)
        store.read(older)
        store.read(older)
    with open_store(tmp_path) as store:
        assert [e.key for e in store.entries()] == [newer.key, older.key]   # least recently used first
        found = store.lookup(prompt[:20], (8, 13, 20))
        assert found is not None and found.key == older.key and found.hits == 2
        assert store.read(found) == image(prompt, 13)
        assert store.tokens(found) == prompt[:13]
        assert store.verify() == []


def test_another_identity_is_never_found(tmp_path):
    prompt = tokens(8, 30)
    with open_store(tmp_path) as store:
        write(store, prompt, 16)
    other_facts = {**FACTS, "dtype": "float16"}
    with open_store(tmp_path, other_facts) as other:
        assert other.entries() == [] and other.lookup(prompt, (8, 16, 30)) is None
        write(other, prompt, 16)
        assert other.stats().states == 1
    listed = {name: (facts, entries) for name, facts, entries in list_identities(tmp_path)}
    assert len(listed) == 2
    assert sorted(facts["dtype"] for facts, _ in listed.values()) == ["bfloat16", "float16"]
    assert all(len(entries) == 1 for _, entries in listed.values())


def test_names_chain_block_by_block():
    prompt = tokens(9, 40)
    chain = Chain("id", BLOCK, prompt)
    prefix = Chain("id", BLOCK, prompt[:20])
    assert chain.blocks(40)[:2] == prefix.blocks(20) and chain.at(20) == prefix.at(20)
    assert chain.at(16) == chain.head(2) and chain.at(0) == chain.head(0)
    assert Chain("id", 16, prompt).blocks(32)[0] != chain.blocks(32)[1]   # another grid, other names
    assert Chain("other", BLOCK, prompt).at(20) != chain.at(20)
    assert state_key(chain.at(16), (8, 16)) != state_key(chain.at(16), (16,))


def test_row_offsets_match_the_image():
    assert OFFSET(13) == len(image(tokens(1, 13), 13).rows) == 13 * 4 + 3 * 12


def test_lookups_and_reads_go_on_while_another_thread_writes(tmp_path):
    prompt = tokens(10, 40)
    errors: list[BaseException] = []
    with open_store(tmp_path, cap_bytes=1 << 40) as store:
        kept = write(store, prompt, 16)

        def writer():
            try:
                for seed in range(20, 40):
                    write(store, tokens(seed, 40), 20)
            except BaseException as error:  # reported below, on the test's thread
                errors.append(error)

        thread = threading.Thread(target=writer)
        thread.start()
        while thread.is_alive():
            assert store.lookup(prompt[:20], (8, 16, 20)).key == kept.key
            assert store.read(kept) == image(prompt, 16)
        thread.join()
        assert errors == [] and store.stats().states == 21 and store.stats().damaged == 0
