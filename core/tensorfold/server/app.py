"""The Starlette application around one served model, behind the front door (server/guard.py)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from tensorfold.server.door import FrontDoor
from tensorfold.server.errors import HANDLERS
from tensorfold.server.guard import Guard
from tensorfold.server.routes import routes
from tensorfold.service import Service
from tensorfold.settings import default_request_bytes


def build_app(service: Service, door: FrontDoor | None = None) -> Starlette:
    """The OpenAI-compatible API for `service`; errors in OpenAI's envelope, 404/405 included. Without `door`, an
    open one (no keys, any Host) with the body limit the context implies."""
    door = door or FrontDoor(request_bytes=default_request_bytes(service.context))
    table = routes(service, door)
    json_paths = frozenset(r.path for r in table if isinstance(r, Route) and "POST" in (r.methods or ()))
    return Starlette(routes=table, exception_handlers=HANDLERS,
                     middleware=[Middleware(Guard, door=door, json_paths=json_paths)])
