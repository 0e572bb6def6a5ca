"""The Starlette application around one served model."""

from __future__ import annotations

from starlette.applications import Starlette

from tensorfold.server.errors import HANDLERS
from tensorfold.server.routes import routes
from tensorfold.service import Service


def build_app(service: Service) -> Starlette:
    """The OpenAI-compatible API for `service`; errors in OpenAI's envelope, 404/405 included."""
    return Starlette(routes=routes(service), exception_handlers=HANDLERS)
