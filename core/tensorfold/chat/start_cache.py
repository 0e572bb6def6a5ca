"""The proven starts of the conversations served lately, so a chat's next turn proves only what is new.

A conversation prefix `messages[:i]` is named by a hash chain over its messages (the template, its kwargs and the
prompt encoding included); its entry holds the starts proven for messages 1..i-1 and a hash of the rendered text up
to the last of them. An entry is reused for a later prompt only when that prompt's text hashes the same up to that
point and the prompt's tokens still break there (server/starts.py proves that boundary), since a template may
rewrite earlier turns when a later one arrives (Qwen3.5 drops the reasoning of turns before a new user message):
then a shorter prefix's entry, from an earlier turn, is tried. Bounded in entries and in the starts they hold,
least recently used first out.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

ENTRIES_KEPT = 4096  # conversation prefixes remembered
STARTS_KEPT = 262_144  # message starts remembered over all entries (about 150 bytes each: some 40 MB at most)
PROBE_TAILS_KEPT = 256  # (template, kwargs) pairs whose probe tails are remembered


@attrs.frozen
class Entry:
    """Starts proven for messages 1..i-1 of a conversation prefix: message index → (char offset, token
    position); `text_hash` is the hash of the prompt text up to `end` (the last start's char offset)."""

    starts: Mapping[int, tuple[int, int]]
    end: int
    text_hash: bytes


def text_hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def chain(seed: bytes, messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """Hash of each prefix messages[:i], 0 ≤ i ≤ len(messages), each from the one before: linear in the chat."""
    hashes = [seed]
    for message in messages:
        part = json.dumps(message, sort_keys=True, ensure_ascii=False, default=repr).encode("utf-8", "surrogatepass")
        hashes.append(hashlib.blake2b(hashes[-1] + part, digest_size=16).digest())
    return hashes


class StartCache:
    """A bounded LRU of conversation-prefix entries and of per-template probe tails; thread-safe."""

    def __init__(self, entries: int = ENTRIES_KEPT, starts: int = STARTS_KEPT) -> None:
        self.limit = entries
        self.starts_limit = starts
        self._held = 0  # starts held over all entries
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._tails: OrderedDict[tuple[Any, ...], dict[tuple[str, ...], str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, entry: Entry) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            self._held += len(entry.starts) - (len(old.starts) if old is not None else 0)
            self._entries[key] = entry
            while len(self._entries) > 1 and (len(self._entries) > self.limit or self._held > self.starts_limit):
                _, dropped = self._entries.popitem(last=False)
                self._held -= len(dropped.starts)

    def tails(self, key: tuple[Any, ...]) -> dict[tuple[str, ...], str | None]:
        """The probe tails learned for a template and kwargs (filled in by server/starts.py)."""
        with self._lock:
            found = self._tails.get(key)
            if found is None:
                found = self._tails[key] = {}
                while len(self._tails) > PROBE_TAILS_KEPT:
                    self._tails.popitem(last=False)
            self._tails.move_to_end(key)
            return found
