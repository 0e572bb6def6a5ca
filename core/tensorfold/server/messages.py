"""Chat messages as the template expects them: text content only, refused by name when it is not text."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfold.server.errors import bad_request
from tensorfold.server.fields import json_type

IMAGE_PARTS = {"image_url", "input_image", "image"}
AUDIO_PARTS = {"input_audio", "audio"}
TEXT_PARTS = {"text", "input_text"}
RESERVED_TEMPLATE_KWARGS = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "template"}


def read_messages(body: Mapping[str, Any], name: str = "messages") -> list[dict[str, Any]]:
    """The `messages` array, each message's content flattened to a string (None kept for assistants)."""
    value = body.get(name)
    if value is None:
        raise bad_request(f"'{name}' is required", name)
    if not isinstance(value, list):
        raise bad_request(f"'{name}' must be an array of messages, not {json_type(value)}", name)
    if not value:
        raise bad_request(f"'{name}' must hold at least one message", name)
    return [read_message(message, f"{name}[{i}]") for i, message in enumerate(value)]


def read_message(message: Any, where: str) -> dict[str, Any]:
    """One message: a role string and text content; other keys pass through to the template."""
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object with 'role' and 'content', not {json_type(message)}", where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise bad_request(f"'{where}.role' must be a non-empty string", f"{where}.role")
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise bad_request(f"'{where}.content' is required for a {role} message", f"{where}.content")
        flat = None
    else:
        flat = flatten_content(content, f"{where}.content")
    return {**message, "role": role, "content": flat}


def flatten_content(content: Any, where: str) -> str:
    """A string, or a list of text parts joined with newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts, not {json_type(content)}",
                          where)
    texts = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS:
            raise bad_request("images are not supported by this server", at)
        if kind in AUDIO_PARTS:
            raise bad_request("audio is not supported by this server", at)
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"'{at}' must be a text part {{\"type\": \"text\", \"text\": ...}}; "
                              f"got type {kind!r}", at)
        texts.append(part["text"])
    return "\n".join(texts)


def read_template_kwargs(body: Mapping[str, Any], name: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra variables for the chat template (e.g. enable_thinking); the template's own names are refused."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, not {json_type(value)}", name)
    clash = sorted(RESERVED_TEMPLATE_KWARGS & value.keys())
    if clash:
        raise bad_request(f"'{name}' may not set {', '.join(clash)}: the server sets them (from 'tools' and "
                          "'chat_template')", name)
    return dict(value)


def continued(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """The rendered chat cut right after the final message's content (continue_final_message), as HF's
    apply_chat_template cuts it: the reply goes on from that text, with no end of turn in between."""
    final = messages[-1] if messages else {}
    content = final.get("content")
    if final.get("role") != "assistant" or not isinstance(content, str) or not content.strip():
        raise bad_request("'continue_final_message' needs a final assistant message with text to continue",
                          "continue_final_message")
    for piece in (content, content.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise bad_request("'continue_final_message': the chat template does not write the final message's text as "
                      "given, so there is no place to continue it", "continue_final_message")


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
           kwargs: Mapping[str, Any]) -> str:
    """The prompt text; a template that refuses or fails on these messages is the client's 400, not a 500."""
    try:
        return tokenizer.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except ValueError as err:  # TemplateError: raise_exception() in the template, or a jinja error
        raise bad_request(str(err), "messages") from err
    except Exception as err:  # a template that trips over unexpected input (None + str, ...)
        raise bad_request(f"the chat template failed on these messages: {type(err).__name__}: {err}",
                          "messages") from err


ROLES = ("system", "developer", "user", "assistant", "tool")


def for_template(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: known roles only (400 otherwise), `developer` as `system` where the
    template has no such role, null content as "", and assistant tool calls' string `arguments` (OpenAI's wire
    format) parsed into objects, which templates iterate."""
    developer = template is not None and "developer" in template
    out = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in ROLES:
            raise bad_request(f"'messages[{i}].role' must be one of {', '.join(ROLES)}; got {role!r}",
                              f"messages[{i}].role")
        fixed = {**message, "content": message["content"] if message["content"] is not None else ""}
        if role == "developer" and not developer:
            fixed["role"] = "system"
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise bad_request(f"'messages[{i}].tool_calls' is only for assistant messages",
                                  f"messages[{i}].tool_calls")
            fixed["tool_calls"] = read_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
        out.append(fixed)
    return out


def read_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool_calls, each {"id", "type": "function", "function": {"name", "arguments"}} with its
    arguments as an object (a JSON string is parsed; one that is not JSON is a 400)."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}' must be an array of tool calls, not {json_type(calls)}", where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"'{at}' must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              f"\"arguments\": ...}}}}", at)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as err:
                raise bad_request(f"'{at}.function.arguments' is not valid JSON: {err}",
                                  f"{at}.function.arguments") from err
        if not isinstance(arguments, dict):
            raise bad_request(f"'{at}.function.arguments' must be a JSON object (or its text), not "
                              f"{json_type(arguments)}", f"{at}.function.arguments")
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out
