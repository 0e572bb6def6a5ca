"""TTFT of a conversation's next turn: prefilled from the start (cold) vs resumed from a kept state.

For each history length L and repeat: a conversation whose rendered history is about L tokens is sent once (its
states are kept), then its next turn (history + reply + a new user message) is timed to the first token: that
is the resumed measurement, and /metrics says which tier served it. The same next turn with its system message
changed at its first word (so no kept state is a prefix of it) is the cold measurement.
Prints one JSON line per measurement, then one summary line per server and length (medians and their ratio).

    python bench/resume.py --url http://127.0.0.1:8080 --lengths 512 2048
    python bench/resume.py --tiny qwen --lengths 512 2048 8192 --repeats 5

--serve ARGS / --tiny FAMILY start the servers here, under TF_KV_POISON=1, once per tier in --tiers: `device`
with the device tier alone (`--host-cache-gib 0`), `host` with the host tier alone (`--prompt-cache-gib 0`: every
state is kept in host memory), so both tiers' resumes are measured; and `disk`, the disk tier after a restart.
--tiny serves the family's random tiny checkpoint with its max_position_embeddings raised to the context (the tiny
default stops at 4096; random weights do not mind).

`disk`, per length: a server with `--learn-conversations --learn-dir D` (device and host tiers at their defaults,
as a user runs it) is sent each repeat's history and stopped with SIGTERM, which writes what RAM kept to D (its
"disk tier closed" log line is waited for and reported); a new server on D then times each next turn resumed from
disk (cached_tokens and tier="disk" checked; the page cache of D's files dropped first unless --keep-page-cache),
its cold variant, and a twin conversation's next turn resumed from the device. The achieved read rate is estimated
as the bytes the store read (/memory's disk_read_bytes) over (disk TTFT - device TTFT), and measured by the tier
itself (/memory's disk_restored_bytes over disk_restore_seconds: read, verify and put back, overlapped); both are
held against a plain sequential read of the same state's files, page cache dropped, in the same run
(bench/disk_read.py): `read_over_seq`, `restore_over_seq`.

Every resumed measurement carries the serving tier's own restore (`restore_bytes`, `restore_ms`, `restore_gb_s`,
from /memory's `*_restored_bytes` and `*_restore_seconds` around the request: the device and host tiers time their
copies on the device, the disk tier its read and put back), and the first line holds the machine's baselines: a
plain memory copy and, with CUDA, a pinned host -> device copy (`pinned_copy_gb_s`), which the host tier's
`restore_gb_s` is held against.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from disk_read import drop_cache, sequential_read, state_files, store_files  # noqa: E402

from gate.scenarios import text  # noqa: E402
from gate.wire import Server, tier_delta  # noqa: E402

MESSAGE_WORDS = 40
NEW_WORDS = 24
CONFIGS = {"device": ["--host-cache-gib", "0"], "host": ["--prompt-cache-gib", "0"]}
TIERS = (*CONFIGS, "disk")
CLOSED = re.compile(r"disk tier closed: (\d+) states written at shutdown in ([\d.]+) s, (\d+) dropped")


def history(server: Server, tag: str, tokens: int) -> list[dict[str, str]]:
    """System, then user/assistant pairs, then a user message: about `tokens` tokens rendered, all text new."""
    messages = [{"role": "system", "content": text(f"{tag} system", MESSAGE_WORDS, 1.0)}]
    pair = 0
    while True:
        messages.append({"role": "user", "content": text(f"{tag} user {pair}", MESSAGE_WORDS, 1.0)})
        if len(server.tokenize(messages, generation_prompt=True)) >= tokens:
            return messages
        messages.append({"role": "assistant", "content": text(f"{tag} reply {pair}", MESSAGE_WORDS, 1.0)})
        pair += 1


def body(server: Server, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """A greedy request."""
    return {"model": server.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0}


def next_turn(server: Server, tag: str, tokens: int) -> tuple[list[dict[str, str]], int]:
    """A conversation of at least `tokens` history tokens, sent once so its states are kept; its next turn and
    the history's rendered length."""
    messages = history(server, tag, tokens)
    reply = server.chat(body(server, messages, 4))
    return [*messages, {"role": "assistant", "content": reply.text},
            {"role": "user", "content": text(f"{tag} next", NEW_WORDS, 1.0)}], reply.prompt_tokens


RESTORED = {"device": ("prompt_cache_restored_bytes", "prompt_cache_restore_seconds"),
            "host": ("host_restored_bytes", "host_restore_seconds"),
            "disk": ("disk_restored_bytes", "disk_restore_seconds")}


def timed(server: Server, messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
    """TTFT of one request and the tier that served it ("none": prefilled from the start), with that tier's restore
    as the server measured it (/memory: bytes, seconds and their GB/s)."""
    before, numbers_before = server.tiers(), server.memory()["now"]
    reply = server.chat(body(server, messages, 1))
    moved = tier_delta(before, server.tiers())
    tier = next((name for name, numbers in moved.items() if numbers.get("hits")), "none")
    out = {"prompt_tokens": reply.prompt_tokens, "cached_tokens": reply.cached_tokens,
           "ttft_ms": round(reply.ttft_s * 1000, 3)}
    return out | restored(tier, numbers_before, server.memory()["now"]), tier


def restored(tier: str, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The serving tier's restore between two /memory readings: bytes, seconds (the tier's own timing: a device or
    host restore's copies timed on the device, a disk read with its put back) and GB/s."""
    if tier not in RESTORED or RESTORED[tier][0] not in after:
        return {}
    nbytes_key, seconds_key = RESTORED[tier]
    nbytes = after[nbytes_key] - before.get(nbytes_key, 0)
    seconds = after[seconds_key] - before.get(seconds_key, 0.0)
    return {"restore_bytes": nbytes, "restore_ms": round(seconds * 1e3, 3), "restore_gb_s": gb_s(nbytes, seconds)}


def baselines() -> dict[str, Any]:
    """What the tiers' restores are held against on this machine: a pinned host -> device copy of 1 GiB (CUDA only,
    best of five) and a plain host memory copy of 256 MiB (best of five)."""
    import time

    import torch

    def best(copy, nbytes: int) -> float:
        seconds = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            copy()
            seconds = min(seconds, time.perf_counter() - began)
        return round(nbytes / seconds / 1e9, 3)

    src, dst = torch.empty(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)
    src.fill_(1)
    out = {"bench": "baselines", "memcpy_gb_s": best(lambda: dst.copy_(src), src.numel()), "pinned_copy_gb_s": None}
    if torch.cuda.is_available():
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")

        def copy() -> None:
            device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        out["pinned_copy_gb_s"] = best(copy, pinned.numel())
    return out


def measure(server: Server, name: str, lengths: list[int], repeats: int) -> None:
    """Cold and resumed next turns at every length; JSON lines on stdout."""
    timed(server, next_turn(server, f"{name} warm-up", 256)[0])
    for length in lengths:
        cold, resumed, rates = [], [], []
        for repeat in range(repeats):
            turn, rendered = next_turn(server, f"{name} {length} {repeat}", length)
            for kind, messages in (("cold", cold_variant(turn)), ("resumed", turn)):
                numbers, tier = timed(server, messages)
                (cold if kind == "cold" else resumed).append(numbers["ttft_ms"])
                if kind == "resumed" and numbers.get("restore_gb_s") is not None:
                    rates.append(numbers["restore_gb_s"])
                print(json.dumps({"server": name, "history": length, "history_tokens": rendered, "kind": kind,
                                  "tier": tier, "repeat": repeat, **numbers}), flush=True)
        print(json.dumps({"server": name, "history": length, "summary": True,
                          "cold_ttft_ms": statistics.median(cold), "resumed_ttft_ms": statistics.median(resumed),
                          "resumed_over_cold": round(statistics.median(resumed) / statistics.median(cold), 4),
                          "restore_gb_s": statistics.median(rates) if rates else None}),
              flush=True)


def cold_variant(turn: list[dict[str, str]]) -> list[dict[str, str]]:
    """The same turn with its system message changed at the first word: no kept state is a prefix of it."""
    return [{"role": "system", "content": "Cold. " + turn[0]["content"]}, *turn[1:]]


def shutdown(log: Path) -> dict[str, float]:
    """The disk tier's closing line in a stopped server's log: states written at shutdown, seconds, dropped."""
    from tensorfold.testing.process import tail

    found = CLOSED.findall(log.read_text(errors="replace"))
    if not found:
        raise RuntimeError(f"{log} has no 'disk tier closed' line: the disk tier was not flushed\n{tail(log)}")
    written, seconds, dropped = found[-1]
    return {"written_at_shutdown": int(written), "flush_s": float(seconds), "dropped": int(dropped)}


def disk_read_bytes(server: Server) -> int:
    """Bytes the server's rows store has read since it started (/memory)."""
    return int(server.memory()["now"]["disk_read_bytes"])


def expect(tier: str, want: str, numbers: dict[str, Any], what: str) -> None:
    """Refuse a measurement served by another tier than the one it stands for."""
    if tier != want or (want != "none" and not numbers["cached_tokens"]):
        raise RuntimeError(f"{what}: served by {tier!r} at {numbers['cached_tokens']} cached tokens, "
                           f"expected {want!r}")


def gb_s(nbytes: float, seconds: float) -> float | None:
    """GB/s, or None when the time is not positive (an estimate within noise)."""
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def disk_repeat(server: Server, root: Path, block_rows: int, label: str, turn: list[dict[str, str]],
                length: int, drop: bool) -> list[dict[str, Any]]:
    """One repeat after the restart: the next turn resumed from disk, the sequential read of the state it read,
    its cold variant, and a twin conversation's next turn resumed from the device; their JSON records."""
    if drop:
        drop_cache(store_files(root))
    before = disk_read_bytes(server)
    disk, tier = timed(server, turn)
    read = disk_read_bytes(server) - before
    expect(tier, "disk", disk, f"{label}: the next turn after the restart")
    files, _ = state_files(root, server.tokenize(turn, generation_prompt=True), disk["cached_tokens"], block_rows)
    state_bytes, sequential = sequential_read(files)
    cold, cold_tier = timed(server, cold_variant(turn))
    expect(cold_tier, "none", cold, f"{label}: the cold turn")
    twin, twin_tokens = next_turn(server, f"{label} twin", length)
    device, device_tier = timed(server, twin)
    expect(device_tier, "device", device, f"{label}: the twin's next turn")
    extra_s = (disk["ttft_ms"] - device["ttft_ms"]) / 1e3
    return [{"kind": "cold", "tier": cold_tier, **cold},
            {"kind": "disk", "tier": tier, **disk, "read_bytes": read, "state_bytes": state_bytes,
             "read_gb_s_estimate": gb_s(read, extra_s), "seq_read_gb_s": round(sequential / 1e9, 3),
             "restore_over_seq": None if disk.get("restore_gb_s") is None
             else round(disk["restore_gb_s"] / (sequential / 1e9), 4)},
            {"kind": "device", "tier": device_tier, "history_tokens": twin_tokens, **device}]


def measure_disk(flags: list[str], root: Path, work: Path, lengths: list[int], repeats: int, drop: bool) -> None:
    """Per length: a server keeps each repeat's history and is stopped (SIGTERM: its disk tier writes what RAM
    kept); a new server on the same directory times the next turns from disk, cold and from the device."""
    for length in lengths:
        before_log = work / f"disk-{length}-before.log"
        with started(flags, before_log) as server:
            warm_up = next_turn(server, f"disk warm-up {length}", 256)[0]
            turns = [next_turn(server, f"disk {length} {repeat}", length) for repeat in range(repeats)]
        print(json.dumps({"server": "disk", "history": length, "stopped": True, **shutdown(before_log)}), flush=True)
        after_log = work / f"disk-{length}-after.log"
        with started(flags, after_log) as server:
            plan = server.memory()["plan"]
            timed(server, warm_up)
            ttft: dict[str, list[float]] = {"cold": [], "disk": [], "device": []}
            read, sequential, restore = [], [], []
            for repeat, (turn, rendered) in enumerate(turns):
                records = disk_repeat(server, root, plan["learn_block_rows"], f"disk {length} {repeat}", turn,
                                      length, drop)
                for record in records:
                    ttft[record["kind"]].append(record["ttft_ms"])
                    print(json.dumps({"server": "disk", "history": length, "history_tokens": rendered,
                                      "repeat": repeat, **record}), flush=True)
                read.append(records[1]["read_bytes"])
                sequential.append(records[1]["seq_read_gb_s"])
                if records[1].get("restore_gb_s") is not None:
                    restore.append(records[1]["restore_gb_s"])
        median = {kind: round(statistics.median(values), 3) for kind, values in ttft.items()}
        achieved = gb_s(statistics.median(read), (median["disk"] - median["device"]) / 1e3)
        print(json.dumps({
            "server": "disk", "history": length, "summary": True, "cold_ttft_ms": median["cold"],
            "disk_ttft_ms": median["disk"], "device_ttft_ms": median["device"],
            "disk_over_cold": round(median["disk"] / median["cold"], 4),
            "device_over_cold": round(median["device"] / median["cold"], 4),
            "read_bytes": statistics.median(read), "read_gb_s_estimate": achieved,
            "seq_read_gb_s": round(statistics.median(sequential), 3),
            "read_over_seq": None if achieved is None else round(achieved / statistics.median(sequential), 4),
            "restore_gb_s": statistics.median(restore) if restore else None,
            "restore_over_seq": round(statistics.median(restore) / statistics.median(sequential), 4) if restore
            else None,
            "store_probe_gb_s": round(plan["learn_read_bytes_per_s"] / 1e9, 3),
            "page_cache": "dropped" if drop else "kept",
            "read_time": "read_gb_s_estimate: disk TTFT - device TTFT (medians); restore_gb_s: the tier's own timing"}),
              flush=True)


def tiny_checkpoint(family: str, context: int, directory: Path) -> Path:
    """The family's tiny random checkpoint, its positions raised to `context`."""
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", family, str(directory)],
                   check=True, capture_output=True)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = max(context, config.get("max_position_embeddings", 0))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@contextlib.contextmanager
def started(args: list[str], log: Path) -> Iterator[Server]:
    """`tensorfold serve ARGS` under TF_KV_POISON=1, for the block."""
    from tensorfold.testing.process import serving

    with serving(args, log, env={"TF_KV_POISON": "1"}) as url:
        server = Server(url)
        try:
            yield server
        finally:
            server.close()


def main() -> None:
    """Parse, start or reach the servers, measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (its tiers are what they are)")
    parser.add_argument("--serve", help='start `tensorfold serve ARGS` per tier, e.g. "--family qwen"')
    parser.add_argument("--tiny", metavar="FAMILY", help="serve FAMILY's tiny checkpoint with a long enough context")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 3584], help="history tokens")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per length and kind")
    parser.add_argument("--tiers", nargs="+", choices=TIERS, default=list(TIERS),
                        help="the servers --serve/--tiny start: device, host, disk (after a restart)")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="disk: leave the store's files in the page cache before the timed turn")
    args = parser.parse_args()
    if sum(x is not None for x in (args.url, args.serve, args.tiny)) != 1:
        raise SystemExit("give one of --url, --serve and --tiny")
    print(json.dumps(baselines()), flush=True)
    if args.url is not None:
        server = Server(args.url)
        measure(server, args.url, args.lengths, args.repeats)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-resume-"))
    context = max(args.lengths) + 1024
    base = shlex.split(args.serve) if args.serve else ["--family", args.tiny, "--model",
                                                       str(tiny_checkpoint(args.tiny, context, work / "tiny"))]
    if "--context" not in base:
        base += ["--context", str(context)]
    for name in args.tiers:
        if name == "disk":
            root = work / "learned"
            measure_disk([*base, "--learn-conversations", "--learn-dir", str(root)], root, work, args.lengths,
                         args.repeats, drop=not args.keep_page_cache)
            continue
        with started([*base, *CONFIGS[name]], work / f"{name}.log") as server:
            measure(server, name, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
