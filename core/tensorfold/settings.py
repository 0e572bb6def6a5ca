"""Every flag and TF_* switch, read once at startup into one frozen record; nothing else reads the environment."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

TRUE = {"1", "true", "on", "yes"}
FALSE = {"0", "false", "off", "no"}
DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 8192  # the prefill grid (--prefill-chunk): vLLM's and SGLang's on H100/H200-class GPUs
DEFAULT_STEP_ROWS = 8192  # rows one step may carry: decode rows and prefill chunks of several streams
DEFAULT_PAGE_ROWS = 256
DEFAULT_MIN_CHUNK = 256  # a system-prompt end closer than this to a pass's first row is not kept (policy.py)
DEFAULT_PROMPT_CACHE_GIB = 1.0  # kept prompt states (the device tier); 0 turns the tier off
DEFAULT_LEARN_BLOCK_ROWS = 256  # rows per shared block of the rows store on disk
DEFAULT_LEARN_GIB = 32.0        # the rows store's cap, every identity together
DEFAULT_LEARN_MIN_FREE_GIB = 4.0  # writing pauses below this much free disk; serving goes on
MIN_REQUEST_BYTES = 1 << 20       # the smallest default body limit, whatever the context
REQUEST_BYTES_PER_TOKEN = 64      # the default body limit's allowance per context token (text, JSON, escapes)
DEFAULT_HEADER_TIMEOUT_S = 10.0   # a connection that has not sent its whole request head by then is closed
DEFAULT_BODY_TIMEOUT_S = 30.0     # a request whose body has not arrived whole by then is answered 408
DEFAULT_MAX_CONNECTIONS = 512     # connections (and their tasks) served at once; past it, 503
DEFAULT_TP_TIMEOUT_S = 30.0       # a tensor-parallel collective waits this long for a rank before it is lost
API_KEY_ENV = "TF_API_KEY"        # one API key from the environment (kept out of the process list)
CORE_SWITCHES: tuple[tuple[str, bool], ...] = (
    ("TF_KV_PAGES", True),    # off: each stream owns one contiguous window (the reference layout)
    ("TF_KV_POISON", False),  # on: every page handed out is filled with NaN first
    ("TF_CUDA_GRAPHS", True),  # on: decode steps replay CUDA graphs (GPU only); off: the same decode, eager
    ("TF_OVERLAP", True),  # on: a decode step is launched before the last one's ids are read back (GPU only)
    ("TF_IMPRINT_VERIFY", False),  # on: every state written to disk is read back and compared byte for byte
)


class SwitchError(ValueError):
    """A TF_* switch holds a value that is neither on nor off."""


def read_switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """One on/off switch from the environment; a value that is neither raises naming the switch."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise SwitchError(f"{name}={raw!r} is neither on (1, true, on, yes) nor off (0, false, off, no)")


def read_api_keys(environ: Mapping[str, str], keys: Iterable[str] = (), key_file: Path | None = None) -> tuple[
        str, ...]:
    """The API keys: each --api-key, every non-blank, non-# line of --api-key-file, and TF_API_KEY; ValueError
    naming the file or flag at fault."""
    found = [k.strip() for k in keys]
    if key_file is not None:
        try:
            text = Path(key_file).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--api-key-file {key_file} cannot be read: {getattr(err, 'strerror', None) or err}") \
                from err
        lines = [line.strip() for line in text.splitlines()]
        from_file = [line for line in lines if line and not line.startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {key_file} holds no key (one per line; # starts a comment)")
        found += from_file
    if environ.get(API_KEY_ENV, "").strip():
        found.append(environ[API_KEY_ENV].strip())
    for key in found:
        if not key or any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError("an API key must be printable text without spaces (--api-key, --api-key-file, "
                             f"{API_KEY_ENV})")
    return tuple(dict.fromkeys(found))


def default_request_bytes(context: int) -> int:
    """--max-request-bytes when not given: room for a prompt that fills the context, written as text or ids."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * context)


def cache_home(environ: Mapping[str, str]) -> Path:
    """The user cache directory TensorFold writes under (XDG_CACHE_HOME or ~/.cache)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tensorfold"


@attrs.frozen
class Settings:
    """What one `tensorfold serve` runs with."""

    family: str | None = None
    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    context: int = DEFAULT_CONTEXT
    dtype: str = "auto"
    device: str = "auto"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    step_rows: int = DEFAULT_STEP_ROWS      # --max-step-rows: a step's rows, past its oldest prefill chunk
    min_chunk: int = DEFAULT_MIN_CHUNK
    served_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # --served-model-name, in order
    chat_template: str | None = attrs.field(default=None, repr=False)  # --chat-template's text (None: the model's)
    seed: int | None = None  # --seed: the seeds of unseeded requests come from a generator seeded with it
    max_waiting: int = 64
    parallel: int | None = None
    page_rows: int = DEFAULT_PAGE_ROWS
    kv_gib: float | None = None
    prompt_cache_gib: float = DEFAULT_PROMPT_CACHE_GIB
    host_cache_gib: float | None = None  # the host tier of kept states; None: a share of available RAM (boot)
    learn: bool = False                    # --learn-conversations: the disk tier (rows store) on
    learn_dir: Path | None = None          # None: `learned` under cache_dir
    learn_block_rows: int = DEFAULT_LEARN_BLOCK_ROWS
    learn_gib: float = DEFAULT_LEARN_GIB
    learn_daily_gib: float | None = None   # None: no daily write budget
    learn_min_free_gib: float = DEFAULT_LEARN_MIN_FREE_GIB
    cache_dir: Path = attrs.field(factory=lambda: cache_home(os.environ))
    switches: Mapping[str, bool] = attrs.field(factory=lambda: dict(CORE_SWITCHES), converter=dict)
    max_request_bytes: int | None = None   # None: default_request_bytes(context)
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple, repr=False)  # empty: no key asked
    metrics_open: bool = False             # --metrics-open: /metrics answers without a key
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=tuple)  # Host names accepted besides ours
    isolate_cache_by_key: bool = False     # kept states partitioned by the API key that made them
    special_tokens_in_content: bool = True  # off: special tokens typed in message content stay text
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    tensor_parallel: int = 1               # --tensor-parallel-size (--tp): ranks, rank 0 driving (follow/)
    tp_timeout_s: float = DEFAULT_TP_TIMEOUT_S  # --tp-timeout: a rank silent this long is lost (the server stops)

    @property
    def request_bytes(self) -> int:
        """The body size limit: --max-request-bytes, else derived from the context."""
        return self.max_request_bytes if self.max_request_bytes is not None else default_request_bytes(self.context)

    @property
    def learn_root(self) -> Path:
        """The rows store's directory: --learn-dir, else `learned` under the cache directory."""
        return Path(self.learn_dir).expanduser() if self.learn_dir is not None else self.cache_dir / "learned"

    def learn_flags_given(self) -> list[str]:
        """The --learn-* flags set away from their defaults (they do nothing without --learn-conversations)."""
        given = [("--learn-dir", self.learn_dir is not None),
                 ("--learn-block-rows", self.learn_block_rows != DEFAULT_LEARN_BLOCK_ROWS),
                 ("--learn-gib", self.learn_gib != DEFAULT_LEARN_GIB),
                 ("--learn-daily-gib", self.learn_daily_gib is not None),
                 ("--learn-min-free-gib", self.learn_min_free_gib != DEFAULT_LEARN_MIN_FREE_GIB)]
        return [flag for flag, set_ in given if set_]

    def switch(self, name: str) -> bool:
        """A switch read at startup; asking for one that was not read is a bug, not a default."""
        return self.switches[name]


def read_settings(environ: Mapping[str, str], switch_defaults: Iterable[tuple[str, bool]], *,
                  api_key: Iterable[str] = (), api_key_file: Path | None = None, chat_template: str | None = None,
                  **flags: object) -> Settings:
    """Build the record from parsed flags and the environment; the only place TF_* switches and TF_API_KEY are
    read, and where --api-key-file and --chat-template's file are read (once)."""
    switches = {name: read_switch(environ, name, default) for name, default in (*CORE_SWITCHES, *switch_defaults)}
    return Settings(cache_dir=cache_home(environ), switches=switches,
                    api_keys=read_api_keys(environ, api_key, api_key_file),
                    chat_template=read_chat_template(chat_template), **flags)


def read_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself when it is written inline (as vLLM takes it)."""
    if given is None:
        return None
    path = Path(given).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in given or "{%" in given:
        return given
    raise ValueError(f"--chat-template {given}: no such file (give a jinja file, or the template text itself)")
