"""The example family's chat format: Qwen3's hermes JSON calls as the real Qwen3 template renders them, no think
markers, and the tiny checkpoint's template, which opens no reasoning."""

from __future__ import annotations

from pathlib import Path

from tensorfold.testing.chat_replies import CALLS, check_template, expected, family_format, same_parts

TEMPLATES = Path(__file__).resolve().parents[3] / "tests" / "core" / "chat" / "templates"   # README.md: sources


def test_example_chat_format(tmp_path: Path) -> None:
    found = family_format("example", tmp_path / "tiny")
    assert (found.tool_parser.name, found.think_start, found.think_end) == ("hermes", None, None)
    whole, _ = check_template(found, TEMPLATES / "Qwen-Qwen3-0.6B.jinja", tmp_path / "qwen3", message=CALLS)
    assert same_parts(whole, expected(CALLS))
