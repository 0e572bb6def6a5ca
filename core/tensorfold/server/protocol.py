"""uvicorn's h11 protocol with a deadline on the request head, and its own refusals in OpenAI's envelope.

uvicorn closes a connection idle after a response (`timeout_keep_alive`) but sets no deadline on a request head
still arriving: a client that sends a header byte every few seconds holds its connection, and its place under
`limit_concurrency`, for ever. This subclass arms a timer whenever the connection waits for a head (on connect,
and after each response) and closes it when the head is not whole by then, with a 408 when part of one came. The
timer lives in the protocol because only the protocol sees bytes before a request exists; an ASGI app is called
only once the head is whole. The body's own deadline is the app's (server/bodies.py), where a 408 can be answered.

Past `limit_concurrency` (--max-connections) uvicorn answers a plain-text 503; this subclass makes the same check
in front of the app instead and answers it in the envelope, with Retry-After.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tensorfold.server.errors import INVALID, envelope, queue_full
from tensorfold.settings import DEFAULT_HEADER_TIMEOUT_S

HEAD_BYTES = 16 * 1024  # the largest request line and headers together (h11's default, named): larger is a 400


def raw_response(status: int, reason: str, payload: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written where h11 has no request to answer."""
    body = json.dumps(payload).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the request-head deadline; `header_timeout_s` is set on a subclass per server."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_bytes = 0
        self.connection_limit = self.limit_concurrency
        self.limit_concurrency = None  # checked by `limited` instead, to answer in the envelope
        self.served_app = self.app
        self.app = self.limited

    async def limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """uvicorn's concurrency check (this request's task is counted already), answered in the envelope."""
        limit = self.connection_limit
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) > limit):
            refusal = queue_full(f"it serves at most {limit} connections at once (--max-connections)")
            await refusal.response()(scope, receive, send)
            return
        await self.served_app(scope, receive, send)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """A new connection owes a request head."""
        super().connection_made(transport)
        self.await_head()

    def data_received(self, data: bytes) -> None:
        """Bytes in; a request head complete stops the clock."""
        cycle = self.cycle
        self.head_bytes += len(data)
        super().data_received(data)
        if self.cycle is not cycle:
            self.stop_head_timer()

    def on_response_complete(self) -> None:
        """A response sent: unless a pipelined request already started, the next head is owed."""
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():
            self.await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        """Gone: no deadline left to keep."""
        self.stop_head_timer()
        super().connection_lost(exc)

    def await_head(self) -> None:
        """Start the clock on the next request head."""
        self.stop_head_timer()
        self.head_bytes = 0
        self.head_timer = self.loop.call_later(self.header_timeout_s, self.head_timed_out)

    def stop_head_timer(self) -> None:
        """Stop the clock."""
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_timed_out(self) -> None:
        """The head did not come whole in time: close, saying why if part of one came."""
        self.head_timer = None
        if self.transport.is_closing():
            return
        if self.head_bytes and self.conn.our_state is h11.IDLE:
            message = f"the request head did not arrive within {self.header_timeout_s:g} s (--header-timeout)"
            self.transport.write(raw_response(408, "Request Timeout", envelope(message, INVALID, None,
                                                                              "request_timeout")))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a malformed line, a head over the size limit): 400 in the envelope."""
        limit = self.config.h11_max_incomplete_event_size or HEAD_BYTES
        message = f"invalid HTTP request: a malformed request line or header, or a head over {limit} bytes"
        self.transport.write(raw_response(400, "Bad Request", envelope(message, INVALID, None, "invalid_http")))
        self.transport.close()


def guarded_protocol(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with this head deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
