"""A chat's prompt ids: the template's text encoded, where special-token text typed by the client in message content
can be kept as plain text (--no-special-tokens-in-content) while the template's own special tokens stay special.

With specials kept as text, each message whose content holds special-token text is rendered with a marker in place
of its content; the template's text is split where its own special tokens stand, as the tokenizer splits before its
pre-tokenizer, and each piece between them is encoded with specials off once the markers are filled back in
(tokenizer.py encode_holes). Content free of special-token text needs none of this: the ids equal a plain encode
of the rendered text. A template that changes content on its way into the prompt (trims it, splits it) leaves no
place to fill, and such a request is refused rather than encoded with the client's special tokens.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfold.server.errors import bad_request
from tensorfold.server.messages import render
from tensorfold.tokenizer import ChatTokenizer


def chat_ids(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], text: str,
             add_generation_prompt: bool, kwargs: Mapping[str, Any], specials_in_content: bool) -> list[int]:
    """The ids of `text` (`messages` rendered with these arguments); without `specials_in_content`, special-token
    text in message content is encoded as text, and in any other string of the chat it is a 400 naming it."""
    if specials_in_content:
        return tokenizer.encode(text)
    check_outside_content(tokenizer, messages, kwargs)
    typed = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)
             and tokenizer.has_special_text(m["content"])]
    if not typed:
        return tokenizer.encode(text)
    nonce = secrets.token_hex(8)
    holes = {f"\ue000{nonce}:{i}\ue001": messages[i]["content"] for i in typed}
    marked = list(messages)
    for marker, i in zip(holes, typed, strict=True):
        marked[i] = {**messages[i], "content": marker}
    template_text = render(tokenizer, marked, add_generation_prompt, kwargs)
    filled = template_text
    for marker, value in holes.items():
        filled = filled.replace(marker, value)
    if filled != text:
        where = f"messages[{typed[0]}].content"
        raise bad_request(f"'{where}' holds special-token text, which this server keeps as text, but the chat "
                          "template changes message content as it writes it, so there is no place to keep it; "
                          "remove the special-token text", where)
    return tokenizer.encode_holes(template_text, holes)


def check_outside_content(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]],
                          kwargs: Mapping[str, Any]) -> None:
    """Special-token text in a chat string other than message content (a role, a name, reasoning, a template
    variable) has no plain-text place in the template: refuse it by name."""
    queue: deque[tuple[str, Any]] = deque((f"chat_template_kwargs.{k}", v) for k, v in kwargs.items())
    for i, message in enumerate(messages):
        queue.extend((f"messages[{i}].{k}", v) for k, v in message.items() if k != "content")
    while queue:
        where, value = queue.popleft()
        if isinstance(value, str):
            if tokenizer.has_special_text(value):
                raise bad_request(f"'{where}' holds special-token text; this server takes special tokens as text "
                                  "only in message content", where)
        elif isinstance(value, dict):
            queue.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            queue.extend((f"{where}[{j}]", v) for j, v in enumerate(value))
