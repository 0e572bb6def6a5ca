"""What the engine tests of kept states share: the example family's rig and prompts for the gates in
tensorfold.testing.engine_gates, and a three-turn chat through a real engine."""

from __future__ import annotations

from tensorfold.engine.api import Sampling
from tensorfold.engine.runner import Engine
from tensorfold.testing.engine_gates import Chat, Client, Rig, Turn, ask

__all__ = ["CHUNK", "CONTEXT", "MIN_CHUNK", "PAGE_ROWS", "REPLY", "RIG", "USERS", "Client", "ask", "converse",
           "engine", "fresh", "memory", "tokens"]

RIG = Rig(context=256, chunk=32, min_chunk=8, page_rows=16, max_waiting=8)
CONTEXT, CHUNK, MIN_CHUNK, PAGE_ROWS = RIG.context, RIG.chunk, RIG.min_chunk, RIG.page_rows
REPLY = 10
USERS = (45, 30, 27)  # each turn's new user message, in tokens

memory, engine, fresh = RIG.memory, RIG.engine, RIG.fresh


def tokens(n: int, salt: int) -> tuple[int, ...]:
    """The example's prompt pieces."""
    return tuple((i * 37 + salt * 13) % 500 + 3 for i in range(n))


def converse(eng: Engine, sampling: Sampling, salt: int = 0, cancel_turn: int | None = None) -> list[Turn]:
    """Three turns of one chat (rewind marks at each new user message); the turn `cancel_turn` cancelled after 3
    tokens."""
    chat = Chat(tokens, salt)
    for k, user in enumerate(USERS):
        chat.turn(eng, sampling, user, cancel_after=3 if k == cancel_turn else None)
    return chat.turns
