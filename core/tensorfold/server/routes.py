"""The endpoints: each parses, submits or answers, and leaves tensors to the engine.

A body is parsed, rendered and tokenized in a worker thread, a bounded number at once (server/bodies.py), so a
long prompt or a burst of large bodies does not stall other streams or /health.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tensorfold.server.answering import collected, stream_opens
from tensorfold.server.anthropic import anthropic_routes
from tensorfold.server.bodies import ParseSlots
from tensorfold.server.choices import ChoicesStream, whole, whole_one
from tensorfold.server.door import FrontDoor
from tensorfold.server.errors import model_not_found
from tensorfold.server.fields import parse_body
from tensorfold.server.generation import Choices, Generation
from tensorfold.server.isolation import partition_of
from tensorfold.server.metrics import metrics_endpoint
from tensorfold.server.params import Generate, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from tensorfold.server.payloads import CHAT, TEXT, Shaper
from tensorfold.server.replies import chat_output
from tensorfold.server.sse import EventStream
from tensorfold.service import Service

T = TypeVar("T")
Endpoint = Callable[[Request], Awaitable[Response]]


async def answer(request: Request, service: Service, params: Generate, kind: str, prefix: str) -> Response:
    """Submit and answer: an SSE stream, or one JSON object once the engine is done; several choices (`n`,
    `best_of`) are forks of one engine request (server/choices.py)."""
    key = getattr(request.state, "api_key_id", None) if service.isolate_by_key else None
    partition = partition_of(params.cache_salt, key)
    many = params.best_of > 1
    generation = Choices(service, params, prefix, partition) if many else Generation(service, params, prefix,
                                                                                      partition)
    shaper = Shaper(kind, generation.id, params.model, params.return_token_ids,
                    service.tokenizer.token_text if params.sampling.logprobs is not None else None,
                    service.tokenizer.token_text)
    output = chat_output(service, params) if kind == CHAT and not many else None
    generation.submit()
    if params.stream:
        refused = await stream_opens(generation, request)
        if refused is not None:
            return refused
        if isinstance(generation, Choices):
            return ChoicesStream(generation, shaper, service)
        return EventStream(generation, shaper, params.include_usage, output)
    if isinstance(generation, Choices):
        body = await collected(generation, lambda: whole(generation, shaper, service, request.is_disconnected))
    else:
        body = await collected(generation, lambda: whole_one(generation, shaper, output, request.is_disconnected))
    if isinstance(body, Response):
        return body
    return JSONResponse(body)


def tokenized(body: dict[str, Any], service: Service, specials_in_content: bool) -> JSONResponse:
    """POST /tokenize's answer, rendered here too (a long prompt's ids are a long JSON array)."""
    found = parse_tokenize(body, service, specials_in_content)
    return JSONResponse({"tokens": list(found.tokens), "count": len(found.tokens), "max_model_len": service.context})


def detokenized(body: dict[str, Any], service: Service) -> str:
    """POST /detokenize's answer: the text of `tokens`."""
    return service.tokenizer.decode(parse_detokenize(body, service))


def read(parse: Callable[..., T], *args: object) -> Callable[[bytes], T]:
    """A job for a parse slot: the body's JSON, then `parse(body, *args)`."""
    return lambda raw: parse(parse_body(raw), *args)


def routes(service: Service, door: FrontDoor | None = None) -> list[Route]:
    """Every route of the API, bound to one served model and its front door's settings."""
    door = door or FrontDoor()
    started = int(time.time())
    slots = ParseSlots(door.parse_slots)
    specials = door.specials_in_content

    async def chat_completions(request: Request) -> Response:
        params = await slots.run(read(parse_chat, service, specials), await request.body())
        return await answer(request, service, params, CHAT, "chatcmpl")

    async def completions(request: Request) -> Response:
        params = await slots.run(read(parse_completion, service), await request.body())
        return await answer(request, service, params, TEXT, "cmpl")

    def model_card(name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": started, "owned_by": "tensorfold",
                "root": service.model_name, "max_model_len": service.context}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(name) for name in service.names]})

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in service.names:
            raise model_not_found(name, service.names)
        return JSONResponse(model_card(name))

    async def health(request: Request) -> Response:
        failure = service.engine.failure  # the engine stopped for good: the process is exiting (launch.py)
        if failure is not None:
            return JSONResponse({"status": "dead", "reason": failure}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def memory(request: Request) -> Response:
        return JSONResponse({"plan": service.plan, "now": service.engine.snapshot()})

    async def tokenize(request: Request) -> Response:
        return await slots.run(read(tokenized, service, specials), await request.body())

    async def detokenize(request: Request) -> Response:
        text = await slots.run(read(detokenized, service), await request.body())
        return JSONResponse({"prompt": text})

    return [
        *anthropic_routes(service, slots, specials),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/memory", memory, methods=["GET"]),
        Route("/metrics", metrics_endpoint(service), methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
