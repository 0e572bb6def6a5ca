"""Kept states through `tensorfold serve --tp 2` (real processes, the openai client, each family's tiny hybrid
checkpoint: qwen's Gated DeltaNet and GLM's KDA fixed states split by head and GLM's MLA latent replicated,
Nemotron-H's Mamba2 states, attention pages): a chat's second turn resumes from the state rank 0
kept at the first turn's history end (usage cached_tokens > 0), from the device tier, or from the host tier alone
(`--prompt-cache-gib 0`), and every turn's greedy tokens equal those of a `--tp 1` server with every tier off (the
first turn, a fresh prefill, is thus each family's TP=2 == TP=1 check through a real server). Slow: each server
starts its ranks, each of which imports torch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from test_server_tp import client_of, servers_of

from tensorfold.plugins import load_families

FLAGS = ("--context", "256", "--parallel", "2", "--prefill-chunk", "32", "--min-chunk", "8")
SERVERS = {"off": ("--tp", "1", "--prompt-cache-gib", "0", "--host-cache-gib", "0"),
           "device": ("--tp", "2", "--prompt-cache-gib", "0.01", "--host-cache-gib", "0.01"),
           "host": ("--tp", "2", "--prompt-cache-gib", "0", "--host-cache-gib", "0.01")}
TURNS = ("Name three rivers of France.", "And three of Spain?")


@pytest.fixture(scope="module", params=["qwen", "glm", "nemotron"])
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple]]:
    family = request.param
    root = tmp_path_factory.mktemp(f"tp-kept-{family}")
    model = root / "tiny"
    model.mkdir()
    load_families([family])[family].make_tiny(model, seed=0)
    with servers_of(model, root, SERVERS, family) as started:
        yield started


def chat(client: openai.OpenAI) -> list[tuple[list[int], int]]:
    """Two turns of one chat: each turn's greedy token ids and its cached prompt tokens."""
    messages: list[dict] = [{"role": "system", "content": "You answer briefly."}]
    out = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        choice = reply.choices[0]
        details = reply.usage.prompt_tokens_details
        out.append((choice.model_extra["token_ids"], details.cached_tokens if details is not None else 0))
        messages.append({"role": "assistant", "content": choice.message.content})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name, tier", [("device", "device"), ("host", "host")])
def test_a_second_turn_at_tp2_resumes_and_equals_tp1_without_kept_states(servers, name, tier):
    plain = chat(client_of(servers["off"][1]))
    assert [cached for _, cached in plain] == [0, 0] and all(len(ids) == 10 for ids, _ in plain)
    kept = chat(client_of(servers[name][1]))
    assert [ids for ids, _ in kept] == [ids for ids, _ in plain]
    assert kept[0][1] == 0 and kept[1][1] > 0
    memory = httpx.get(f"{servers[name][1]}/memory", timeout=10).json()
    assert memory["now"]["tiers"][tier]["hits"] == 1 and memory["plan"]["tensor_parallel"] == 2
    assert memory["now"]["integrity_when_idle"] == "ok"
    log = Path(servers[name][2]).read_text()
    assert f"from {tier}" in log and "Traceback" not in log
