"""The gate's files: every request sent and every reply, with what the cache-on run expected of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from gate.wire import Reply, Tiers

FORMAT = 1


@attrs.frozen
class Exchange:
    """One chat request and its reply. `step` groups requests sent at once; `expected_cached` is the resume row
    the keep policy predicts (recorded runs only); `expected_tier` the tier it must come from (None: any);
    `same_as` an earlier exchange whose generated tokens this one must repeat."""

    scenario: str
    step: int
    body: dict[str, Any]
    reply: Reply
    expected_cached: int | None = None
    expected_tier: str | None = None
    same_as: int | None = None

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {**attrs.asdict(self, recurse=False), "reply": self.reply.as_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Exchange:
        """Back from `as_json`."""
        return cls(**{**data, "reply": Reply.from_json(data["reply"])})


@attrs.frozen
class Step:
    """The tier counters' movement over one step (one request, or requests sent at once)."""

    scenario: str
    step: int
    tiers: Tiers


@attrs.frozen
class ScenarioRun:
    """A scenario's name, its tier counter movement, and whether it meant to push states out of the last tier."""

    name: str
    tiers: Tiers
    drops: bool = False


@attrs.define
class Run:
    """One server's run of the scenarios: the facts it was run with, then everything it said."""

    meta: dict[str, Any]
    exchanges: list[Exchange] = attrs.field(factory=list)
    steps: list[Step] = attrs.field(factory=list)
    scenarios: list[ScenarioRun] = attrs.field(factory=list)
    integrity: str = "not checked"

    def write(self, path: Path) -> None:
        """Write as JSON."""
        data = {"format": FORMAT, "meta": self.meta, "integrity": self.integrity,
                "exchanges": [e.as_json() for e in self.exchanges],
                "steps": [attrs.asdict(s) for s in self.steps],
                "scenarios": [attrs.asdict(s) for s in self.scenarios]}
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def read(cls, path: Path) -> Run:
        """Read a file `write` wrote."""
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise SystemExit(f"{path}: not a reuse-gate file of format {FORMAT}")
        return cls(meta=data["meta"], integrity=data["integrity"],
                   exchanges=[Exchange.from_json(e) for e in data["exchanges"]],
                   steps=[Step(**s) for s in data["steps"]], scenarios=[ScenarioRun(**s) for s in data["scenarios"]])
