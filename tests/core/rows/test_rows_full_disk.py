"""The rows store on a real small file system (a 4 MiB tmpfs, mounted as root; skipped, saying why, where mounting
is not permitted) that is full or read-only: the store opens writing nothing, says why in one log line, and the
states already there still read back; the server's startup checks let it through."""

from __future__ import annotations

import logging
import math

import pytest
from rows_cases import image, open_store, tokens, write

from tensorfold.rows.api import StoreRefused
from tensorfold.settings import Settings
from tensorfold.startup_checks import learn_refusals
from tensorfold.testing.small_disk import fill, read_only, tmpfs


@pytest.fixture
def disk(tmp_path):
    with tmpfs(tmp_path / "disk") as mounted:
        yield mounted


def writes_nothing_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "writes nothing to" in r.getMessage()]


def test_a_new_store_on_a_full_disk_opens_writing_nothing_and_says_why(disk, caplog):
    fill(disk)
    root = disk / "learned"
    assert learn_refusals(Settings(learn=True, learn_dir=root)) == []
    with caplog.at_level(logging.WARNING, logger="tensorfold.rows.store"), open_store(root) as store:
        assert store.writes_off == f"{root / 'FORMAT'} could not be written: [Errno 28] No space left on device"
        rate = store.read_bandwidth(1 << 20)
        assert rate > 0 and math.isfinite(rate)
        assert store.entries() == [] and store.writes_off.endswith("No space left on device")
    assert writes_nothing_lines(caplog) == [f"rows store: writes nothing to {root}: {store.writes_off}; serving goes "
                                            "on, and states already there may still be read"]
    assert not (root / "FORMAT").exists() and list(root.rglob("*.part")) == []


def test_a_store_whose_disk_filled_up_reads_its_states_and_writes_nothing(disk, caplog):
    root = disk / "learned"
    with open_store(root) as store:
        kept = write(store, tokens(1, 40), 24)
    fill(disk)
    with caplog.at_level(logging.WARNING, logger="tensorfold.rows.store"), open_store(root) as store:
        assert store.writes_off is None                  # nothing startup wrote needed room
        assert store.read_bandwidth(32 << 20) > 0
        assert store.writes_off == (f"the read probe's scratch file ({1 << 20} bytes) could not be written in "
                                    f"{store.directory}: [Errno 28] No space left on device")
        assert store.read(store.lookup(tokens(1, 40), (8, 16, 24, 40))) == image(tokens(1, 40), 24)
        assert [e.key for e in store.entries()] == [kept.key]
    assert len(writes_nothing_lines(caplog)) == 1
    assert list(root.rglob("*.part")) == []


def test_a_read_only_store_is_served_reading_and_still_locked(disk):
    root = disk / "learned"
    with open_store(root) as store:
        kept = write(store, tokens(1, 40), 24)
    read_only(disk)
    assert learn_refusals(Settings(learn=True, learn_dir=root)) == []
    with open_store(root) as store:
        store.read_bandwidth(1 << 20)
        assert store.writes_off == (f"the read probe's scratch file ({1 << 20} bytes) could not be written in "
                                    f"{store.directory}: [Errno 30] Read-only file system: "
                                    f"'{store.directory / 'bandwidth.part'}'")
        assert store.read(kept) == image(tokens(1, 40), 24)
        with pytest.raises(StoreRefused, match="in use by another tensorfold server"):
            open_store(root)                              # the lock a server made before is taken read-only


def test_a_read_only_disk_with_no_lock_yet_opens_unlocked_writing_nothing(disk):
    root = disk / "learned"
    root.mkdir(mode=0o700)
    read_only(disk)
    with open_store(root) as store:
        assert store.writes_off == f"{root / 'lock'} could not be made: [Errno 30] Read-only file system: " \
                                   f"'{root / 'lock'}'"
        assert store.entries() == [] and store.read_bandwidth(1 << 20) > 0
