"""Where streams' declared states live. Families read and write only through the KvStore interface."""

from tensorfold.kv.base import KvStore
from tensorfold.kv.paged import PagedStore
from tensorfold.kv.window import WindowStore

__all__ = ["KvStore", "PagedStore", "WindowStore"]
