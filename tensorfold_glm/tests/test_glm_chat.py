"""The glm family's chat format: GLM-4.7's replies as its real template renders them (reasoning the generation
prompt opens, `<arg_key>`/`<arg_value>` calls typed by the tools' schema), GLM-4.6's newline variant, and the
tiny checkpoint's template, which opens no reasoning."""

from __future__ import annotations

from pathlib import Path

from tensorfold.testing.chat_replies import THINKING_CALLS, check_template, expected, family_format, same_parts

TEMPLATES = Path(__file__).resolve().parents[2] / "tests" / "core" / "chat" / "templates"   # README.md: sources


def test_glm_chat_format(tmp_path: Path) -> None:
    found = family_format("glm", tmp_path / "tiny")
    assert (found.tool_parser.name, found.think_start, found.think_end) == ("glm47", "<think>", "</think>")
    for template, opens in (("GLM-4.7-Flash", True), ("GLM-4.6", False)):
        whole, reply = check_template(found, TEMPLATES / f"{template}.jinja", tmp_path / template)
        assert reply.starts_open is opens and reply.prompt.endswith("<|assistant|><think>" if opens else "|>")
        assert same_parts(whole, expected(THINKING_CALLS, with_reasoning=True)), template
