"""The embedded default: a family's tiny checkpoint, made once on first use in the user cache directory."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from tensorfold import __version__
from tensorfold.family import Family

log = logging.getLogger(__name__)
SEED = 0


def embedded_checkpoint(family: Family, cache_dir: Path) -> Path:
    """The directory of the family's embedded default, written atomically if it is not there yet."""
    target = cache_dir / "embedded" / f"{family.name}-{__version__}-seed{SEED}"
    if (target / "config.json").is_file():
        log.info("serving the embedded default of family %s from %s", family.name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".making-", dir=target.parent))
    try:
        family.make_tiny(staging, seed=SEED)
        staging.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("no --model given: wrote the embedded default of family %s to %s and serving it", family.name, target)
    return target
