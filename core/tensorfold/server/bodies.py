"""Request bodies read within a size and a time, and parsed off the event loop a few at a time.

The size is counted as the body arrives (a chunked body has no Content-Length to check up front), so no more than
the limit is ever held: uvicorn stops reading a connection once it holds 64 KiB the app has not taken. Parsing,
rendering and tokenizing a body costs far more memory and CPU than the body itself, so only `slots` of them run at
once, in worker threads; the event loop (and /health with it) stays free while a burst of large bodies waits.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread
from starlette.types import Message, Receive

from tensorfold.server.errors import INVALID, ApiError

T = TypeVar("T")
CLOSE = {"Connection": "close"}  # a client too slow to send its body is not kept for another request


def too_large(limit: int) -> ApiError:
    """A 413: the body is over the server's limit. The connection stays open while the rest of the body arrives,
    read and dropped (a client that writes its whole body before reading would otherwise see a reset, not the
    413), for at most --header-timeout (server/protocol.py: the next request head is due by then)."""
    return ApiError(413, f"the request body is larger than this server takes ({limit} bytes; --max-request-bytes)",
                    INVALID, None, "request_too_large")


def too_slow(seconds: float) -> ApiError:
    """A 408: the body did not arrive in time."""
    return ApiError(408, f"the request body did not arrive within {seconds:g} s (--body-timeout)", INVALID, None,
                    "request_timeout", headers=CLOSE)


class BodyReader:
    """A `receive` that refuses a body past `limit` bytes (413) or still arriving at `deadline` (408, loop time);
    once the body is whole it passes messages through untouched (a stream waits on it for the disconnect)."""

    def __init__(self, receive: Receive, limit: int, deadline: float, timeout_s: float) -> None:
        self.receive = receive
        self.limit = limit
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.seen = 0
        self.whole = False

    async def __call__(self) -> Message:
        """The next message, within the body's limits."""
        if self.whole:
            return await self.receive()
        try:
            with anyio.fail_after(max(0.0, self.deadline - anyio.current_time())):
                message = await self.receive()
        except TimeoutError:
            raise too_slow(self.timeout_s) from None
        if message["type"] != "http.request":
            self.whole = True
            return message
        self.seen += len(message.get("body", b""))
        if self.seen > self.limit:
            raise too_large(self.limit)
        self.whole = not message.get("more_body", False)
        return message


class ParseSlots:
    """At most `size` parse, render and tokenize jobs at once, each in a worker thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = \
            weakref.WeakKeyDictionary()

    async def run(self, job: Callable[..., T], *args: object) -> T:
        """`job(*args)` in a worker thread once a slot is free."""
        loop = asyncio.get_running_loop()
        limiter = self._limiters.get(loop)
        if limiter is None:  # one per event loop: a limiter belongs to the loop that made it
            limiter = self._limiters[loop] = anyio.CapacityLimiter(self.size)
        return await anyio.to_thread.run_sync(job, *args, limiter=limiter)
