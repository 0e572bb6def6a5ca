"""The assistant messages the parser tests render through each vendor template (the tools they call are
tensorfold.testing.chat_replies.TOOLS), and which parser reads which template."""

from __future__ import annotations

from tensorfold.chat.api import ChatFormat
from tensorfold.chat.tools import tool_parser
from tensorfold.testing.chat_replies import assistant, call

CASES = {
    "one": assistant("", call("search", query="tensorfold")),
    "several": assistant("Let me check both.", call("get_weather", city="Paris"), call("search", query="rain",
                                                                                       limit=5)),
    "typed": assistant("", call("get_weather", city="Oslo", days=3, metric=True, scale=2.5, hours=[6, 12],
                                where={"lat": 59.9, "tags": ["coast", {"deep": [1, None, False]}]})),
    "unicode": assistant("Ich prüfe das — 東京 ☔", call("get_weather", city="Zürich 東京 🌧", unit="°C")),
    "multiline": assistant("Running it.", call("run_code", code='def f(x):\n    return "<b>" + x\n\nprint({"a": 1})')),
    "no_arguments": assistant("", call("now")),
}

# (vendor template, parser name, the family's think markers) — the pairs the real models use
PAIRS = [
    ("Qwen-Qwen3-0.6B", "hermes", ("<think>", "</think>")),
    ("Qwen3.5-4B", "qwen3_coder", ("<think>", "</think>")),
    ("Qwen3-Coder", "qwen3_coder", (None, None)),
    ("GLM-4.6", "glm47", ("<think>", "</think>")),
    ("GLM-4.7-Flash", "glm47", ("<think>", "</think>")),
    ("NVIDIA-Nemotron-Nano-v2", "nemotron", ("<think>", "</think>")),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "nemotron", ("<think>", "</think>")),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "qwen3_coder", ("<think>", "</think>")),
]


def pair_id(pair: tuple) -> str:
    """A readable test id for a (template, parser, markers) pair."""
    return f"{pair[1]}:{pair[0]}"


def chat_format(pair: tuple) -> ChatFormat:
    """The ChatFormat a family serving this template declares."""
    start, end = pair[2]
    return ChatFormat(tool_parser=tool_parser(pair[1]), think_start=start, think_end=end)
