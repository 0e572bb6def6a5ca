"""Partitions in the rows store: the shared partition's names are the names stores had before partitions (fixed
names), a partition is folded into h₀ so a salted state and its blocks have names no other partition's tokens make,
a salted state is found only in its partition and reads back byte-equal across a reopen, its file records the
partition digest and nothing else of it, and `learned verify` and a read recheck its names with that word."""

from __future__ import annotations

import hashlib
import struct

import pytest
from rows_cases import files, image, open_store, tokens, write

from tensorfold import learned
from tensorfold.rows.api import Damaged
from tensorfold.rows.files import STATE, read_file, read_header, write_file
from tensorfold.rows.names import Chain, seed, state_key
from tensorfold.server.isolation import partition_of

IDENTITY = "0123456789abcdef0123456789abcdef"
PROMPT = tuple(range(100, 140))
A = partition_of("salt a", None)
B = partition_of("salt b", None)
CUTS = (8, 16, 20)


def salted_write(store, prompt, at: int = 20, partition: str = A):
    return store.write(prompt[:at], CUTS, image(prompt, at), partition=partition)


def test_the_shared_partition_keeps_the_names_stores_had_before_partitions():
    chain = Chain(IDENTITY, 8, PROMPT)
    assert chain.at(0) == seed(IDENTITY, 8) == hashlib.sha256(IDENTITY.encode() + struct.pack("<I", 8)).digest()
    assert chain.at(20).hex() == "b23cf98988121f07534cefcf9580990dba8157b39d10f752c01b65febc5e4e37"
    assert chain.blocks(20) == ("71edfb9739b1b15a06e686d38676064a81ada798d9742ba53e0c22816188c266",
                                "e6be47d02161b41b4875dba759a5adf84ece7bdcb39e5407d9e1ad0ec7fe30b8")
    assert state_key(chain.at(20), CUTS) == "5d0aadb8b3aa384421cfb97caead66f26186901018cf9f9a367e265999c8b1e4"


def test_a_partition_is_folded_into_the_seed_and_changes_every_name():
    shared, a, b = (Chain(IDENTITY, 8, PROMPT, p) for p in ("", A, B))
    want = hashlib.sha256(IDENTITY.encode() + struct.pack("<I", 8) + b"partition" + A.encode()).digest()
    assert a.at(0) == seed(IDENTITY, 8, A) == want
    assert len({shared.at(20), a.at(20), b.at(20)}) == 3
    assert set(a.blocks(40)).isdisjoint(shared.blocks(40)) and set(a.blocks(40)).isdisjoint(b.blocks(40))


def test_a_salted_state_is_found_only_in_its_partition_and_reads_back_across_a_reopen(tmp_path):
    prompt = tokens(1, 40)
    with open_store(tmp_path) as store:
        shared = write(store, prompt, 20)
        salted = salted_write(store, prompt)
        assert salted.key != shared.key and set(salted.blocks).isdisjoint(shared.blocks)
        assert len(files(tmp_path, ".st")) == 2 and len(files(tmp_path, ".blk")) == 4
        assert salted_write(store, prompt).key == salted.key and store.stats().written == 2   # written once
        identity = store.identity
    with open_store(tmp_path) as store:
        assert store.lookup(prompt[:30], (*CUTS, 30)).key == shared.key
        assert store.lookup(prompt[:30], (*CUTS, 30), B) is None
        found = store.lookup(prompt[:30], (*CUTS, 30), A)
        assert found.key == salted.key and store.read(found) == image(prompt, 20)
        assert store.tokens(found) == prompt[:20]
    words = {path.stem: read_header(path, STATE).words for path in files(tmp_path, ".st")}
    assert words[salted.key]["partition"] == A and "partition" not in words[shared.key]
    assert all(b"salt a" not in path.read_bytes() for path in tmp_path.rglob("*") if path.is_file())
    assert learned.verify(tmp_path) == {identity: []}


def test_a_partition_on_disk_is_a_digest_never_a_salt(tmp_path):
    with open_store(tmp_path) as store:
        with pytest.raises(ValueError, match="sha256 hex digest"):
            salted_write(store, PROMPT, partition="salt a")
        assert store.stats().written == 0
    assert files(tmp_path, ".st") == [] and files(tmp_path, ".blk") == []


def rewrite_partition(path, partition: str) -> None:
    """Give a state file another partition word, with a valid trailer: only its names can tell."""
    words, body = read_file(path, STATE)
    write_file(path, STATE, {**words, "partition": partition}, [body])


def test_a_state_whose_partition_word_differs_from_its_names_fails_verify_and_its_read(tmp_path):
    with open_store(tmp_path) as store:
        salted = salted_write(store, PROMPT)
        path = store.directory / "states" / f"{salted.key}.st"
        identity = store.identity
    rewrite_partition(path, B)
    assert learned.verify(tmp_path) == {identity: [(str(path), "its tokens do not hash to its name")]}
    with open_store(tmp_path) as store:
        found = store.lookup(PROMPT[:30], (*CUTS, 30), A)
        with pytest.raises(Damaged, match="do not hash to its name"):
            store.read(found)
        assert store.lookup(PROMPT[:30], (*CUTS, 30), A) is None and store.stats().damaged == 1


def test_a_partition_word_that_is_no_digest_is_forgotten_at_startup(tmp_path):
    with open_store(tmp_path) as store:
        path = store.directory / "states" / f"{salted_write(store, PROMPT).key}.st"
    rewrite_partition(path, "salt a")
    with open_store(tmp_path) as store:
        assert store.stats().damaged == 1 and store.entries() == [] and not path.exists()


def test_exact_finds_the_state_for_exactly_its_tokens_cuts_and_partition(tmp_path):
    """A follower finds its part of the state rank 0 chose by tokens, cuts and partition (tiers/disk_mirror.py)."""
    prompt = tokens(1, 40)
    with open_store(tmp_path) as store:
        shared = write(store, prompt, 20)
        salted = salted_write(store, prompt)
        assert store.exact(prompt[:20], shared.cuts).key == shared.key
        assert store.exact(prompt[:20], CUTS, A).key == salted.key
        assert store.exact(prompt[:20], CUTS, B) is None
        assert store.exact(prompt[:19], tuple(c for c in CUTS if c <= 19), A) is None      # not kept at 19
        assert store.exact(prompt[:20], (8, 20), A) is None                                # cut otherwise
        assert store.exact((), ()) is None
