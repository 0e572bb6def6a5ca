"""Recording a run (requests with the resume row each must get) and replaying its requests to another server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from gate.policy import KeepModel, shape_of
from gate.records import Exchange, Run, ScenarioRun, Step
from gate.wire import Reply, Server, Tiers, tier_delta

Messages = list[dict[str, Any]]


def server_facts(server: Server) -> dict[str, Any]:
    """What a run records about its server: model, plan, poison, and its tiers with their budgets."""
    plan = server.memory()["plan"]
    return {"url": server.base_url, "model": server.model, "plan": plan, "poison": bool(plan.get("poison")),
            "tiers": {name: numbers.get("budget", 0) for name, numbers in server.tiers().items()}}


@attrs.define
class Recorder:
    """Sends a scenario's requests to a cache-on server, predicting each one's resume row first."""

    server: Server
    model: KeepModel
    run: Run
    seed: int
    max_tokens: int
    scenario: str = ""
    _step: int = 0

    def body(self, messages: Messages, max_tokens: int | None = None) -> dict[str, Any]:
        """A greedy, seeded chat request."""
        return {"model": self.server.model, "messages": [dict(m) for m in messages], "temperature": 0,
                "seed": self.seed, "max_tokens": max_tokens or self.max_tokens}

    @contextlib.contextmanager
    def scenario_run(self, name: str, drops: bool = False) -> Iterator[None]:
        """Run a scenario's steps, recording the tier counters' movement over all of them."""
        self.scenario = name
        before = self.server.tiers()
        yield
        self.run.scenarios.append(ScenarioRun(name, tier_delta(before, self.server.tiers()), drops))

    def turn(self, messages: Messages, max_tokens: int | None = None, expected_tier: str | None = None,
             same_as: int | None = None) -> Exchange:
        """One request on its own."""
        return self.together([messages], max_tokens, expected_tier, same_as)[0]

    def together(self, conversations: list[Messages], max_tokens: int | None = None,
                 expected_tier: str | None = None, same_as: int | None = None) -> list[Exchange]:
        """Requests sent at once (each one's resume row predicted from what was kept before any of them)."""
        bodies = [self.body(messages, max_tokens) for messages in conversations]
        shapes = [shape_of(self.server, body["messages"]) for body in bodies]
        rows = [self.model.resume_row(shape) for shape in shapes]
        replies, tiers = send(self.server, bodies)
        for shape, reply in zip(shapes, replies, strict=True):
            if reply.prompt_token_ids != shape.prompt:
                raise RuntimeError("the chat prompt's tokens differ from /tokenize's rendering of the same messages")
        for shape, row in zip(shapes, rows, strict=True):
            self.model.after(shape, row)
        self.run.steps.append(Step(self.scenario, self._step, tiers))
        made = [Exchange(self.scenario, self._step, body, reply, row, expected_tier, same_as)
                for body, reply, row in zip(bodies, replies, rows, strict=True)]
        self.run.exchanges += made
        self._step += 1
        return made

    def tiers(self) -> Tiers:
        """The server's tiers now."""
        return self.server.tiers()


def send(server: Server, bodies: list[dict[str, Any]]) -> tuple[list[Reply], Tiers]:
    """Send requests at once and wait for all; the tier counters' movement over them."""
    before = server.tiers()
    if len(bodies) == 1:
        replies = [server.chat(bodies[0])]
    else:
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(server.chat, bodies))
    return replies, tier_delta(before, server.tiers())


def replay(recorded: Run, server: Server) -> Run:
    """Send a recorded run's requests to `server` step by step, as they were sent (together where they were)."""
    run = Run(meta=server_facts(server))
    steps: dict[int, list[Exchange]] = {}
    for exchange in recorded.exchanges:
        steps.setdefault(exchange.step, []).append(exchange)
    for step, exchanges in steps.items():
        replies, tiers = send(server, [{**e.body, "model": server.model} for e in exchanges])
        run.steps.append(Step(exchanges[0].scenario, step, tiers))
        run.exchanges += [attrs.evolve(e, reply=reply, expected_cached=None, expected_tier=None)
                          for e, reply in zip(exchanges, replies, strict=True)]
    run.integrity = server.idle()["integrity_when_idle"]
    return run
