"""The real server under 32 concurrent real clients: no errors, each seeded reply equal to its reply alone, and
every page back in the pool afterwards (pages poisoned with NaN the whole time)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import openai
import pytest

from tensorfold.testing.fuzz_http import idle_memory
from tensorfold.testing.process import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("load")
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", str(directory / "m")],
                   check=True, capture_output=True)
    args = ["--family", "example", "--model", str(directory / "m"), "--parallel", "8", "--page-rows", "16",
            "--context", "512", "--prefill-chunk", "64", "--min-chunk", "8"]
    with serving(args, directory / "server.log", env={"TF_KV_POISON": "1"}) as base:
        yield base


def job(i: int) -> dict:
    words = " ".join(["kept states resume"] * (1 + i % 7))
    return {"messages": [{"role": "user", "content": f"{i}: {words}"}], "max_tokens": 8 + i % 9,
            "temperature": 0.0 if i % 2 else 0.9, "seed": 1000 + i, "stream": i % 3 == 0}


async def ask(client: openai.AsyncOpenAI, body: dict) -> tuple[str, int]:
    if body["stream"]:
        text, count = "", 0
        stream = await client.chat.completions.create(model="m", extra_body={"ignore_eos": True}, **body,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return text, count
    reply = await client.chat.completions.create(model="m", extra_body={"ignore_eos": True}, **body)
    return reply.choices[0].message.content, reply.usage.completion_tokens


async def ask_all(base: str, bodies: list[dict]) -> list[tuple[str, int]]:
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(ask(client, body) for body in bodies))


def test_32_concurrent_clients_equal_their_solo_replies(server):
    bodies = [job(i) for i in range(32)]
    together = asyncio.run(ask_all(server, bodies))
    alone = [asyncio.run(ask_all(server, [body]))[0] for body in bodies]
    assert together == alone
    assert [count for _, count in together] == [body["max_tokens"] for body in bodies]
    with httpx.Client() as http:  # once nothing runs or waits (a hang guard, not a timing)
        now, plan = idle_memory(http, server), http.get(f"{server}/memory", timeout=5).json()["plan"]
    assert now["integrity_when_idle"] == "ok", now
    assert now["leases"] == 0 and now["slots_free"] == 8 and now["pages"] == plan["pages"]
    assert now["free"] + now["kept"] == now["pages"], now  # what the prompt cache keeps is all that is held
    assert now["prompt_cache_states"] >= 1
    assert plan["poison"] is True and plan["parallel"] == 8 and plan["page_rows"] == 16
