"""Anthropic's Messages API on the same engine: POST /v1/messages and /v1/messages/count_tokens.

A request is translated into an OpenAI chat body (server/anthropic_request.py) and parsed by `parse_chat`, so it
renders, tokenizes, starts and keeps states exactly as /v1/chat/completions does: an Anthropic conversation's next
turn resumes where the last one was kept. The reply goes back as Anthropic's message (server/anthropic_stream.py).
Refusals on these routes are Anthropic's error envelope, with the statuses the OpenAI routes use.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tensorfold.chat.api import ReplyParts
from tensorfold.server.answering import collected, stream_opens
from tensorfold.server.anthropic_request import to_chat
from tensorfold.server.anthropic_stream import (
    API_ERROR,
    Ending,
    MessageStream,
    error_body,
    message_body,
    message_events,
)
from tensorfold.server.bodies import ParseSlots
from tensorfold.server.errors import ApiError
from tensorfold.server.fields import parse_body
from tensorfold.server.generation import Finish, Generation
from tensorfold.server.isolation import partition_of
from tensorfold.server.params import Generate, chat_prompt, check_common, parse_chat
from tensorfold.server.replies import chat_output
from tensorfold.service import Service

log = logging.getLogger(__name__)
MESSAGE_PREFIX = "msg"
PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error type for each status the server answers with (errors.py, bodies.py, guard.py)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
               500: API_ERROR, 503: "overloaded_error"}


def anthropic_error(err: ApiError) -> JSONResponse:
    """An ApiError in Anthropic's envelope: same status and headers, the type Anthropic gives that status."""
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    kind = ERROR_TYPES.get(err.status, API_ERROR if err.status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, kind), status_code=err.status, headers=err.headers)


def refusal(path: str, err: ApiError) -> JSONResponse:
    """A refusal in the envelope of the API its path belongs to: for the front door (server/guard.py), which
    answers before any route (a missing key, a content type, a body too large)."""
    return anthropic_error(err) if path in PATHS else err.response()


def anthropic_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint with its refusals (and bugs) answered in Anthropic's envelope rather than by the app's
    OpenAI-envelope handlers."""
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as err:
            return anthropic_error(err)
        except Exception as err:  # a bug: logged, answered as on_unexpected does, in this API's envelope
            log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=err)
            return JSONResponse(error_body(f"internal error: {type(err).__name__}", API_ERROR), status_code=500)
    return guarded


def parse_message(raw: bytes, service: Service, specials: bool) -> Generate:
    """A parse-slot job: the Anthropic body, translated, then parsed as a chat request."""
    return parse_chat(to_chat(parse_body(raw)), service, specials)


def count_prompt(raw: bytes, service: Service, specials: bool) -> int:
    """A parse-slot job: the tokens of the prompt a Messages request with this body would submit (rendered as
    parse_chat renders it, tools included; no context rule, no max_tokens)."""
    chat = to_chat(parse_body(raw), count=True)
    check_common(chat, service)
    return len(chat_prompt(chat, service, specials).ids)


async def reply(request: Request, service: Service, params: Generate) -> Response:
    """Submit and answer: Anthropic's event stream, or the message once the engine is done."""
    key = getattr(request.state, "api_key_id", None) if service.isolate_by_key else None
    generation = Generation(service, params, MESSAGE_PREFIX, partition_of(params.cache_salt, key))
    message_id = "msg_" + generation.id.removeprefix(MESSAGE_PREFIX + "-")
    output = chat_output(service, params)
    ending = Ending(generation, output, service.tokenizer.decode)
    generation.submit()
    if params.stream:
        refused = await stream_opens(generation, request)
        if refused is not None:
            return refused
        return MessageStream(generation, message_events(generation, output, message_id, ending))
    got = await collected(generation, lambda: texts_of(generation, request))
    if isinstance(got, Response):
        return got
    text, finish = got
    parts = output.whole(text) if output is not None else ReplyParts(text)
    return JSONResponse(message_body(message_id, params.model, parts, ending.of(finish), finish.usage))


async def texts_of(generation: Generation, request: Request) -> tuple[str, Finish]:
    """A non-streamed reply's whole text and its Finish."""
    texts: list[str] = []
    finish: Finish | None = None
    async for batch in generation.batches(request.is_disconnected):
        texts += [item.text for item in batch if not isinstance(item, Finish)]
        finish = next((item for item in batch if isinstance(item, Finish)), finish)
    assert finish is not None
    return "".join(texts), finish


def anthropic_routes(service: Service, slots: ParseSlots, specials: bool) -> list[Route]:
    """The Messages API's routes, parsing in the same slots as the OpenAI routes."""

    async def messages(request: Request) -> Response:
        params = await slots.run(parse_message, await request.body(), service, specials)
        return await reply(request, service, params)

    async def count_tokens(request: Request) -> Response:
        count = await slots.run(count_prompt, await request.body(), service, specials)
        return JSONResponse({"input_tokens": count})

    return [Route(PATHS[0], anthropic_errors(messages), methods=["POST"]),
            Route(PATHS[1], anthropic_errors(count_tokens), methods=["POST"])]
