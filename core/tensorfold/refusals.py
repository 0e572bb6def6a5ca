"""Startup refusals: every reason the server cannot start, collected and reported together."""

from __future__ import annotations

import attrs


@attrs.frozen
class Refusal:
    """One reason to refuse, and who says so (`core` or a family's name)."""

    source: str
    message: str


class Refused(Exception):
    """Startup was refused; the message lists every reason at once."""

    def __init__(self, refusals: list[Refusal]) -> None:
        self.refusals = refusals
        lines = [f"  - [{r.source}] {r.message}" for r in refusals]
        super().__init__("tensorfold refuses to start:\n" + "\n".join(lines))


def raise_if_any(refusals: list[Refusal]) -> None:
    """Raise one Refused listing them all, when there are any."""
    if refusals:
        raise Refused(refusals)
