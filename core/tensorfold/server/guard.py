"""The front door as one pure ASGI middleware: every request passes the Host check, then the key check, then the
content type and size checks of its body, before any route sees it; refusals are OpenAI's error envelope
(Anthropic's on its /v1/messages routes).

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which runs the app in a separate task and buffers nothing
well: SSE streams and disconnect checks pass through this one untouched.
"""

from __future__ import annotations

import anyio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from tensorfold.server.access import host_allowed, json_content_type, matching_key, presented_keys
from tensorfold.server.anthropic import refusal as anthropic_refusal
from tensorfold.server.bodies import BodyReader, too_large
from tensorfold.server.door import FrontDoor, key_digest
from tensorfold.server.errors import INVALID, ApiError
from tensorfold.server.isolation import key_id

OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DIGITS_PAST_ANY_LIMIT = 18  # a Content-Length this long is over any limit (and int() refuses 4,300 digits)
NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
          "auth (i.e. Authorization: Bearer YOUR_KEY), or in an x-api-key header.")
WRONG_KEY = "Incorrect API key provided. Ask this server's operator for a key (--api-key)."


class Guard:
    """Refuse what the front door does not let in; hand the rest on with the body's limits on `receive` and the
    key's id (never the key) in `request.state.api_key_id`."""

    def __init__(self, app: ASGIApp, door: FrontDoor, json_paths: frozenset[str]) -> None:
        self.app = app
        self.door = door
        self.json_paths = json_paths
        self.digests = door.key_digests
        self.key_ids = tuple(key_id(key) for key in door.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check one request; answer a refusal here, or pass it on."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = anyio.current_time()
        headers = Headers(scope=scope)
        try:
            self.check_host(headers)
            self.check_key(scope, headers)
            self.check_body(scope, headers)
        except ApiError as refusal:
            await anthropic_refusal(scope["path"], refusal)(scope, receive, send)
            return
        reader = BodyReader(receive, self.door.request_bytes, started + self.door.body_timeout_s,
                            self.door.body_timeout_s)
        await self.app(scope, reader, send)

    def check_host(self, headers: Headers) -> None:
        """A Host this server does not answer to (DNS rebinding names the attacker's domain): 403."""
        host = headers.get("host")
        if not host_allowed(host, self.door.bound_loopback, self.door.allowed_hosts):
            raise ApiError(403, f"this server does not answer to the Host {host!r}; its operator can allow it "
                           "with --allowed-hosts", INVALID, "Host", "host_not_allowed")

    def check_key(self, scope: Scope, headers: Headers) -> None:
        """With keys set, a request without one of them is a 401 (but /health, and /metrics with --metrics-open)."""
        if not self.digests:
            return
        path = scope["path"]
        if path in OPEN_PATHS or (path == METRICS_PATH and self.door.metrics_open):
            return
        given = presented_keys(headers.get("authorization"), headers.get("x-api-key"))
        at = matching_key([key_digest(key) for key in given], self.digests)
        if at is None:
            param = "x-api-key" if "x-api-key" in headers and "authorization" not in headers else "Authorization"
            raise ApiError(401, WRONG_KEY if given else NO_KEY, INVALID, param, "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        scope.setdefault("state", {})["api_key_id"] = self.key_ids[at]

    def check_body(self, scope: Scope, headers: Headers) -> None:
        """A JSON route's body: JSON (415), no larger than the limit as declared (413, before reading a byte)."""
        if scope["method"] not in BODY_METHODS:
            return
        if scope["path"] in self.json_paths:
            why = json_content_type(headers.get("content-type"))
            if why is not None:
                raise ApiError(415, f"{why}: this endpoint takes a JSON body (content-type: application/json)",
                               INVALID, "content-type", "unsupported_media_type")
        length = (headers.get("content-length") or "").strip()
        if length.isdigit() and (len(length) > DIGITS_PAST_ANY_LIMIT or int(length) > self.door.request_bytes):
            raise too_large(self.door.request_bytes)
