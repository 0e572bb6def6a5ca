"""On a CUDA device, kept states on disk across a real restart: one process writes them at shutdown, a second
process (its own CUDA context and kernel tuning, as a restarted server) resumes the chats' next turn from disk, a
third runs the same requests fresh. The replies are equal, every restored state is byte-equal to the kept one,
and both processes agree on the identity (its probe state's hash included), so the second one reads at all.
Skipped without CUDA; run in device sessions (`pytest -m gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorfold_qwen import plugin

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
SCRIPT = Path(__file__).with_name("cuda_disk_turns.py")


def phase(name: str, checkpoint: Path, root: Path, out: Path, requests: Path | None = None) -> dict:
    args = [sys.executable, str(SCRIPT), name, str(checkpoint), str(root), str(out)]
    done = subprocess.run(args + ([str(requests)] if requests else []), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"phase {name} failed:\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_resumed_from_disk_after_a_restart_equals_fresh_on_cuda(tmp_path):
    checkpoint, root = tmp_path / "model", tmp_path / "learned"
    plugin.write_tiny(checkpoint, seed=6)
    written = phase("write", checkpoint, root, tmp_path / "write.json")
    requests = tmp_path / "requests.json"
    requests.write_text(json.dumps(written["requests"]))
    assert written["disk"]["disk_written"] >= 2 and written["disk"]["disk_dropped"] == 0, written["disk"]
    resumed = phase("resume", checkpoint, root, tmp_path / "resume.json", requests)
    fresh = phase("fresh", checkpoint, root, tmp_path / "fresh.json", requests)
    assert resumed["identity"] == written["identity"], "the restarted process computed another probe state"
    assert all(cached > 0 for cached in resumed["cached"]), resumed["cached"]
    assert resumed["disk"]["disk_hits"] == len(written["requests"]) and resumed["disk"]["disk_failed_reads"] == 0
    assert resumed["restored_equal"] == [True] * len(written["requests"])
    assert all(cached == 0 for cached in fresh["cached"])
    assert resumed["replies"] == fresh["replies"]
