"""Text in and out: the checkpoint's tokenizer.json and its chat template (jinja2, sandboxed)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The chat template refused the messages (it raised), or could not be rendered."""


TEMPLATES_KEPT = 16  # distinct per-request chat templates kept compiled


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTokenizer:
    """A checkpoint's tokenizer with its chat template and end tokens."""

    def __init__(self, directory: Path | str, generation: Mapping[str, Any] | None = None,
                 template: str | None = None) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint needs a tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.plain = Tokenizer.from_file(str(path))  # specials read as text: a copy, as encodes run in threads at once
        self.plain.encode_special_tokens = True
        specials = [t for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]
        self.special_ids = frozenset(self.tokenizer.token_to_id(t.content) for t in specials)
        self.special_text = re.compile("|".join(re.escape(t.content) for t in specials)) if specials else None
        config_path = directory / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.template_source = template if template is not None else self._template_source(directory)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self._env = env
        self._compiled: dict[str, jinja2.Template] = {}  # per-request templates by source, the latest few
        self.template = env.from_string(self.template_source) if self.template_source else None
        self.eos_ids = self._eos_ids(generation or {})

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, specials: bool = True) -> list[int]:
        """Token ids of text; with `specials`, special tokens written in the text are recognised (the template
        writes them), without, they are encoded as the plain text they are."""
        return (self.tokenizer if specials else self.plain).encode(text, add_special_tokens=False).ids

    def has_special_text(self, text: str) -> bool:
        """Whether `text` holds the text of a special token (which `encode` would read as that token)."""
        return self.special_text is not None and self.special_text.search(text) is not None

    def encode_holes(self, text: str, holes: Mapping[str, str]) -> list[int]:
        """Token ids of `text` with each key of `holes` (a marker standing where client text goes) replaced by its
        value: special tokens in `text` itself are recognised, those in the values stay plain text.

        `text` is split where its own special tokens stand, as `encode` splits before the pre-tokenizer; each piece
        between them, markers replaced, is encoded with specials off. With values free of special-token text the
        result is `encode` of the replaced text."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        at = 0
        for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if token in self.special_ids:
                ids += self._plain_piece(text[at:start], holes) + [token]
                at = end
        return ids + self._plain_piece(text[at:], holes)

    def _plain_piece(self, piece: str, holes: Mapping[str, str]) -> list[int]:
        """One piece between the template's special tokens, client text filled in, specials off."""
        for marker, value in holes.items():
            piece = piece.replace(marker, value)
        return self.encode(piece, specials=False) if piece else []

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens written out (what logprobs name a token by)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def compile(self, source: str) -> jinja2.Template:
        """A request's own chat template (vLLM's `chat_template` field), compiled once while it is in use; a
        template that does not compile is a TemplateError."""
        found = self._compiled.get(source)
        if found is None:
            try:
                found = self._env.from_string(source)
            except jinja2.TemplateError as err:
                raise TemplateError(f"the chat template does not compile: {err}") from err
            if len(self._compiled) >= TEMPLATES_KEPT:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[source] = found
        return found

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               template: jinja2.Template | None = None, **kwargs: Any) -> str:
        """The prompt text for a chat, as the checkpoint's template (or the request's `template`) writes it."""
        template = template or self.template
        if template is None:
            raise TemplateError("this checkpoint has no chat template; give --chat-template or use /v1/completions")
        try:
            return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=self.config.get("bos_token") or "",
                                        eos_token=self.config.get("eos_token") or "", **kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as err:
            raise TemplateError(f"the chat template failed: {err}") from err

    def _template_source(self, directory: Path) -> str | None:
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def _eos_ids(self, generation: Mapping[str, Any]) -> tuple[int, ...]:
        found = generation.get("eos_token_id")
        if found is None:
            token = self.config.get("eos_token")
            token = token.get("content") if isinstance(token, dict) else token
            found = self.tokenizer.token_to_id(token) if token else None
        if found is None:
            return ()
        return tuple(found) if isinstance(found, list) else (int(found),)
