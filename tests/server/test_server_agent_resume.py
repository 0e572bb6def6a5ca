"""A tool-using agent conversation through the openai client and through the anthropic client, rendered by Qwen3's
real chat template (`--chat-template`), on two real servers: one that keeps states and one with every tier off.
Each later turn resumes its history on the first (cached_tokens / cache_read_input_tokens > 0) and both servers
give the same replies, calls included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest

from tensorfold.testing.process import serving

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[1] / "core" / "chat" / "templates" / "Qwen-Qwen3-0.6B.jinja"
KEEP = ["--prefill-chunk", "64", "--min-chunk", "16"]
NO_TIERS = ["--prompt-cache-gib", "0", "--host-cache-gib", "0"]
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look a word up", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["word"],
    "properties": {"word": {"type": "string", "enum": ["tide", "reef", "gale"]}}}}}
SYSTEM = {"role": "system", "content": "You are a careful assistant who looks words up before answering. " * 4}


def conversation(url: str) -> list[tuple[str, int]]:
    """Three turns: a forced call, its result and an answer, then a follow-up; each turn's reply and cached tokens."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [SYSTEM, {"role": "user", "content": "What does the word tide mean, in a few words?"}]
    seen = []
    for turn in range(3):
        forced = {"type": "function", "function": {"name": "lookup"}} if turn == 0 else "auto"
        reply = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP], tool_choice=forced,
                                               max_tokens=24, temperature=0)
        message = reply.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in message.tool_calls or ()]
        seen.append((json.dumps({"content": message.content, "calls": [c["function"] for c in calls]}),
                     reply.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls or None})
        if calls:
            messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "the rise and fall of the sea"})
        else:
            messages.append({"role": "user", "content": "And the word reef?"})
    return seen


def anthropic_conversation(url: str) -> list[tuple[str, int]]:
    """The same three turns through the Messages API: a forced tool_use, its tool_result, then a follow-up."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    model = openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data[0].id
    tool = {"name": "lookup", "description": LOOKUP["function"]["description"],
            "input_schema": LOOKUP["function"]["parameters"]}
    messages: list[dict] = [{"role": "user", "content": "What does the word tide mean, in a few words?"}]
    seen = []
    for turn in range(3):
        choice = {"type": "tool", "name": "lookup"} if turn == 0 else {"type": "auto"}
        reply = client.messages.create(model=model, system=SYSTEM["content"], messages=messages, tools=[tool],
                                       tool_choice=choice, max_tokens=24, extra_body={"temperature": 0})
        blocks = [block.model_dump(exclude_none=True) for block in reply.content]
        seen.append((json.dumps([{k: v for k, v in b.items() if k != "id"} for b in blocks]),
                     reply.usage.cache_read_input_tokens or 0))
        messages.append({"role": "assistant", "content": blocks})
        uses = [b for b in blocks if b["type"] == "tool_use"]
        if uses:
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0]["id"],
                                                          "content": "the rise and fall of the sea"}]})
        else:
            messages.append({"role": "user", "content": "And the word reef?"})
    return seen


def test_an_agent_conversation_resumes_and_equals_a_cache_off_server(tmp_path):
    tiny = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "tensorfold", "make-tiny", "--family", "example", str(tiny)], check=True,
                   capture_output=True, timeout=120)
    common = [str(tiny), "--family", "example", "--chat-template", str(TEMPLATE), *KEEP]
    with serving(common, tmp_path / "kept.log") as url:
        kept, kept_messages = conversation(url), anthropic_conversation(url)
    with serving([*common, *NO_TIERS], tmp_path / "off.log") as url:
        off, off_messages = conversation(url), anthropic_conversation(url)
    assert [reply for reply, _ in kept] == [reply for reply, _ in off]
    assert json.loads(kept[0][0])["calls"][0]["name"] == "lookup"
    assert all(cached > 0 for _, cached in kept[1:]), kept
    assert all(cached == 0 for _, cached in off)
    assert [reply for reply, _ in kept_messages] == [reply for reply, _ in off_messages]
    assert json.loads(kept_messages[0][0])[-1]["type"] == "tool_use"
    assert all(cached > 0 for _, cached in kept_messages[1:]), kept_messages
    assert all(cached == 0 for _, cached in off_messages)
