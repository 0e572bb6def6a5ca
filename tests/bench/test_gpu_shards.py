"""bench/gpu_tests.sh runs only the paths its shards file names: a GPU test file left out never runs on a device."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARDS = ROOT / "bench" / "gpu_test_shards.txt"
GPU_MARK = re.compile(r"pytest\.mark\.gpu|mark\.gpu\b")
TEST_ROOTS = ("tests", "core", "plugins", "tensorfold_qwen", "tensorfold_glm", "tensorfold_nemotron")


def shard_paths() -> list[list[str]]:
    """Each shard's paths, as the script reads them (blank lines and comments skipped)."""
    lines = SHARDS.read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def gpu_test_files() -> list[str]:
    """Every test file under the repository that carries a GPU mark, relative to the root."""
    found = []
    for top in TEST_ROOTS:
        for path in sorted((ROOT / top).rglob("test_*.py")):
            if ".venv" in path.parts or "site-packages" in path.parts:
                continue
            if GPU_MARK.search(path.read_text(encoding="utf-8")):
                found.append(path.relative_to(ROOT).as_posix())
    return found


def test_every_gpu_test_file_is_in_a_shard() -> None:
    named = [path.rstrip("/") for shard in shard_paths() for path in shard]
    missing = [f for f in gpu_test_files() if not any(f == p or f.startswith(p + "/") for p in named)]
    assert missing == []


def test_every_shard_path_exists_and_no_path_runs_twice() -> None:
    named = [path.rstrip("/") for shard in shard_paths() for path in shard]
    assert [p for p in named if not (ROOT / p).exists()] == []
    assert len(named) == len(set(named))
    assert len(shard_paths()) >= 2
