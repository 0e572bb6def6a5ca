"""Per-token logprobs as OpenAI's clients read them: chat's `logprobs.content` entries, completions' four arrays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# one token's logprob record as the engine sends it: (token id, logprob, ((id, logprob) of the most likely, ...));
# a prompt's first token has no logprob (None)
Entry = tuple[int, float | None, tuple[tuple[int, float], ...]]
TokenText = Callable[[int], str]


def chat_logprobs(entries: Sequence[Entry], text: TokenText) -> dict[str, Any]:
    """Chat's `choice.logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {"content": [_chat_entry(token, logprob, top, text) for token, logprob, top in entries]}


def _chat_entry(token: int, logprob: float, top: Sequence[tuple[int, float]], text: TokenText) -> dict[str, Any]:
    return {**_named(text(token), logprob), "top_logprobs": [_named(text(t), lp) for t, lp in top]}


def _named(piece: str, logprob: float) -> dict[str, Any]:
    """A token as chat logprobs name it: its text, its logprob and its UTF-8 bytes."""
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


def text_logprobs(entries: Sequence[Entry], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """Completions' `choice.logprobs`: tokens, token_logprobs, top_logprobs (a {token: logprob} map each) and
    text_offset (each token's first character in the completion, counted from `offset`)."""
    tokens, offsets = [], []
    for token, _, _ in entries:
        piece = text(token)
        offsets.append(offset)
        tokens.append(piece)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": [logprob for _, logprob, _ in entries],
            "top_logprobs": [None if logprob is None else {text(t): lp for t, lp in top}
                             for _, logprob, top in entries],
            "text_offset": offsets}


def prompt_logprobs(entries: Sequence[Entry], text: TokenText) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then for each token a map from token id (a string, as
    JSON keys are) to {logprob, rank, decoded_token}, holding the prompt's token and the most likely ones (rank 1
    first; the prompt token's rank is known only when it is among them, else null)."""
    out: list[dict[str, Any] | None] = []
    for token, logprob, top in entries:
        if logprob is None:
            out.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(top, start=1)}
        found = {str(token): {"logprob": logprob, "rank": ranks.get(token), "decoded_token": text(token)}}
        for t, lp in top:
            found.setdefault(str(t), {"logprob": lp, "rank": ranks[t], "decoded_token": text(t)})
        out.append(found)
    return out
