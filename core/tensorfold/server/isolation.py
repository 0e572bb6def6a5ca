"""Which kept states a request may share: its partition, from its `cache_salt` and (with --isolate-cache-by-key)
the API key that sent it.

A partition is an opaque hex digest, "" for the shared one. The engine only compares partitions (engine/api.py
Request.partition); the disk tier folds a non-empty one into its names, so no salt or key is ever written.
"""

from __future__ import annotations

import hashlib

SHARED = ""
KEY_ID_HEX = 32  # a key's id: the first hex digits of its sha256, enough to tell keys apart, never the key


def key_id(key: str) -> str:
    """A stable name for an API key that does not reveal it (what the auth check records for the request)."""
    return hashlib.sha256(b"tensorfold-api-key\0" + key.encode()).hexdigest()[:KEY_ID_HEX]


def partition_of(salt: str | None, key: str | None) -> str:
    """The partition of a request with this `cache_salt` and this key id (None: no key, or not isolating)."""
    if not salt and not key:
        return SHARED
    material = f"key\0{key or ''}\0salt\0{salt or ''}".encode()
    return hashlib.sha256(b"tensorfold-partition\0" + material).hexdigest()
