"""The nemotron family's chat format: Nemotron-3's replies as its real template renders them (reasoning the
generation prompt opens, XML tool calls typed by the tools' schema), Nemotron-Nano-v2's `<TOOLCALL>` lists, and the
tiny checkpoint's template, which opens no reasoning."""

from __future__ import annotations

from pathlib import Path

from tensorfold.testing.chat_replies import THINKING_CALLS, check_template, expected, family_format, same_parts

TEMPLATES = Path(__file__).resolve().parents[2] / "tests" / "core" / "chat" / "templates"   # README.md: sources


def test_nemotron_chat_format(tmp_path: Path) -> None:
    found = family_format("nemotron", tmp_path / "tiny")
    assert (found.tool_parser.name, found.think_start, found.think_end) == ("nemotron", "<think>", "</think>")
    whole, reply = check_template(found, TEMPLATES / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", tmp_path / "n3")
    assert reply.prompt.endswith("<|im_start|>assistant\n<think>\n") and reply.starts_open
    assert same_parts(whole, expected(THINKING_CALLS, with_reasoning=True))
    whole, reply = check_template(found, TEMPLATES / "NVIDIA-Nemotron-Nano-v2.jinja", tmp_path / "v2")
    assert "<TOOLCALL>" in reply.text
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        (c.name, c.arguments) for c in expected(THINKING_CALLS).tool_calls]
