"""The vendor chat templates under templates/ (README.md there says where each comes from), as the server
renders them, and the tools the fixtures' calls use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tensorfold.testing.chat_replies import template_tokenizer
from tensorfold.tokenizer import ChatTokenizer

TEMPLATES = Path(__file__).resolve().parent / "templates"


@pytest.fixture(scope="session")
def vendor(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ChatTokenizer]:
    """A tokenizer rendering the vendor template `name` (a file stem under templates/), made once per session."""
    made: dict[str, ChatTokenizer] = {}

    def get(name: str) -> ChatTokenizer:
        if name not in made:
            made[name] = template_tokenizer(TEMPLATES / f"{name}.jinja", tmp_path_factory.mktemp(name))
        return made[name]

    return get
