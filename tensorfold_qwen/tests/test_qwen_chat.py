"""The qwen family's chat format: Qwen3.5's replies as its real template renders them (reasoning the generation
prompt opens, XML tool calls typed by the tools' schema), and the tiny checkpoint's template, which opens none."""

from __future__ import annotations

from pathlib import Path

from tensorfold.testing.chat_replies import THINKING_CALLS, check_template, expected, family_format, same_parts

TEMPLATES = Path(__file__).resolve().parents[2] / "tests" / "core" / "chat" / "templates"   # README.md: sources


def test_qwen_chat_format(tmp_path: Path) -> None:
    found = family_format("qwen", tmp_path / "tiny")
    assert (found.tool_parser.name, found.think_start, found.think_end) == ("qwen3_coder", "<think>", "</think>")
    whole, reply = check_template(found, TEMPLATES / "Qwen3.5-4B.jinja", tmp_path / "qwen3.5")
    assert reply.prompt.endswith("<|im_start|>assistant\n<think>\n") and reply.starts_open
    assert same_parts(whole, expected(THINKING_CALLS, with_reasoning=True))
