"""The served benchmark: a real `tensorfold serve` process on a random checkpoint written to local disk, driven by a
load client nobody here wrote, SGLang's `sglang.benchmark.serving` (its random-ids dataset over the OpenAI
`/v1/completions` route), at each concurrency level.

    checkpoint  --checkpoint DIR, written there when it has no config.json (or to a temporary directory): HF's model
                of --shape with random weights (gpu.hf_model, as bench/gpu.py builds it) saved as bf16 safetensors
                shards (float32 with --dtype float32) with config.json, generation_config.json and a generated
                tokenizer: a word-level tokenizer.json whose ids are the model's whole vocabulary ("<unk>", "t1",
                "t2", … then the three ChatML specials as the last ids), words split at whitespace and joined by
                one space, so any ids decode to text that encodes back to exactly those ids (the client's random
                ids become text and the server reads the same ids back)
    server      `python -m tensorfold serve --model DIR --parallel max(levels) --max-waiting …` (CUDA graphs on:
                TF_CUDA_GRAPHS is left at its default), its log in --out/serving-server.log
    client      per level C: `python -m sglang.benchmark.serving --backend vllm (OpenAI completions, streamed)
                --dataset-name random-ids --random-input-len 128 --random-output-len 128 --random-range-ratio 1
                --max-concurrency C --num-prompts max(--min-prompts, --prompts-per-client·C) --warmup-requests C`,
                with HF_HUB_OFFLINE=1 and --tokenizer DIR; ignore_eos and temperature 0 are the client's defaults.
                The client runs from sglang/benchmark/ as it is in the sglang wheel (--client: the wheel, or the cut
                of it bench/serving_wheels.sh makes), beside the stubs of bench/sglang_stubs/ (its README says what
                each stands in for)

One JSON line per level (`"bench": "served"`): output tok/s, TTFT and ITL p50/p99, TPOT p50, E2E p50, requests
completed, output tokens as the client counted them and as it re-tokenised them. With --compare FILE (the
engine.jsonl of bench/engine_gpu.py at the same shape), the DecodeRunner, Engine and HF figures at the same number of
streams are put beside the served one. Appended to --out/serving.jsonl.

    python bench/serving.py --shape qwen3_5-9b --out $OUT --compare $OUT/engine.jsonl
    python bench/serving.py --shape qwen3_5-tiny --device cpu --dtype float32 --levels 1 4 --output 16   # CPU check
    python bench/serving.py --cut-client sglang-0.5.23-….whl --to .whl/sglang-0.5.23-client.zip      # (prep)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path

import attrs
import gpu  # bench/gpu.py: python puts the script's directory (bench/) first on sys.path
import torch
from gpu import SHAPES

from tensorfold.ports import free_port
from tensorfold.testing.tiny_tokenizer import CHATML, SPECIALS

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
STUBS = BENCH / "sglang_stubs"
CLIENT_PREFIX = "sglang/benchmark/"
SHARD_BYTES = 4 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def emit(out: Path | None, **record: object) -> None:
    gpu.emit(out, jsonl="serving.jsonl", **record)


# ---------------------------------------------------------------- the checkpoint

def write_tokenizer(directory: Path, vocab_size: int) -> dict[str, int]:
    """A word-level tokenizer over exactly `vocab_size` ids: words "<unk>", "t1", …, then SPECIALS (the ChatML
    tokens, added as specials, the last ids). Ids decode to their words joined by single spaces and that text
    encodes back to the same ids, so a client's random ids, sent as text, reach the model unchanged."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = vocab_size - len(SPECIALS)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIALS))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": "<unk>",
              "chat_template": CHATML, "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {token: tokenizer.token_to_id(token) for token in SPECIALS}


def write_checkpoint(shape: str, directory: Path, dtype: torch.dtype) -> dict[str, object]:
    """HF's model of `shape` with random weights, saved as an HF checkpoint directory (safetensors shards of at
    most 4 GiB with their index, config, generation config, tokenizer)."""
    from safetensors.torch import save_file

    began = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    hf, config = gpu.hf_model(shape, dtype)
    specials = write_tokenizer(directory, config.vocab_size)
    state = hf.state_dict()
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for index, names in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: state[name].detach().to("cpu").contiguous() for name in names}
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    written = {**config.to_dict(), "architectures": [SHAPES[shape][2]], "dtype": str(dtype).removeprefix("torch."),
               "bos_token_id": specials["<|endoftext|>"], "eos_token_id": specials["<|im_end|>"],
               "pad_token_id": specials["<|endoftext|>"]}
    (directory / "config.json").write_text(json.dumps(written, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": specials["<|im_end|>"]}))
    del hf, state
    if gpu.DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"checkpoint_bytes": total, "shards": len(shards), "vocab_size": config.vocab_size,
            "write_s": round(time.perf_counter() - began, 1)}


# ---------------------------------------------------------------- the load client

def cut_client(wheel: Path, to: Path) -> None:
    """The client's part of the sglang wheel (sglang/benchmark/ and the wheel's metadata and licence), its
    members' bytes unchanged, as a zip small enough to carry."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(to, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if info.filename.startswith(CLIENT_PREFIX) or (".dist-info/" in info.filename and not
                                                           info.filename.endswith("RECORD")):
                target.writestr(info, source.read(info))


def find_client(given: Path | None) -> Path:
    if given is not None:
        return given
    found = sorted((REPO / ".whl").glob("sglang-*-client.zip")) + sorted((REPO / ".whl").glob("sglang-*.whl"))
    if not found:
        raise SystemExit("no load client: give --client (the sglang wheel, or bench/serving_wheels.sh's cut of it)")
    return found[-1]


def lay_out_client(archive: Path, directory: Path) -> str:
    """sglang/benchmark/ from the wheel (or its cut) and the stubs beside it, in `directory`; the client's
    version."""
    version = "unknown"
    with zipfile.ZipFile(archive) as source:
        for name in source.namelist():
            if name.startswith(CLIENT_PREFIX):
                source.extract(name, directory)
            elif name.endswith(".dist-info/METADATA"):
                version = name.split("/")[0].removesuffix(".dist-info")
    if not (directory / CLIENT_PREFIX / "serving.py").is_file():
        raise SystemExit(f"{archive} has no {CLIENT_PREFIX}serving.py")
    shutil.copytree(STUBS, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("README.md", "__pycache__"))
    return version


def client_env(client: Path, extra: str) -> dict[str, str]:
    """The client's environment: offline, its directory (and `extra`) first on PYTHONPATH."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(client), extra, os.environ.get("PYTHONPATH", "")) if p)
    return env


@attrs.frozen
class Level:
    """One run of the client: its concurrency, requests per client and new tokens per request."""

    concurrency: int
    per_client: int
    output: int

    @classmethod
    def parsed(cls, text: str) -> Level:
        """`C:PER_CLIENT:OUTPUT`, e.g. 64:1:1024 (one wave of 64 requests of 1,024 new tokens each)."""
        concurrency, per_client, output = (int(part) for part in text.split(":"))
        return cls(concurrency, per_client, output)


def levels_of(args: argparse.Namespace) -> list[Level]:
    """--levels at --prompts-per-client and --output, then each --run."""
    return [Level(c, args.prompts_per_client, args.output) for c in args.levels] + [Level.parsed(r) for r in args.run]


def run_level(args: argparse.Namespace, client: Path, port: int, checkpoint: Path, level: Level,
              work: Path, log) -> dict[str, object]:
    """One run of the client at `level`; its result line (the client's own JSON)."""
    concurrency = level.concurrency
    prompts = max(args.min_prompts, level.per_client * concurrency)
    result = work / f"client-{concurrency}-{level.per_client}-{level.output}.jsonl"
    command = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "vllm", "--host", "127.0.0.1",
               "--port", str(port), "--dataset-name", "random-ids", "--tokenizer", str(checkpoint),
               "--random-input-len", str(args.input), "--random-output-len", str(level.output),
               "--random-range-ratio", "1", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
               "--warmup-requests", str(min(concurrency, args.max_warmup)), "--seed", str(args.seed),
               "--output-file", str(result), "--disable-tqdm"]
    log.write(f"\n=== concurrency {concurrency}: {' '.join(command)}\n")
    log.flush()
    began = time.perf_counter()
    done = subprocess.run(command, env=client_env(client, args.client_pythonpath), stdout=log, stderr=subprocess.STDOUT,
                          timeout=args.level_timeout, check=False)
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"the load client failed at concurrency {concurrency} (exit {done.returncode}); see "
                           f"{log.name}")
    line = json.loads(result.read_text().strip().splitlines()[-1])
    line["_client_s"] = time.perf_counter() - began
    line["_prompts"] = prompts
    return line


# ---------------------------------------------------------------- the server


def get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except OSError:
        return 0


def start_server(args: argparse.Namespace, checkpoint: Path, port: int, log_path: Path) -> subprocess.Popen:
    parallel = max(level.concurrency for level in levels_of(args))
    command = [sys.executable, "-m", "tensorfold", "serve", "--family", SHAPES[args.shape][0], "--model",
               str(checkpoint), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
               "--max-waiting", str(4 * parallel), "--context", str(args.context), "--dtype", args.dtype,
               "--device", args.device, *args.serve_args.split()]
    log = open(log_path, "a")  # open for the server's lifetime, closed in stop_server
    log.write(f"=== {' '.join(command)}\n")
    log.flush()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    server.log = log
    if args.pid_file is not None:
        args.pid_file.write_text(f"{server.pid}\n")
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} while starting; see {log_path}")
        if get(f"http://127.0.0.1:{port}/health", timeout=2) == 200:
            return server
        time.sleep(1)
    stop_server(server)
    raise RuntimeError(f"the server was not ready within {args.start_timeout} s; see {log_path}")


def stop_server(server: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 60 s; its exit status."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    server.log.close()
    return server.returncode


# ---------------------------------------------------------------- main

def compared(path: Path | None, shape: str) -> dict[int, dict[str, float]]:
    """engine_ratio lines of bench/engine_gpu.py at `shape`, by streams."""
    if path is None or not path.is_file():
        return {}
    found = {}
    for text in path.read_text().splitlines():
        line = json.loads(text)
        if line.get("bench") == "engine_ratio" and line.get("shape") == shape:
            found[line["streams"]] = line
    return found


def r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def served_line(args: argparse.Namespace, level: Level, got: dict, version: str,
                beside: dict[str, float] | None) -> dict[str, object]:
    record = {"bench": "served", "shape": args.shape, "concurrency": level.concurrency, "client": version,
              "prompts": got["_prompts"], "completed": got["completed"], "input_len": args.input,
              "output_len": level.output, "output_tok_s": r(got["output_throughput"]),
              "ttft_p50_ms": r(got["median_ttft_ms"], 2), "ttft_p99_ms": r(got["p99_ttft_ms"], 2),
              "itl_p50_ms": r(got["median_itl_ms"], 3), "itl_p99_ms": r(got["p99_itl_ms"], 3),
              "tpot_p50_ms": r(got["median_tpot_ms"], 3), "e2e_p50_ms": r(got["median_e2e_latency_ms"], 1),
              "duration_s": r(got["duration"], 2), "output_tokens": got["total_output_tokens"],
              "output_tokens_retokenized": got["total_output_tokens_retokenized"],
              "client_s": r(got["_client_s"], 1)}
    if beside:
        runner, engine, hf = beside.get("runner_tok_s"), beside.get("engine_tok_s"), beside.get("hf_tok_s")
        record |= {"runner_tok_s": runner, "engine_tok_s": engine, "hf_tok_s": hf,
                   "served_over_runner": r(got["output_throughput"] / runner, 3) if runner else None,
                   "served_over_hf": r(got["output_throughput"] / hf, 2) if hf else None}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description="tensorfold serve under SGLang's load client")
    parser.add_argument("--shape", default="qwen3_5-9b", choices=sorted(SHAPES))
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--input", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="new tokens per request (ignore_eos)")
    parser.add_argument("--prompts-per-client", type=int, default=2, help="requests per level = this × concurrency")
    parser.add_argument("--run", nargs="*", default=[], metavar="C:PER_CLIENT:OUTPUT",
                        help="more runs after --levels on the same server, e.g. 64:1:128 (one wave of 64)")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--max-warmup", type=int, default=128, help="warm-up requests per level at most")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--serve-args", default="", help="more `tensorfold serve` flags, space-separated")
    parser.add_argument("--checkpoint", type=Path, help="the checkpoint directory (written when it has none)")
    parser.add_argument("--client", type=Path, help="the sglang wheel, or its cut (default: .whl/sglang-*)")
    parser.add_argument("--client-pythonpath", default="",
                        help="more PYTHONPATH entries for the client alone (its packages, where the server has none)")
    parser.add_argument("--compare", type=Path, help="bench/engine_gpu.py's engine.jsonl at this shape")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--level-timeout", type=float, default=600)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--pid-file", type=Path, help="write the server's pid here (for a caller's clean-up)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (client results, checkpoint)")
    parser.add_argument("--cut-client", type=Path, help="(prep) cut the client out of this sglang wheel and exit")
    parser.add_argument("--to", type=Path, help="(prep) where --cut-client writes its zip")
    args = parser.parse_args()
    if args.cut_client is not None:
        cut_client(args.cut_client, args.to)
        return
    gpu.DEVICE = args.device
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # `timeout`: stop the server and the client first
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tf-serving-"))
    logs = out if out is not None else work
    checkpoint = args.checkpoint or work / "checkpoint"
    try:
        client = work / "client"
        version = lay_out_client(find_client(args.client), client)
        if not (checkpoint / "config.json").is_file():
            torch.manual_seed(0)
            wrote = write_checkpoint(args.shape, checkpoint, DTYPES[args.dtype])
            emit(out, bench="served_checkpoint", shape=args.shape, directory=str(checkpoint), dtype=args.dtype,
                 **wrote)
        port = free_port()
        began = time.perf_counter()
        server = start_server(args, checkpoint, port, logs / "serving-server.log")
        levels = levels_of(args)
        emit(out, bench="served_server", shape=args.shape, port=port,
             parallel=max(level.concurrency for level in levels), ready_s=round(time.perf_counter() - began, 1),
             client=version)
        beside = compared(args.compare, args.shape)
        try:
            with open(logs / "serving-client.log", "a") as log:
                for level in levels:
                    try:
                        got = run_level(args, client, port, checkpoint, level, work, log)
                    except (RuntimeError, subprocess.TimeoutExpired) as err:
                        emit(out, bench="served", shape=args.shape, concurrency=level.concurrency,
                             output_len=level.output, error=str(err))
                        if server.poll() is not None:
                            break
                        continue
                    emit(out, **served_line(args, level, got, version, beside.get(level.concurrency)))
        finally:
            status = stop_server(server)
            emit(out, bench="served_server_exit", shape=args.shape, exit=status)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
