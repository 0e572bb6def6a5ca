"""Request starts: the token positions in a rendered chat prompt where each message begins, and where the turn
being generated begins, so prefill can cut there (cuts.py) and a later turn can resume at them.

A template renders the last message of a chat as the *current* turn (Qwen3.5 adds an empty think block,
Nemotron-v2 opens it as the generation turn, GLM-4.7 keeps its reasoning) and may refuse a prefix outright (Qwen3.5:
"No user query found" for a system-only prefix), so a prefix rendered on its own is not how it reads inside the
whole prompt. Each prefix is therefore rendered *followed by a probe*: a message of the role that really comes next
(user, assistant, tool; an assistant for the generated turn) with a fixed unusual text, and, where a user message
comes later in the chat (but not at i), a user probe after it, so the template treats the prefix as the same kind
of history as in the prompt (turns before the latest user message lose their reasoning):

    tail of probes P       = render([u, *P])[len(render([u])):]      learned once per template and kwargs
    start of messages[i]   = len(render(messages[:i] + P)) - len(tail of P),   P = [probe of messages[i]'s role]
                                                                               (+ [user probe]; then without it)
    start of the reply     = the same with an assistant probe after all the messages

(u: a one-line user message, which every template renders as history). Where the probes' render does not end
with their tail, or the template refuses them, the prefix rendered on its own is tried, as before.

A text start is kept only when it is proven against the prompt's tokens: the prompt's text starts with the rendered
history, and the history's tokens are the prompt's tokens up to a position. The prompt is tokenized once (by the
request); the proof encodes only the text since the last special token before the start, which is exact because a
tokenizer encodes the text between special tokens independently (Prover). A template
that renders a prefix differently (drops reasoning, moves a system note) or a merge across the boundary skips that
start. A skipped start costs a cut; a wrong one would never be taken. The position right after the final assistant
header is the prompt's end, which every pass cuts at anyway. (A prompt whose ids are not a plain encode of its text,
special-token text kept as text, is proven the old way: each prefix encoded as the prompt was.)

With a StartCache (chat/start_cache.py, held by the Service), the starts proven for a conversation are remembered
by a hash chain of its messages and a hash of the rendered text they cover, so a next turn renders and proves only
the messages that are new; the per-turn work beyond rendering and tokenizing the prompt once is linear in them. A
long chat seen cold (its first request, or after a restart) still renders once per message: its starts, and so its
cuts, must be the prompt's own whatever the cache holds, or a resumed reply could differ from a fresh one.

Three of them are where states are worth keeping (engine/api.py KeepMarks), so the engine learns them by position
and no more of the chat: the generated turn's start (the history end, where the next turn resumes), the first
non-system message's start (the shared system prompt's end) and the latest user message's start (the rewind mark).
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tensorfold.chat.start_cache import Entry, StartCache, chain, text_hash
from tensorfold.engine.api import KeepMarks
from tensorfold.server.errors import ApiError
from tensorfold.server.prompts import chat_ids
from tensorfold.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)
SYSTEM_ROLES = {"system", "developer"}
PROBE_TEXT = "\u00a4probe\u00a4"  # an unusual line no template rewrites; its first character starts a pre-token
CALIBRATION_USER = {"role": "user", "content": "Hi"}
PROVE_AT_MOST: int | None = None  # starts proven from scratch per request (None: all). A cap would make the
# starts, and so the cuts, depend on what the cache held, not on the prompt alone: a resumed reply could then differ
# from a cache-off server's fresh one (cuts.py)
CACHE_TRIES = 4  # cached conversation prefixes tried, longest first, before proving from scratch


def message_starts(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                   kwargs: Mapping[str, Any], prompt_text: str | None = None,
                   specials_in_content: bool = True, cache: StartCache | None = None) -> tuple[int, ...]:
    """Positions in `prompt` (the tokens of `messages` rendered with the generation prompt) where a message, or
    the generated turn, starts; sorted, each inside (0, len(prompt)), only the ones proven by an exact prefix.
    `prompt_text` is the rendered prompt (rendered here when None). Prefixes are proven as the prompt was encoded
    (`specials_in_content`, server/prompts.py)."""
    return starts_of(start_positions(tokenizer, messages, prompt, kwargs, prompt_text, specials_in_content, cache))


def starts_of(positions: Mapping[int, int]) -> tuple[int, ...]:
    """The sorted distinct starts of `start_positions`."""
    return tuple(sorted(set(positions.values())))


def probe(role: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": role, "content": PROBE_TEXT}
    if role == "tool":
        message.update(tool_call_id="probe", name="probe")
    return message


def render_or_none(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]],
                   kwargs: Mapping[str, Any]) -> str | None:
    try:
        return tokenizer.render(messages, add_generation_prompt=False, **kwargs)
    except Exception as err:  # a template may refuse a prefix (e.g. one that must end with a user turn)
        log.debug("the template refused a prefix of %d messages: %s", len(messages), err)
        return None


def probe_tail(tokenizer: ChatTokenizer, roles: tuple[str, ...], kwargs: Mapping[str, Any],
               learned: dict[tuple[str, ...], str | None]) -> str | None:
    """What probes of `roles` add after a history (headers, text and footers), learned after a one-line user
    message; None where the template refuses them or does not render that message the same on its own."""
    if roles not in learned:
        alone = render_or_none(tokenizer, [CALIBRATION_USER], kwargs)
        probed = render_or_none(tokenizer, [CALIBRATION_USER, *map(probe, roles)], kwargs)
        ok = alone is not None and probed is not None and probed.startswith(alone) and PROBE_TEXT in probed[len(alone):]
        learned[roles] = probed[len(alone):] if ok else None  # type: ignore[index]
    return learned[roles]


class Prover:
    """Proves text starts against a prompt's tokens without encoding the prompt again: `at(k)` is the token
    position where the prompt's first k characters end, when their tokens are exactly the prompt's tokens up to
    it. A tokenizer encodes the text between special tokens independently, so with the prompt's special tokens
    matched to their places in the text (`plain`: one for one, the same ids), the tokens of text[:k] are the
    prompt's tokens up to the last special token before k, then those of the text from there to k."""

    def __init__(self, tokenizer: ChatTokenizer, prompt: Sequence[int], prompt_text: str, plain: bool) -> None:
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.text = prompt_text
        specials = tokenizer.special_ids
        self.anchors = [i for i, t in enumerate(self.prompt) if t in specials]
        found = list(tokenizer.special_text.finditer(prompt_text)) if tokenizer.special_text is not None else []
        self.spans = [(m.start(), m.end()) for m in found]
        self.ends = [end for _, end in self.spans]
        self.plain = plain and len(found) == len(self.anchors) and all(
            tokenizer.tokenizer.token_to_id(m.group()) == self.prompt[i] for m, i in zip(found, self.anchors,
                                                                                         strict=True))

    def at(self, k: int) -> int | None:
        j = bisect.bisect_right(self.ends, k) - 1  # the last special token ending by k
        if j + 1 < len(self.spans) and self.spans[j + 1][0] < k:
            return None  # k falls inside a special token
        first, w = (self.anchors[j] + 1, self.ends[j]) if j >= 0 else (0, 0)
        piece = self.text[w:k]
        ids = self.tokenizer.encode(piece, specials=False) if piece else []
        at = first + len(ids)
        if not 0 < at < len(self.prompt) or self.prompt[first:at] != ids:
            return None
        return at


def find_start(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], i: int, prover: Prover,
               kwargs: Mapping[str, Any], learned: dict[tuple[str, ...], str | None],
               last_user: int) -> tuple[int, int] | None:
    """(char offset, token position) where messages[i] (i == len(messages): the generated turn) starts. The probe
    has the role of messages[i]; where a user message comes later in the chat but not at i, a user probe follows
    it, since templates render the turns before the latest user message as older history (reasoning dropped)."""
    role = str(messages[i].get("role")) if i < len(messages) else "assistant"
    shapes = [(role, "user"), (role,)] if last_user > i and role != "user" else [(role,)]
    for roles in shapes:
        tail = probe_tail(tokenizer, roles, kwargs, learned)
        if tail is None:
            continue
        text = render_or_none(tokenizer, [*messages[:i], *map(probe, roles)], kwargs)
        if text is None or not text.endswith(tail):
            continue
        k = len(text) - len(tail)
        at = prover.at(k) if prover.text.startswith(text[:k]) else None
        if at is not None:
            return k, at
    text = render_or_none(tokenizer, messages[:i], kwargs)  # the prefix on its own, as before probes
    if text is not None and prover.text.startswith(text):
        at = prover.at(len(text))
        if at is not None:
            return len(text), at
    return None


def template_key(tokenizer: ChatTokenizer, kwargs: Mapping[str, Any], specials_in_content: bool) -> tuple[Any, ...]:
    rest = {k: v for k, v in kwargs.items() if k != "template"}
    return (id(tokenizer), kwargs.get("template"), specials_in_content,
            json.dumps(rest, sort_keys=True, ensure_ascii=False, default=repr))


def start_positions(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                    kwargs: Mapping[str, Any], prompt_text: str | None = None,
                    specials_in_content: bool = True, cache: StartCache | None = None,
                    budget: int | None = PROVE_AT_MOST) -> dict[int, int]:
    """Message index → its proven start (index len(messages): the generated turn), for 1 ≤ index ≤ n; at most
    `budget` of them not found in the cache are proven (each renders the chat up to there)."""
    if prompt_text is None:
        prompt_text = tokenizer.render(messages, add_generation_prompt=True, **kwargs)
    plain = specials_in_content or not any(isinstance(m.get("content"), str)
                                           and tokenizer.has_special_text(m["content"]) for m in messages)
    prover = Prover(tokenizer, prompt, prompt_text, plain)
    if not prover.plain:
        return direct_positions(tokenizer, messages, prompt, kwargs, prompt_text, specials_in_content)
    key = template_key(tokenizer, kwargs, specials_in_content)
    learned = cache.tails(key) if cache is not None else {}
    seed = repr((key[0], id(key[1]) if key[1] is not None else None, *key[2:])).encode()
    hashes = chain(seed, messages) if cache is not None else []
    found: dict[int, tuple[int, int]] = {}
    first = 1
    if cache is not None:
        tries = 0
        for i in range(len(messages), 0, -1):
            entry = cache.get(hashes[i])
            if entry is None:
                continue
            tries += 1
            if reusable(entry, prover):
                found, first = dict(entry.starts), i
                break
            if tries >= CACHE_TRIES:
                break
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for i in to_prove(messages, first, last_user, budget):
        start = find_start(tokenizer, messages, i, prover, kwargs, learned, last_user)
        if start is not None:
            found[i] = start
    if cache is not None and len(messages) > first:
        remember(cache, hashes[len(messages)], {i: s for i, s in found.items() if i < len(messages)}, prompt_text)
    return {i: at for i, (_, at) in found.items()}


def to_prove(messages: Sequence[Mapping[str, Any]], first: int, last_user: int, budget: int | None) -> list[int]:
    """The indexes from `first` to n to prove, at most `budget`: the kept marks' first (the reply's turn, the
    latest user message, the first non-system message), then the newest."""
    n = len(messages)
    system_end = next((i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), 0)
    order = [n, last_user, system_end, *range(n - 1, first - 1, -1)]
    chosen = list(dict.fromkeys(i for i in order if first <= i <= n and i >= 1))[:budget]
    return sorted(chosen)


def reusable(entry: Entry, prover: Prover) -> bool:
    """Whether a cached entry's starts hold in this prompt: the same text up to its last start, and the prompt's
    tokens break there as they did (then every earlier start's tokens are the same too)."""
    if not entry.starts:
        return True
    if len(prover.text) <= entry.end or text_hash(prover.text[:entry.end]) != entry.text_hash:
        return False
    last = max(entry.starts.values())
    return prover.at(entry.end) == last[1]


def remember(cache: StartCache, key: bytes, found: Mapping[int, tuple[int, int]], prompt_text: str) -> None:
    """Keep the starts of messages 1..n-1 for the whole chat messages[:n] (the start after it waits for the role of
    the message that comes next)."""
    starts = dict(found)
    end = max((k for k, _ in starts.values()), default=0)
    cache.put(key, Entry(starts, end, text_hash(prompt_text[:end])))


def direct_positions(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], prompt: Sequence[int],
                     kwargs: Mapping[str, Any], prompt_text: str,
                     specials_in_content: bool) -> dict[int, int]:
    """Each prefix rendered on its own and encoded as the prompt was: for prompts whose ids are not a plain encode
    of their text (special-token text in content kept as text)."""
    found: dict[int, int] = {}
    for i in range(1, len(messages) + 1):
        text = render_or_none(tokenizer, messages[:i], kwargs)
        if text is None or not prompt_text.startswith(text):
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
