"""A state read is a pipeline: one reader thread reads the blocks in order, then the state file, one after another;
each chunk's sha256 runs on the hashing thread behind the read, so the reader goes on with the next chunk and the
next file; each block's rows go to `put` on the calling thread as soon as the block is verified, once per block,
while the later files are still read; a damaged file still fails the whole read by name, and nothing reads into
the caller's buffer once the read returns or raises. The index remembers each state's block rows (from its words
at startup, from the store when written)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from rows_cases import BLOCK, OFFSET, files, image, open_store, tokens, write

from tensorfold.rows import assemble as rows_assemble
from tensorfold.rows import files as rows_files
from tensorfold.rows.api import Damaged
from tensorfold.rows.files import BLOCK as BLOCK_MAGIC
from tensorfold.rows.files import read_file, write_file


@pytest.mark.parametrize("at", [5, 8, 20, 33], ids=lambda a: f"at{a}")
def test_each_verified_block_is_put_once_on_the_reading_thread_with_its_bytes(tmp_path, at):
    prompt = tokens(1, 40)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, at)
        want = image(prompt, at)
        puts = []
        got = store.read(entry, put=lambda first, rows, data: puts.append(
            (first, rows, bytes(data), threading.get_ident())))
        assert got == want
        assert sorted((first, rows) for first, rows, _, _ in puts) == [(i * BLOCK, BLOCK) for i in range(at // BLOCK)]
        for first, rows, data, thread in puts:
            assert data == bytes(want.rows[OFFSET(first): OFFSET(first + rows)])
            assert thread == threading.get_ident()


def test_a_damaged_block_fails_the_read_and_puts_nothing_of_it(tmp_path):
    prompt = tokens(2, 40)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, 24)
        block = tmp_path / store.identity / "blocks" / f"{entry.blocks[2]}.blk"
        data = bytearray(block.read_bytes())
        data[len(data) // 2] ^= 0xFF
        block.write_bytes(bytes(data))
        puts = []
        with pytest.raises(Damaged, match="sha256") as raised:
            store.read(entry, put=lambda first, rows, data: puts.append(first))
        assert raised.value.path == str(block)
        assert 2 * BLOCK not in puts and store.stats().damaged == 1 and store.lookup(prompt, (8, 16, 24, 30)) is None


def test_a_damaged_state_file_fails_the_read_after_its_blocks(tmp_path):
    prompt = tokens(3, 40)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, 20)
        (state,) = files(tmp_path, ".st")
        data = bytearray(state.read_bytes())
        data[-50] ^= 0xFF
        state.write_bytes(bytes(data))
        with pytest.raises(Damaged) as raised:
            store.read(entry, put=lambda first, rows, data: None)
        assert raised.value.path == str(state) and store.stats().damaged == 1


def test_the_index_knows_each_states_block_rows_after_a_write_and_after_a_restart(tmp_path):
    prompt = tokens(4, 40)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, 20)
        assert store._own.block_rows == {entry.key: BLOCK}
    with open_store(tmp_path) as store:
        assert store._own.block_rows == {entry.key: BLOCK}
        assert store.read(entry) == image(prompt, 20)
        store.remove(entry.key)
        assert store._own.block_rows == {}


class Recording:
    """A hashing executor stand-in that runs each submitted update at once and counts them."""

    def __init__(self) -> None:
        self.calls = 0

    def submit(self, fn, *args):
        from concurrent.futures import Future

        self.calls += 1
        done: Future = Future()
        done.set_result(fn(*args))
        return done


@pytest.mark.parametrize("flip", [None, 100, 5000], ids=["intact", "early", "late"])
def test_a_body_of_many_chunks_is_hashed_chunk_by_chunk_on_the_hashing_thread(tmp_path, monkeypatch, flip):
    monkeypatch.setattr(rows_files, "CHUNK", 1024)
    recording = Recording()
    monkeypatch.setattr(rows_files, "_HASHER", recording)
    body = bytes(range(256)) * 24                     # 6 KiB: six chunks
    path = tmp_path / "x.blk"
    write_file(path, BLOCK_MAGIC, {"body": len(body)}, [body])
    if flip is not None:
        data = bytearray(path.read_bytes())
        data[flip] ^= 0x01
        path.write_bytes(bytes(data))
    if flip is None:
        words, got = read_file(path, BLOCK_MAGIC)
        assert bytes(got) == body and words == {"body": len(body)}
    else:
        with pytest.raises(Damaged):
            read_file(path, BLOCK_MAGIC)
    assert recording.calls == 7                       # every chunk hashed once, then the trailer checked, there:
    small = tmp_path / "small.blk"                    # a flipped byte in any of them is seen
    write_file(small, BLOCK_MAGIC, {"body": 10}, [b"0123456789"])
    before = recording.calls
    assert bytes(read_file(small, BLOCK_MAGIC)[1]) == b"0123456789" and recording.calls == before + 2


def test_files_are_read_in_order_on_one_reader_thread_and_put_back_while_the_later_ones_are_read(tmp_path,
                                                                                                   monkeypatch):
    prompt = tokens(5, 40)
    read_started = rows_files.read_started
    order: list[tuple[str, int]] = []
    first_put = threading.Event()
    waited: list[bool] = []

    def recording(path: Path, magic: bytes, into=None):
        order.append((path.suffix, threading.get_ident()))
        if len(order) == 3:                           # the third file is read only once the first block is put
            waited.append(first_put.wait(60))        # back: no deadlock, so the put did not wait for the reads
        return read_started(path, magic, into)

    monkeypatch.setattr(rows_assemble, "read_started", recording)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, 33)
        got = store.read(entry, put=lambda first, rows, data: first_put.set())
        assert got == image(prompt, 33)
    assert [suffix for suffix, _ in order] == [".blk"] * len(entry.blocks) + [".st"]
    threads = {thread for _, thread in order}
    assert len(threads) == 1 and threading.get_ident() not in threads and waited == [True]


def test_the_rows_go_into_the_callers_buffer_and_no_reader_is_left_after_a_failed_read(tmp_path):
    prompt = tokens(6, 40)
    with open_store(tmp_path) as store:
        entry = write(store, prompt, 24)
        buffers: list[bytearray] = []

        def into(nbytes: int) -> memoryview:
            buffers.append(bytearray(nbytes))
            return memoryview(buffers[-1])

        got = store.read(entry, into=into)
        assert got == image(prompt, 24) and bytes(buffers[0]) == bytes(got.rows)
        block = tmp_path / store.identity / "blocks" / f"{entry.blocks[0]}.blk"
        data = bytearray(block.read_bytes())
        data[len(data) // 2] ^= 0xFF
        block.write_bytes(bytes(data))
        with pytest.raises(Damaged):
            store.read(entry, into=into)
    assert not [t for t in threading.enumerate() if t.name == "tf-rows-read"]
