"""Every flag and TF_* switch, read once at startup into one frozen record; nothing else reads the environment."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs

TRUE = {"1", "true", "on", "yes"}
FALSE = {"0", "false", "off", "no"}
DEFAULT_CONTEXT = 4096
DEFAULT_PREFILL_CHUNK = 2048
DEFAULT_PAGE_ROWS = 256
DEFAULT_MIN_CHUNK = 256  # a request start closer than this to the previous prefill cut merges into it
DEFAULT_PROMPT_CACHE_GIB = 1.0  # kept prompt states (the device tier); 0 turns the tier off
DEFAULT_LEARN_BLOCK_ROWS = 256  # rows per shared block of the rows store on disk
DEFAULT_LEARN_GIB = 32.0        # the rows store's cap, every identity together
DEFAULT_LEARN_MIN_FREE_GIB = 4.0  # writing pauses below this much free disk; serving goes on
CORE_SWITCHES: tuple[tuple[str, bool], ...] = (
    ("TF_KV_PAGES", True),    # off: each stream owns one contiguous window (the reference layout)
    ("TF_KV_POISON", False),  # on: every page handed out is filled with NaN first
    ("TF_CUDA_GRAPHS", True),  # on: decode steps replay CUDA graphs (GPU only); off: the same decode, eager
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
    min_chunk: int = DEFAULT_MIN_CHUNK
    served_name: str | None = None
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


def read_settings(environ: Mapping[str, str], switch_defaults: Iterable[tuple[str, bool]], **flags: object) -> Settings:
    """Build the record from parsed flags and the environment; the only place TF_* switches are read."""
    switches = {name: read_switch(environ, name, default) for name, default in (*CORE_SWITCHES, *switch_defaults)}
    return Settings(cache_dir=cache_home(environ), switches=switches, **flags)
