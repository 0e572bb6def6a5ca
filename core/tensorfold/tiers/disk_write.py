"""The disk tier's I/O thread job (tiers/disk.py): a staged state's image, made from its host copies once they land,
written to the rows store unless it is there already or a cap skips it; with TF_IMPRINT_VERIFY, read back and
compared with what was written."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tensorfold.image import ImageFormat, read_out
from tensorfold.kv import KvStore
from tensorfold.memory_plan import size
from tensorfold.rows.api import Damaged, StateEntry, why_skipped
from tensorfold.tiers.staged import CopiesView, Staged

if TYPE_CHECKING:
    from tensorfold.rows.store import RowsStore

log = logging.getLogger(__name__)


class DiskWrites:
    """Writes each staged state into `store` on the I/O thread (rows/writer.py), counting those a cap skips and
    those on disk already; `verify` reads each one written back."""

    def __init__(self, kv: KvStore, store: RowsStore, fmt: ImageFormat, verify: bool = False) -> None:
        self.kv = kv
        self.store = store
        self.fmt = fmt
        self.verify = verify
        self.on_disk_already = self.skipped = self.verified = self.mismatches = 0

    def write(self, job: Staged) -> None:
        """Make the state's image and write it, once its host copies are whole."""
        job.settle()                               # its copies out of the device have landed
        began = time.monotonic()
        image = read_out(CopiesView(self.kv.layout, job), 0, job.at, self.fmt)
        reasons = ", ".join(sorted(job.why)) or "kept"
        before = self.store.stats()
        entry = self.store.write(job.tokens, job.cuts, image, used=job.used, partition=job.partition)
        after = self.store.stats()
        if entry is None:
            self.skipped += 1
            log.info("not kept on disk at %s (%s): %s", f"{job.at:,}", reasons, why_skipped(before, after))
            return
        if after.written == before.written:
            self.on_disk_already += 1
            log.debug("already kept at %s (%s) on disk", f"{job.at:,}", reasons)
            return
        log.info("kept at %s (%s) on disk: %s in %.3f s", f"{job.at:,}", reasons, size(entry.nbytes),
                 time.monotonic() - began)
        if self.verify:
            self._verify(entry, image.to_bytes())

    def _verify(self, entry: StateEntry, written: bytes) -> None:
        """TF_IMPRINT_VERIFY: read the state back and compare its bytes with what was written."""
        try:
            back = self.store.read(entry, use=False).to_bytes()
        except Damaged as err:
            back, problem = b"", str(err)
        else:
            problem = "" if back == written else f"{len(back)} bytes read back differ from {len(written)} written"
        self.verified += 1
        if problem:
            self.mismatches += 1
            log.error("TF_IMPRINT_VERIFY: the state at %s read back wrong: %s", f"{entry.at:,}", problem)
