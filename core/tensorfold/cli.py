"""The `tensorfold` command: thin typer commands that call into the core."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from tensorfold import learned_cli
from tensorfold.checkpoint import CheckpointError
from tensorfold.family import PluginError
from tensorfold.follow.spawn import FollowerFailed
from tensorfold.refusals import Refused
from tensorfold.settings import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_CONTEXT,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_LEARN_BLOCK_ROWS,
    DEFAULT_LEARN_GIB,
    DEFAULT_LEARN_MIN_FREE_GIB,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MIN_CHUNK,
    DEFAULT_PAGE_ROWS,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROMPT_CACHE_GIB,
    DEFAULT_STEP_ROWS,
    DEFAULT_TP_TIMEOUT_S,
    SwitchError,
    read_settings,
)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Serve hybrid LLMs that resume conversations.")
app.add_typer(learned_cli.app, name="learned")

FamilyOpt = Annotated[str | None, typer.Option("--family", help="Family name (an installed entry point).")]
ModelOpt = Annotated[Path | None, typer.Option("--model", help="HF-format checkpoint directory; "
                                                  "without it, the family's embedded default.")]
ContextOpt = Annotated[int, typer.Option("--context", help="Tokens per stream: prompt + reply.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, "
                                       "bfloat16 or float16.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
ChunkOpt = Annotated[int, typer.Option("--prefill-chunk", help="Prefill grid: chunk k covers [k*N, (k+1)*N).")]
StepRowsOpt = Annotated[int, typer.Option("--max-step-rows", "--max-num-batched-tokens",
                                          help="Rows one step carries: decode rows and prefill chunks of several "
                                               "streams (the oldest prefill's chunk always goes).")]
MinChunkOpt = Annotated[int, typer.Option("--min-chunk", help="A request start closer than N rows to the previous "
                                          "prefill cut merges into it (with the family's request-starts switch).")]
ParallelOpt = Annotated[str, typer.Option("--parallel", help="Streams served at once: N, or auto (as many as the KV "
                                          "budget holds at the full context, up to 256 and --max-step-rows).")]
PageRowsOpt = Annotated[int, typer.Option("--page-rows", help="Rows (tokens) per KV page.")]
KvGibOpt = Annotated[float | None, typer.Option("--kv-gib", help="KV budget in GiB (default: what the device "
                                                   "leaves after weights and a reserve).")]

PromptCacheOpt = Annotated[float, typer.Option("--prompt-cache-gib", help="Kept prompt states (a next turn resumes "
                                               "from them) in GiB of stream memory; 0 turns them off.")]
HostCacheOpt = Annotated[float | None, typer.Option("--host-cache-gib", help="Kept prompt states in GiB of host "
                                                    "memory (pinned on CUDA), where the device tier's evicted "
                                                    "states go; default a quarter of available RAM; 0 turns it off.")]
LearnOpt = Annotated[bool, typer.Option("--learn-conversations", help="Keep prompt states on disk too (the rows "
                                       "store): states the host tier lets go, and those kept at shutdown, are "
                                       "written to --learn-dir, and a later turn reads them back, after an "
                                       "eviction or a restart.")]
LearnDirOpt = Annotated[Path | None, typer.Option("--learn-dir", help="The rows store's directory (default "
                                                  "~/.cache/tensorfold/learned).")]
LearnBlockOpt = Annotated[int, typer.Option("--learn-block-rows", help="Rows per block on disk; states sharing a "
                                            "prefix share its blocks.")]
LearnGibOpt = Annotated[float, typer.Option("--learn-gib", help="Disk the rows store may use, in GiB, every "
                                            "identity together.")]
LearnDailyOpt = Annotated[float | None, typer.Option("--learn-daily-gib", help="GiB the rows store may write per "
                                                     "day (default: no limit); past it states stay in RAM only.")]
LearnFreeOpt = Annotated[float, typer.Option("--learn-min-free-gib", help="Writing pauses while the disk has less "
                                             "free space than this, in GiB; serving goes on.")]

MaxBytesOpt = Annotated[int | None, typer.Option("--max-request-bytes", help="Largest request body in bytes; a larger "
                                                 "one is refused with 413 before it is read (default: 64 bytes per "
                                                 "context token, at least 1 MiB).")]
ApiKeyOpt = Annotated[list[str] | None, typer.Option("--api-key", help="A key clients must send (Authorization: "
                                                     "Bearer KEY, or x-api-key: KEY); repeat for several. TF_API_KEY "
                                                     "adds one from the environment. Default: no key asked.")]
ApiKeyFileOpt = Annotated[Path | None, typer.Option("--api-key-file", help="A file of API keys, one per line (# "
                                                    "starts a comment).")]
MetricsOpenOpt = Annotated[bool, typer.Option("--metrics-open", help="With API keys: let /metrics answer without "
                                              "one (for a scraper).")]
AllowedHostsOpt = Annotated[list[str] | None, typer.Option("--allowed-hosts", help="Host header values answered "
                                                           "besides the loopback names (repeat, or comma-separate), "
                                                           "against DNS rebinding: on a loopback bind others are "
                                                           "refused; on another bind, only when given. * accepts "
                                                           "any.")]
IsolateOpt = Annotated[bool, typer.Option("--isolate-cache-by-key", help="Keep prompt states apart per API key: a "
                                          "request resumes only from states its own key made.")]
SpecialOpt = Annotated[bool, typer.Option("--special-tokens-in-content/--no-special-tokens-in-content",
                                          help="Whether special tokens typed in chat message content are read as "
                                          "special tokens (as the template's own are) or kept as plain text.")]
HeaderTimeoutOpt = Annotated[float, typer.Option("--header-timeout", help="Seconds a connection may take to send "
                                                 "its request line and headers; then it is closed.")]
BodyTimeoutOpt = Annotated[float, typer.Option("--body-timeout", help="Seconds a request may take to send its "
                                               "body; then 408.")]
MaxConnectionsOpt = Annotated[int, typer.Option("--max-connections", help="Connections served at once; past it, "
                                                "503.")]
ModelArg = Annotated[Path | None, typer.Argument(help="HF-format checkpoint directory (the same as --model).",
                                                 show_default=False)]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed the random seeds of requests that give none, so a "
                                             "server run draws the same sequence of them (default: from the OS).")]
MaxModelLenOpt = Annotated[int | None, typer.Option("--max-model-len", hidden=True, help="vLLM's name: --context.")]
MaxNumSeqsOpt = Annotated[int | None, typer.Option("--max-num-seqs", hidden=True, help="vLLM's name: --parallel.")]
TpOpt = Annotated[int, typer.Option("--tensor-parallel-size", "--tp", help="Ranks of tensor parallelism: this "
                                    "process is rank 0 (HTTP, scheduler) and starts ranks 1..N-1 as child "
                                    "processes that follow its steps, one device each.")]
TpTimeoutOpt = Annotated[float, typer.Option("--tp-timeout", help="Seconds a tensor-parallel rank may be silent "
                                             "before it is lost and the server stops.")]


def _hosts(values: list[str] | None) -> tuple[str, ...]:
    return tuple(h.strip() for v in values or () for h in v.split(",") if h.strip())


def _parallel(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"--parallel takes a number or auto, not {value!r}") from None


def _settings(family: str | None, **flags: object):
    from tensorfold.boot import pick_family

    chosen = pick_family(family, flags.get("model"))
    settings = read_settings(os.environ, [(chosen.request_starts_switch, True)], family=chosen.name, **flags)
    return settings, chosen


def _fail(err: Exception | str) -> None:
    typer.echo(str(err), err=True)
    raise typer.Exit(2)


def _model(positional: Path | None, flag: Path | None) -> Path | None:
    """The checkpoint given as MODEL or --model (once)."""
    if positional is not None and flag is not None and positional != flag:
        _fail(f"the model is given twice, as {positional} and as --model {flag}: give it once")
    return positional if positional is not None else flag


def _aliases(context: int, parallel: str, max_model_len: int | None, max_num_seqs: int | None) -> tuple[int, str]:
    """vLLM's flag names, read as ours: --max-model-len is --context, --max-num-seqs is --parallel."""
    if max_model_len is not None:
        if context not in (DEFAULT_CONTEXT, max_model_len):
            _fail(f"--max-model-len {max_model_len} and --context {context} disagree: give one (--context is ours)")
        context = max_model_len
    if max_num_seqs is not None:
        if parallel not in ("auto", str(max_num_seqs)):
            _fail(f"--max-num-seqs {max_num_seqs} and --parallel {parallel} disagree: give one (--parallel is ours)")
        parallel = str(max_num_seqs)
    return context, parallel


@app.command()
def serve(
    model_arg: ModelArg = None,
    family: FamilyOpt = None,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8080,
    context: ContextOpt = DEFAULT_CONTEXT,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    prefill_chunk: ChunkOpt = DEFAULT_PREFILL_CHUNK,
    max_step_rows: StepRowsOpt = DEFAULT_STEP_ROWS,
    min_chunk: MinChunkOpt = DEFAULT_MIN_CHUNK,
    parallel: ParallelOpt = "auto",
    page_rows: PageRowsOpt = DEFAULT_PAGE_ROWS,
    kv_gib: KvGibOpt = None,
    prompt_cache_gib: PromptCacheOpt = DEFAULT_PROMPT_CACHE_GIB,
    host_cache_gib: HostCacheOpt = None,
    learn_conversations: LearnOpt = False,
    learn_dir: LearnDirOpt = None,
    learn_block_rows: LearnBlockOpt = DEFAULT_LEARN_BLOCK_ROWS,
    learn_gib: LearnGibOpt = DEFAULT_LEARN_GIB,
    learn_daily_gib: LearnDailyOpt = None,
    learn_min_free_gib: LearnFreeOpt = DEFAULT_LEARN_MIN_FREE_GIB,
    served_model_name: Annotated[list[str] | None, typer.Option(help="A model id the API answers to; repeat for "
                                                                "several, the first named in replies (default: the "
                                                                "checkpoint directory's name).")] = None,
    max_waiting: Annotated[int, typer.Option(help="Requests that may wait; past it, 503.")] = 64,
    max_request_bytes: MaxBytesOpt = None,
    api_key: ApiKeyOpt = None,
    api_key_file: ApiKeyFileOpt = None,
    metrics_open: MetricsOpenOpt = False,
    allowed_hosts: AllowedHostsOpt = None,
    isolate_cache_by_key: IsolateOpt = False,
    special_tokens_in_content: SpecialOpt = True,
    header_timeout: HeaderTimeoutOpt = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout: BodyTimeoutOpt = DEFAULT_BODY_TIMEOUT_S,
    max_connections: MaxConnectionsOpt = DEFAULT_MAX_CONNECTIONS,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error or critical.")] = "info",
    seed: SeedOpt = None,
    chat_template: Annotated[str | None, typer.Option(help="A chat template (a jinja file, or its text) used "
                                                      "instead of the checkpoint's.")] = None,
    max_model_len: MaxModelLenOpt = None,
    max_num_seqs: MaxNumSeqsOpt = None,
    tensor_parallel_size: TpOpt = 1,
    tp_timeout: TpTimeoutOpt = DEFAULT_TP_TIMEOUT_S,
) -> None:
    """Serve a checkpoint (MODEL, or --model; none: the family's embedded default) over the OpenAI-compatible HTTP
    API."""
    from tensorfold.preflight import serve_problems

    model = _model(model_arg, model)
    context, parallel = _aliases(context, parallel, max_model_len, max_num_seqs)
    problems = serve_problems(host, port, log_level, model)  # before anything loads: one sentence each
    if problems:
        _fail("\n".join(problems))
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings, chosen = _settings(family, model=model, host=host, port=port, context=context, dtype=dtype,
                                     device=device, prefill_chunk=prefill_chunk, step_rows=max_step_rows,
                                     min_chunk=min_chunk,
                                     served_names=tuple(served_model_name or ()), chat_template=chat_template,
                                     max_waiting=max_waiting, parallel=_parallel(parallel), page_rows=page_rows,
                                     kv_gib=kv_gib, prompt_cache_gib=prompt_cache_gib,
                                     host_cache_gib=host_cache_gib, learn=learn_conversations, learn_dir=learn_dir,
                                     learn_block_rows=learn_block_rows, learn_gib=learn_gib,
                                     learn_daily_gib=learn_daily_gib, learn_min_free_gib=learn_min_free_gib,
                                     max_request_bytes=max_request_bytes, api_key=api_key or (),
                                     api_key_file=api_key_file, metrics_open=metrics_open,
                                     allowed_hosts=_hosts(allowed_hosts), isolate_cache_by_key=isolate_cache_by_key,
                                     special_tokens_in_content=special_tokens_in_content,
                                     header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                     max_connections=max_connections, seed=seed,
                                     tensor_parallel=tensor_parallel_size, tp_timeout_s=tp_timeout)
        from tensorfold.boot import boot
        from tensorfold.launch import stop_on_signals

        stop_on_signals()   # a stop asked for while loading still stops the followers started
        loaded = boot(settings, chosen)
    except (PluginError, Refused, SwitchError, CheckpointError, OSError, ValueError, FollowerFailed) as err:
        _fail(err)
    from tensorfold.launch import run_server

    run_server(loaded, log_level)


@app.command("make-tiny")
def make_tiny(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    family: FamilyOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a family's small random checkpoint (HF format) for trials and tests."""
    from tensorfold.boot import pick_family

    try:
        pick_family(family).make_tiny(directory, seed=seed)
    except PluginError as err:
        _fail(err)
    typer.echo(f"wrote {directory}")


@app.command()
def families(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List installed families with every declaration (made on each family's tiny config)."""
    from tensorfold.explain import describe_families

    try:
        found = describe_families()
    except PluginError as err:
        _fail(err)
    if as_json:
        typer.echo(json.dumps(found, indent=2))
        return
    for entry in found:
        layout = entry["layout"]
        typer.echo(f"{entry['name']} ({entry['module']}): model types {', '.join(entry['model_types'])}; "
                   f"switch {entry['request_starts_switch']}; image {entry['image']['name']} "
                   f"v{entry['image']['version']}; tiny config: {layout['bytes_per_token']:.0f} B/token, "
                   f"{layout['fixed_bytes_per_stream']} B fixed per stream")


@app.command()
def explain(
    model_arg: ModelArg = None,
    family: FamilyOpt = None,
    model: ModelOpt = None,
    context: ContextOpt = DEFAULT_CONTEXT,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = "auto",
    parallel: ParallelOpt = "auto",
    page_rows: PageRowsOpt = DEFAULT_PAGE_ROWS,
    kv_gib: KvGibOpt = None,
    prompt_cache_gib: PromptCacheOpt = DEFAULT_PROMPT_CACHE_GIB,
    host_cache_gib: HostCacheOpt = None,
    tensor_parallel_size: TpOpt = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the memory plan for a checkpoint (MODEL, or --model) without serving it; with --tp N, one rank's."""
    from tensorfold.explain import plan_text, serving_plan

    model = _model(model_arg, model)
    try:
        settings, chosen = _settings(family, model=model, context=context, dtype=dtype, device=device,
                                     parallel=_parallel(parallel), page_rows=page_rows, kv_gib=kv_gib,
                                     prompt_cache_gib=prompt_cache_gib, host_cache_gib=host_cache_gib,
                                     tensor_parallel=tensor_parallel_size)
        plan = serving_plan(settings, chosen)
    except (PluginError, Refused, SwitchError, CheckpointError, OSError, ValueError) as err:
        _fail(err)
    typer.echo(json.dumps(plan, indent=2) if as_json else plan_text(plan))


def main() -> None:
    """Console entry point."""
    sys.exit(app())
