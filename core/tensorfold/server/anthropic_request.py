"""Anthropic's Messages request, translated into the OpenAI chat body `parse_chat` reads, so both APIs share one
template, one tokenization, one set of request starts and keep marks (an Anthropic chat resumes as an OpenAI one).

Anthropic's fields are checked here, by their own names; what `parse_chat` then refuses (a sampling value out of
range, the context rule, a template failure) keeps the names the two APIs share (max_tokens, temperature, top_p,
top_k) or names `messages`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tensorfold.server.errors import bad_request
from tensorfold.server.fields import json_type, read_bool, read_object, read_str

# Fields of POST /v1/messages and of /v1/messages/count_tokens; any other is refused by name.
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"})
CREATE_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
                                "metadata"}
SAMPLING = ("temperature", "top_p", "top_k")  # the same names and meaning in both APIs: passed through
ROLES = ("user", "assistant", "system")
# Each block type's keys; `cache_control` is accepted and ignored (kept states are found without marks).
BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
}
BLOCK_ROLES = {"text": ROLES, "tool_use": ("assistant",), "tool_result": ("user",), "thinking": ("assistant",),
               "redacted_thinking": ("assistant",)}
MEDIA_BLOCKS = {"image": "images", "document": "documents", "search_result": "search results",
                "container_upload": "container uploads"}
TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
CUSTOM_TOOL = "custom"
CHOICES = {"auto": {"type", "disable_parallel_tool_use"}, "any": {"type", "disable_parallel_tool_use"},
           "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
THINKING = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"},
            "disabled": {"type"}}
ERROR_PREFIX = "Error: "  # a tool_result with is_error: the template sees its text after this


def to_chat(body: Mapping[str, Any], count: bool = False) -> dict[str, Any]:
    """The OpenAI chat body for an Anthropic request (`count`: a count_tokens body, which has no max_tokens)."""
    allowed = COUNT_FIELDS if count else CREATE_FIELDS
    for name in body:
        if name not in allowed:
            raise bad_request(f"'{name}': this field is not supported by this server"
                              + (" on count_tokens" if count and name in CREATE_FIELDS else ""), name)
    model = read_str(body, "model")
    if model is None:
        raise bad_request("'model' is required", "model")
    chat: dict[str, Any] = {"model": model}
    if not count:
        if body.get("max_tokens") is None:
            raise bad_request("'max_tokens' is required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
        chat.update({name: body[name] for name in SAMPLING if name in body})
        chat["stream"] = read_bool(body, "stream")
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise bad_request("'stop_sequences' must be an array of strings", "stop_sequences")
            chat["stop"] = stops
        read_object(body, "metadata")  # accepted (user_id, ...) and not used
    read_object(body, "cache_control")
    chat["messages"] = [*system_messages(body.get("system")), *chat_messages(body.get("messages"))]
    if chat["messages"][-1]["role"] == "assistant":  # prefill: the reply continues the final assistant text
        if not chat["messages"][-1]["content"]:
            raise bad_request("'messages': the final assistant message (a prefill the reply continues) needs text",
                              "messages")
        chat.update(add_generation_prompt=False, continue_final_message=True)
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat.update(chat_tool_choice(body["tool_choice"]))
    if body.get("thinking") is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking_on(body["thinking"], body.get("max_tokens"))}
    return chat


def system_messages(system: Any) -> list[dict[str, Any]]:
    """`system`: a string or an array of text blocks, as one system message (none when absent or empty)."""
    if system is None:
        return []
    text = system if isinstance(system, str) else block_text(system, "system", "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(value: Any) -> list[dict[str, Any]]:
    """`messages` as OpenAI messages; consecutive turns of one role are one turn, as Anthropic combines them."""
    if value is None:
        raise bad_request("'messages' is required", "messages")
    if not isinstance(value, list):
        raise bad_request(f"'messages' must be an array of messages, not {json_type(value)}", "messages")
    if not value:
        raise bad_request("'messages' must hold at least one message", "messages")
    turns: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = []
    for i, message in enumerate(value):
        role, blocks = read_turn(message, f"messages[{i}]")
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages that answer them
    out: list[dict[str, Any]] = []
    for role, blocks in turns:
        if role == "assistant":
            out.append(assistant_message(blocks, names))
        elif role == "user":
            out.extend(user_messages(blocks, names))
        else:
            out.append({"role": "system", "content": "\n".join(b["text"] for _, b in blocks)})
    return out


def read_turn(message: Any, where: str) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """One message's role and its content as checked blocks, each with where it was."""
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content', not {json_type(message)}", where)
    for key in message:
        if key not in ("role", "content"):
            raise bad_request(f"'{where}.{key}': this field is not supported by this server", f"{where}.{key}")
    role = message.get("role")
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return role, [(f"{where}.content", {"type": "text", "text": content})]
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content blocks, not "
                          f"{json_type(content)}", f"{where}.content")
    return role, [(f"{where}.content[{j}]", read_block(block, f"{where}.content[{j}]", role))
                  for j, block in enumerate(content)]


def read_block(block: Any, where: str, role: str) -> dict[str, Any]:
    """A content block of a kind this server reads, in a role that may hold it, with its fields' types checked."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in MEDIA_BLOCKS:
        raise bad_request(f"'{where}': {MEDIA_BLOCKS[kind]} are not supported by this server", where)
    if kind not in BLOCK_KEYS:
        raise bad_request(f"'{where}' must be a content block of type {', '.join(BLOCK_KEYS)}; got "
                          f"{kind if kind is not None else json_type(block)!r}", where)
    if role not in BLOCK_ROLES[kind]:
        raise bad_request(f"'{where}': a {kind} block belongs in a {' or '.join(BLOCK_ROLES[kind])} message, not a "
                          f"{role} one", where)
    for key in block:
        if key not in BLOCK_KEYS[kind]:
            raise bad_request(f"'{where}.{key}': this field is not supported by this server", f"{where}.{key}")
    strings = {"text": ("text",), "tool_use": ("id", "name"), "tool_result": ("tool_use_id",),
               "thinking": ("thinking",), "redacted_thinking": ("data",)}[kind]
    for key in strings:
        if not isinstance(block.get(key), str):
            raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
    if kind == "text" and block.get("citations"):
        raise bad_request(f"'{where}.citations': citations are not supported by this server", f"{where}.citations")
    if kind == "tool_use" and not isinstance(block.get("input"), dict):
        raise bad_request(f"'{where}.input' must be an object", f"{where}.input")
    if kind == "tool_result":
        read_bool(block, "is_error")
    return block


def block_text(blocks: Any, where: str, role: str) -> str:
    """The text of an array of text blocks (system, a tool result), joined by newlines."""
    if not isinstance(blocks, list):
        raise bad_request(f"'{where}' must be a string or an array of text blocks, not {json_type(blocks)}", where)
    texts = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            read_block(block, at, role)  # names an image or document as such
            raise bad_request(f"'{at}' must be a text block", at)
        texts.append(read_block(block, at, role)["text"])
    return "\n".join(texts)


def user_messages(blocks: list[tuple[str, dict[str, Any]]], names: Mapping[str, str]) -> list[dict[str, Any]]:
    """A user turn: each tool_result a `tool` message, the text between them a user message (in their order)."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for where, block in blocks:
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        content = block.get("content", "")
        text = content if isinstance(content, str) else block_text(content, f"{where}.content", "user")
        if block.get("is_error"):
            text = ERROR_PREFIX + text
        message = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}
        if block["tool_use_id"] in names:
            message["name"] = names[block["tool_use_id"]]
        out.append(message)
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def assistant_message(blocks: list[tuple[str, dict[str, Any]]], names: dict[str, str]) -> dict[str, Any]:
    """An assistant turn: its text as content, its thinking as reasoning_content, its tool_use blocks as
    tool_calls (arguments as JSON text, as OpenAI sends them); redacted thinking is dropped."""
    texts = [b["text"] for _, b in blocks if b["type"] == "text"]
    thoughts = [b["thinking"] for _, b in blocks if b["type"] == "thinking"]
    calls = []
    for _, block in blocks:
        if block["type"] == "tool_use":
            names[block["id"]] = block["name"]
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"],
                                       "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` (client tools: name, description, input_schema) as OpenAI function tools; server tools refused."""
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be an array of tools, not {json_type(tools)}", "tools")
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{at}' must be an object, not {json_type(tool)}", at)
        kind = tool.get("type", CUSTOM_TOOL)
        if kind not in (CUSTOM_TOOL, None):
            raise bad_request(f"'{at}.type': server tools ({kind!r}) are not supported by this server; give "
                              "client tools (name, description, input_schema)", f"{at}.type")
        for key in tool:
            if key not in TOOL_KEYS:
                raise bad_request(f"'{at}.{key}': this field is not supported by this server", f"{at}.{key}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{at}.name' must be a non-empty string", f"{at}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"'{at}.input_schema' is required: a JSON schema object", f"{at}.input_schema")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad_request(f"'{at}.description' must be a string", f"{at}.description")
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> dict[str, Any]:
    """`tool_choice` as OpenAI's: auto → auto, any → required, tool → the named function, none → none;
    disable_parallel_tool_use → parallel_tool_calls: false."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in CHOICES:
        raise bad_request("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                          "tool_choice")
    for key in choice:
        if key not in CHOICES[kind]:
            raise bad_request(f"'tool_choice.{key}': not a field of a {kind!r} tool choice", f"tool_choice.{key}")
    out: dict[str, Any] = {}
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("'tool_choice.name' must name one of 'tools'", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if read_bool(choice, "disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def thinking_on(thinking: Any, max_tokens: Any) -> bool:
    """`thinking`: enabled (with a budget) or adaptive turn the template's enable_thinking on, disabled off. The
    budget is checked, not enforced apart: thinking counts toward max_tokens, as with Anthropic."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in THINKING:
        raise bad_request("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": "
                          "\"adaptive\"} or {\"type\": \"disabled\"}", "thinking")
    for key in thinking:
        if key not in THINKING[kind]:
            raise bad_request(f"'thinking.{key}': not a field of {kind!r} thinking", f"thinking.{key}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise bad_request("'thinking.budget_tokens' must be a positive integer", "thinking.budget_tokens")
        if isinstance(max_tokens, int) and budget >= max_tokens:
            raise bad_request(f"'thinking.budget_tokens' ({budget}) must be less than max_tokens ({max_tokens})",
                              "thinking.budget_tokens")
    if thinking.get("display") not in (None, "summarized"):
        raise bad_request("'thinking.display': only 'summarized' (the thinking as written) is supported",
                          "thinking.display")
    return kind != "disabled"
