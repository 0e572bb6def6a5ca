"""The OpenAI-compatible HTTP server: text in and out, token ids to the engine, never a tensor."""

from tensorfold.server.app import build_app

__all__ = ["build_app"]
