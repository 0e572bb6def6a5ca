"""Text in and out: the checkpoint's tokenizer.json and its chat template (jinja2, sandboxed)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The chat template refused the messages (it raised), or could not be rendered."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTokenizer:
    """A checkpoint's tokenizer with its chat template and end tokens."""

    def __init__(self, directory: Path | str, generation: Mapping[str, Any] | None = None) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint needs a tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.template_source = self._template_source(directory)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.template = env.from_string(self.template_source) if self.template_source else None
        self.eos_ids = self._eos_ids(generation or {})

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, special tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; special tokens written in the text are recognised (the template writes them)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids, special tokens left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for a chat, as the checkpoint's template writes it."""
        if self.template is None:
            raise TemplateError("this checkpoint has no chat template; use /v1/completions")
        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
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
