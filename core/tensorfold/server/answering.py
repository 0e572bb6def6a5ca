"""What every generating route does around its own answer: open a stream once the first event is safe, or collect
the whole answer; a client gone first is a 499, an engine failure a 500, and the engine's work is freed however it
ends. Shared by the OpenAI routes (routes.py) and Anthropic's (anthropic.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from tensorfold.server.errors import engine_failed
from tensorfold.server.generation import ClientGone, Disconnected, EngineFailed

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"; nobody reads it, the log does


class Answering(Protocol):
    """A submitted generation (one choice or several) as these helpers use it."""

    async def first_event_ok(self, disconnected: Disconnected | None) -> None:
        """Return once the first event is not a failure."""
        ...

    def abandon(self) -> None:
        """The answer is no longer wanted: free the engine's work."""
        ...


async def stream_opens(generation: Answering, request: Request) -> Response | None:
    """None once a streamed answer may open (its first event arrived and is no failure); a 499 when the client
    went away first; a failure before any output raises (a plain 500, not a broken stream)."""
    try:
        await generation.first_event_ok(request.is_disconnected)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        generation.abandon()
        raise
    return None


async def collected(generation: Answering, collect: Callable[[], Awaitable[T]]) -> T | Response:
    """`collect()`'s whole answer; a 499 when the client went away, a 500 naming an engine failure."""
    try:
        return await collect()
    except EngineFailed as err:
        raise engine_failed(str(err)) from err
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        generation.abandon()
