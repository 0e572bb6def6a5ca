"""What both delta-rule ops (gated_delta, kda) refuse: they validate the same arguments by the same contract, so
the mistakes common to both are listed once; each test file adds those that depend on its op's shapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

Mistake = Callable[[dict], None]

CHUNK_MISTAKES: dict[str, Mistake] = {
    "k shape": lambda a: a.update(k=a["k"][:, :1]),
    "g dtype": lambda a: a.update(g=a["g"].bfloat16()),
    "mixed dtype": lambda a: a.update(v=a["v"].double()),
    "cu_seqlens": lambda a: a.update(cu_seqlens=[0, 4, 5]),
    "starts": lambda a: a.update(cu_seqlens=[0, 2, 6], starts=[0]),
    "start with cu_seqlens": lambda a: a.update(cu_seqlens=[0, 6], start=3),
    "starts without cu_seqlens": lambda a: a.update(starts=[3]),
    "negative start": lambda a: a.update(start=-1),
}
STEP_MISTAKES: dict[str, Mistake] = {
    "duplicate slots": lambda a: a.update(slots=[0, 1, 1]),
    "slot range": lambda a: a.update(slots=[0, 1, 4]),
    "slot count": lambda a: a.update(slots=[0, 1]),
    "pool dtype": lambda a: a.update(states=a["states"].double()),
    "pool layout": lambda a: a.update(states=a["states"].transpose(-1, -2)),
}


def assert_refused(op: Callable[..., object], mistake: Mistake, **args: object) -> None:
    """`op` raises ValueError once `mistake` has spoiled its otherwise valid arguments."""
    mistake(args)
    with pytest.raises(ValueError):
        op(**args)
