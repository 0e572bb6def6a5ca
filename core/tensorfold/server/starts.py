"""Request starts: the token positions in a rendered chat prompt where each message begins, and where the turn
being generated begins, so prefill can cut there (cuts.py) and a later turn can resume at them.

Found by rendering the conversation prefix by prefix rather than by parsing the template's output:

    start of messages[i]      = len(tokens(render(messages[:i], add_generation_prompt=False)))   1 ≤ i < n
    start of the reply's turn = len(tokens(render(messages, add_generation_prompt=False)))

A position is kept only when the prefix's tokens are an exact prefix of the full prompt's tokens; a template that
renders a prefix differently (drops reasoning, moves a system note) or a merge across the boundary skips that
start. A skipped start costs a cut; a wrong one would never be taken. The position right after the final
assistant header is the prompt's end, which every pass cuts at anyway.

Three of them are where states are worth keeping (engine/api.py KeepMarks), so the engine learns them by position
and no more of the chat: the generated turn's start (the history end, where the next turn resumes), the first
non-system message's start (the shared system prompt's end) and the latest user message's start (the rewind mark).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfold.engine.api import KeepMarks
from tensorfold.server.errors import ApiError
from tensorfold.server.prompts import chat_ids
from tensorfold.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
SYSTEM_ROLES = {"system", "developer"}


def message_starts(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                   kwargs: Mapping[str, Any], prompt_text: str | None = None,
                   specials_in_content: bool = True) -> tuple[int, ...]:
    """Positions in `prompt` (the tokens of `messages` rendered with the generation prompt) where a message, or
    the generated turn, starts; sorted, each inside (0, len(prompt)), only the ones proven by an exact prefix.
    With `prompt_text` (the rendered prompt), a prefix whose text is not a prefix of it is skipped untokenized.
    Prefixes are encoded as the prompt was (`specials_in_content`, server/prompts.py)."""
    return starts_of(start_positions(tokenizer, messages, prompt, kwargs, prompt_text, specials_in_content))


def starts_of(positions: Mapping[int, int]) -> tuple[int, ...]:
    """The sorted distinct starts of `start_positions`."""
    return tuple(sorted(set(positions.values())))


def start_positions(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                    kwargs: Mapping[str, Any], prompt_text: str | None = None,
                    specials_in_content: bool = True) -> dict[int, int]:
    """Message index → its proven start (index len(messages): the generated turn), for 1 ≤ index ≤ n."""
    found: dict[int, int] = {}
    for i in range(1, len(messages) + 1):
        try:
            text = tokenizer.render(messages[:i], add_generation_prompt=False, **kwargs)
        except Exception as err:  # a template may refuse a prefix (e.g. one that must end with a user turn)
            log.debug("no start after message %d: the template refused the prefix: %s", i, err)
            continue
        if prompt_text is not None and not prompt_text.startswith(text):
            continue
        try:
            ids = chat_ids(tokenizer, messages[:i], text, False, kwargs, specials_in_content)
        except ApiError as err:  # special-token text the template gives no place in this prefix
            log.debug("no start after message %d: %s", i, err.message)
            continue
        at = len(ids)
        if 0 < at < len(prompt) and tuple(prompt[:at]) == tuple(ids):
            found[i] = at
    return found


def keep_marks(messages: Sequence[Mapping[str, Any]], positions: Mapping[int, int]) -> KeepMarks:
    """Where the history ends, the system prompt ends and the latest user message starts, from proven starts only
    (an unproven one stays None: the history end then defaults to the prompt end)."""
    first = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), None)
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    return KeepMarks(history=positions.get(len(messages)),
                     system=positions.get(first) if first else None,
                     rewind=positions.get(last_user) if last_user else None)
