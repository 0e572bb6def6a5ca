"""Faults in the rows store's files, each met without a crash: the damaged state is forgotten (with the blocks
only it listed) and counted, the message names the file, every other state still reads back byte-equal."""

from __future__ import annotations

import os

import pytest
from rows_cases import FACTS, files, image, open_store, tokens, write

from tensorfold.rows.api import Damaged, StoreRefused

A, B = tokens(1, 40), tokens(2, 40)


def two_states(store):
    """State a (20 rows: 2 blocks and a tail) and an unrelated state b (12 rows)."""
    return write(store, A, 20), write(store, B, 12)


def block_file(store, entry, index=0):
    return store.directory / "blocks" / f"{entry.blocks[index]}.blk"


def state_file(store, entry):
    return store.directory / "states" / f"{entry.key}.st"


def flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def forgotten_on_read(store, a, b, match):
    with pytest.raises(Damaged, match=match):
        store.read(a)
    assert store.lookup(A[:30], (8, 16, 20, 30)) is None
    assert [e.key for e in store.entries()] == [b.key]
    assert store.stats().damaged == 1
    assert store.read(b) == image(B, 12)


def test_a_truncated_block_is_named_and_its_state_forgotten(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        path = block_file(store, a, 1)
        os.truncate(path, path.stat().st_size - 7)
        forgotten_on_read(store, a, b, f"{path.name}.*bytes, its words say")
        assert not path.exists() and not block_file(store, a, 0).exists() and not state_file(store, a).exists()


def test_a_flipped_byte_in_a_state_file_fails_its_hash(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        path = state_file(store, a)
        flip(path, path.stat().st_size - 60)
        forgotten_on_read(store, a, b, f"{path.name}: sha256 of the payload differs")
        assert len(files(tmp_path, ".blk")) == 1     # a's two blocks went with it, b's one stays


def test_a_flipped_byte_in_a_shared_block_forgets_every_state_listing_it(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        longer = write(store, A, 28)
        path = block_file(store, a, 0)
        flip(path, path.stat().st_size - 50)
        with pytest.raises(Damaged, match="sha256"):
            store.read(longer)
        assert [e.key for e in store.entries()] == [b.key] and store.stats().damaged == 2
        assert store.read(b) == image(B, 12)
        assert write(store, A, 20) is not None and store.read(store.entries()[-1]) == image(A, 20)


def test_a_deleted_block_is_a_clean_miss(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        block_file(store, a, 0).unlink()
        forgotten_on_read(store, a, b, "cannot be read")


@pytest.mark.parametrize("fault", ["truncated block", "deleted block", "flipped header", "torn state"])
def test_startup_forgets_what_fails_its_header_or_blocks(tmp_path, fault):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        blk, st = block_file(store, a, 1), state_file(store, a)
    if fault == "truncated block":
        os.truncate(blk, blk.stat().st_size - 1)
    elif fault == "deleted block":
        blk.unlink()
    elif fault == "flipped header":
        flip(st, 1)
    else:
        os.truncate(st, st.stat().st_size - 10)
    with open_store(tmp_path) as store:
        assert [e.key for e in store.entries()] == [b.key]
        assert store.stats().damaged == 1
        assert not st.exists() and len(files(tmp_path, ".blk")) == 1
        assert store.read(b) == image(B, 12)
        assert store.verify() == []


def test_leftover_parts_and_orphan_blocks_are_removed_at_startup(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        orphan = store.directory / "blocks" / ("0" * 64 + ".blk")
        orphan.write_bytes(block_file(store, a).read_bytes())
        parts = [store.directory / "states" / "x.st.part", store.directory / "blocks" / "y.blk.part",
                 tmp_path / "budget.json.part"]
        for part in parts:
            part.write_bytes(b"half a file")
        assert (str(orphan), "no state lists this block") in store.verify()
    with open_store(tmp_path) as store:
        assert not orphan.exists() and not any(p.exists() for p in parts)
        assert store.stats().parts_removed == 3 and store.stats().orphans_removed == 1
        assert store.stats().damaged == 0 and len(store.entries()) == 2
        assert store.read(a) == image(A, 20)


def test_verify_names_every_file_that_fails(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        assert store.verify() == []
        flip(block_file(store, a, 1), 40)
        flip(state_file(store, b), 80)
        found = dict(store.verify())
        assert set(found) == {str(block_file(store, a, 1)), str(state_file(store, b))}
        assert all("sha256" in problem for problem in found.values())
        assert len(store.entries()) == 2    # verify reports, it removes nothing


def test_an_unknown_format_version_is_refused_by_name(tmp_path):
    with open_store(tmp_path):
        pass
    (tmp_path / "FORMAT").write_text("7\n")
    with pytest.raises(StoreRefused, match=f"{tmp_path / 'FORMAT'} names rows store format '7'"):
        open_store(tmp_path)
    (tmp_path / "FORMAT").write_text("1\n")
    with open_store(tmp_path):
        pass     # the refusal let go of the lock


def test_a_second_store_on_a_locked_root_is_refused_by_name(tmp_path):
    with open_store(tmp_path):
        held = f"{tmp_path} is in use by another tensorfold server \\(pid {os.getpid()}\\)"
        with pytest.raises(StoreRefused, match=held):
            open_store(tmp_path, {**FACTS, "dtype": "other"})
    with open_store(tmp_path):
        pass


def test_a_root_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreRefused, match="cannot be opened"):
        open_store(tmp_path / "file" / "learned")


def test_a_write_the_file_system_refuses_is_counted_and_nothing_is_kept(tmp_path):
    with open_store(tmp_path) as store:
        a, _ = two_states(store)
        states = store.directory / "states"
        for path in states.iterdir():
            path.unlink()
        states.rmdir()
        states.write_text("a file where the states directory was")
        assert write(store, A, 28) is None
        assert store.stats().write_failed == 1
        assert len(files(tmp_path, ".blk")) == 3    # the failed state's new block was removed again
        states.unlink()
        states.mkdir()
        assert write(store, tokens(3, 40), 12) is not None


def test_a_state_removed_after_its_lookup_is_a_miss_not_damage(tmp_path):
    with open_store(tmp_path) as store:
        a, b = two_states(store)
        found = store.lookup(A[:30], (8, 16, 20, 30))
        store.remove(found.key)
        with pytest.raises(Damaged, match="no longer kept"):
            store.read(found)
        assert store.stats().damaged == 0 and len(files(tmp_path, ".blk")) == 1
        store.remove(found.key)    # removing what is not kept does nothing
        assert store.read(b) == image(B, 12)
