"""bench/tp_resume.py's CPU smoke: real `tensorfold serve --tp 2` servers (gloo) on the tiny dense Qwen shape,
float32: each chat's second turn resumed from the host tier, and from disk across a SIGTERM restart, gives the
fresh turn's tokens, and every record the device run reads is there (no timing is checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tp_resume import divergence  # bench/ is on sys.path (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CHATS = 2


@pytest.mark.slow                      # three servers of two ranks each, one checkpoint written
def test_tp2_resumed_turns_equal_fresh_ones_from_host_and_disk(tmp_path):
    command = [sys.executable, str(ROOT / "bench" / "tp_resume.py"), "--device", "cpu", "--shape", "qwen3_5-tiny",
               "--dtype", "float32", "--tiers", "host", "disk", "--history", "40", "--tokens", "4",
               "--conversations", str(CHATS), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "tp_resume.jsonl").read_text().splitlines()]
    by: dict[str, list[dict]] = {}
    for record in records:
        by.setdefault(record["bench"], []).append(record)
    assert by["tp_resume_checkpoint"][0]["vocab_size"] > 0
    turns = by["tp_resume"]
    assert sorted((r["tier"], r["chat"]) for r in turns) == [(t, c) for t in ("disk", "host") for c in range(CHATS)]
    for record in turns:
        assert record["equal"] and record["ok"] and record["first_divergence"] is None, record
        assert record["serving_tier"] == record["tier"] and record["fresh_cached_tokens"] == 0
        assert 0 < record["cached_tokens"] < record["prompt_tokens"] and record["tokens"] == 4
    kept = {r["tier"]: r for r in by["tp_resume_kept"]}
    assert kept["host"]["rank0_states"] >= CHATS and kept["host"]["rank0_bytes"] > 0
    disk = kept["disk"]
    assert disk["written_at_shutdown"] >= CHATS and disk["dropped"] == 0
    assert set(disk["store_bytes"]) == {"rank-0", "rank-1"} and min(disk["store_bytes"].values()) > 0
    assert by["tp_resume_all"] == [{"bench": "tp_resume_all", "shape": "qwen3_5-tiny", "tp": 2, "ok": True,
                                    "tiers": {"host": True, "disk": True}}]
    assert {"host.log", "disk.log"} <= {p.name for p in tmp_path.iterdir()}


def test_divergence_names_the_first_differing_place():
    assert divergence((1, 2, 3), (1, 2, 3)) is None
    assert divergence((1, 2, 3), (1, 5, 3)) == 1
    assert divergence((1, 2), (1, 2, 3)) == 2

