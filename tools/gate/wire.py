"""The gate's HTTP side: streamed chat turns timed to their first token, /tokenize, /memory and /metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
from prometheus_client.parser import text_string_to_metric_families

TIER_FIELDS = ("kept", "hits", "misses", "evicted", "refused", "cached_tokens", "states", "bytes", "budget")
_METRIC_FIELD = {"tensorfold_tier_kept_total": "kept", "tensorfold_tier_hits_total": "hits",
                 "tensorfold_tier_misses_total": "misses", "tensorfold_tier_evicted_total": "evicted",
                 "tensorfold_tier_refused_total": "refused", "tensorfold_prompt_tokens_cached_total": "cached_tokens",
                 "tensorfold_tier_states": "states", "tensorfold_tier_bytes": "bytes",
                 "tensorfold_tier_budget_bytes": "budget"}


@attrs.frozen
class Reply:
    """What one streamed chat request came back with; `ttft_s` is the wait for the first generated token."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {**attrs.asdict(self), "prompt_token_ids": list(self.prompt_token_ids),
                "token_ids": list(self.token_ids)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Reply:
        """Back from `as_json`."""
        return cls(**{**data, "prompt_token_ids": tuple(data["prompt_token_ids"]),
                      "token_ids": tuple(data["token_ids"])})


Tiers = dict[str, dict[str, float]]


class Server:
    """One running `tensorfold serve`, spoken to over HTTP."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    def chat(self, body: Mapping[str, Any]) -> Reply:
        """Send a chat request streamed with token ids and usage; the clock runs from sending to the first
        chunk that carries a generated token id."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        prompt: list[int] = []
        tokens: list[int] = []
        texts: list[str] = []
        finish: str | None = None
        usage: dict[str, Any] = {}
        ttft: float | None = None
        started = time.perf_counter()
        with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"chat request failed with {response.status_code}: {response.read()!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(f"the server failed mid-stream: {chunk['error']}")
                prompt += chunk.get("prompt_token_ids") or []
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    if choice.get("token_ids") and ttft is None:
                        ttft = time.perf_counter() - started
                    tokens += choice.get("token_ids") or []
                    texts.append(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
        if ttft is None or not usage:
            raise RuntimeError("the stream ended without a generated token or without usage")
        return Reply(prompt_token_ids=tuple(prompt), token_ids=tuple(tokens), text="".join(texts),
                     finish_reason=finish, prompt_tokens=usage["prompt_tokens"],
                     cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), ttft_s=ttft)

    def tokenize(self, messages: list[dict[str, Any]], generation_prompt: bool) -> tuple[int, ...]:
        """The tokens of `messages` rendered by the served chat template, as a chat request renders them."""
        reply = self.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": generation_prompt})
        reply.raise_for_status()
        return tuple(reply.json()["tokens"])

    def memory(self) -> dict[str, Any]:
        """GET /memory."""
        return self.http.get("/memory").json()

    def tiers(self) -> Tiers:
        """Per tier (`device`, `host`): the TierStats numbers /metrics serves; empty with the cache off."""
        reply = self.http.get("/metrics")
        reply.raise_for_status()
        out: Tiers = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                field = _METRIC_FIELD.get(sample.name)
                if field is not None and "tier" in sample.labels:
                    out.setdefault(sample.labels["tier"], {})[field] = sample.value
        return out

    def idle(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """/memory once nothing runs and the engine has checked its memory (integrity_when_idle set)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.memory()["now"]
            if (now["running"] == 0 and now["waiting"] == 0) or time.monotonic() > deadline:
                return now
            time.sleep(0.05)


def tier_delta(before: Tiers, after: Tiers) -> Tiers:
    """Counter steps between two scrapes, per tier; gauges (states, bytes, budget) as they are after."""
    out: Tiers = {}
    for name, numbers in after.items():
        old = before.get(name, {})
        out[name] = {field: numbers.get(field, 0) - (old.get(field, 0) if field in TIER_FIELDS[:6] else 0)
                     for field in TIER_FIELDS}
    return out
