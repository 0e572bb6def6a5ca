"""How the step loop reads an exception: whether the device is gone, and the words a client and the log get."""

from __future__ import annotations

import torch

from tensorfold.engine.api import DeviceLost
from tensorfold.shard import RankLost

CAUSES_FOLLOWED = 8  # how deep `raise ... from` chains are searched for a lost device


class LoopStopped(Exception):
    """The engine's own verdict that the step loop cannot go on; the message is the whole reason."""


def device_lost(err: BaseException) -> bool:
    """A family's DeviceLost, a tensor-parallel rank lost (shard.RankLost: the ranks cannot stay in step), or
    torch's accelerator errors (a CUDA error is sticky: the context cannot compute any more), here or in what it
    was raised from; an out-of-memory error is not one."""
    for _ in range(CAUSES_FOLLOWED):
        if isinstance(err, DeviceLost | RankLost | torch.AcceleratorError):
            return True
        if isinstance(err, RuntimeError) and not isinstance(err, torch.OutOfMemoryError) and "CUDA error" in str(err):
            return True
        if err.__cause__ is None:
            return False
        err = err.__cause__
    return False


def named(err: BaseException) -> str:
    """`Type: first line of the message` (torch's CUDA errors append lines of advice the log already holds)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def failed_request(err: BaseException) -> str:
    """What a client is told when the engine fails its request and goes on."""
    return f"the engine failed this request: {named(err)}"


def death_reason(err: BaseException) -> str:
    """Why the loop stopped for good, in one line, for /health, the log and every request it fails."""
    if isinstance(err, LoopStopped):
        return str(err)
    lost = next((e for e in _chain(err) if isinstance(e, RankLost)), None)
    if lost is not None:
        return f"a tensor-parallel rank is lost: {lost}"
    if device_lost(err):
        return f"the device is lost: {named(err)}"
    return f"the step loop failed: {named(err)}"


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and what it was raised from, as deep as device_lost looks."""
    found: list[BaseException] = []
    while err is not None and len(found) < CAUSES_FOLLOWED:
        found.append(err)
        err = err.__cause__
    return found
