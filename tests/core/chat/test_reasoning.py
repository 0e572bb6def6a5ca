"""Reasoning split off a reply by the think markers: on replies the vendor templates render (open starts, explicit
markers, each family's newlines), streamed in every chunking (markers split across pushes), and the edges: no end
marker, an end marker with no start, no markers at all."""

from __future__ import annotations

import pytest

from tensorfold.chat.api import ContentDelta, ReasoningDelta, ReplyParts
from tensorfold.chat.reasoning import ReasoningSplitter, split_reasoning
from tensorfold.testing.chat_replies import SYSTEM, USER, assistant, chunkings, stream_parts, trained_reply

THINK = ("<think>", "</think>")
REASONING = "The user asks about weather.\n\nI should answer briefly — ☀️ or 🌧?"
ANSWER = "It is sunny.\n\nEnjoy — 東京 included."


def split(text: str, starts_open: bool, markers=THINK, random_ones: int = 25) -> ReplyParts:
    """The whole split, after checking every chunking of a stream gives the same."""
    reasoning, content = split_reasoning(text, *markers, starts_open)
    whole = ReplyParts(content=content, reasoning=reasoning)
    for pieces in chunkings(text, seed=len(text), random_ones=random_ones):
        splitter = ReasoningSplitter(*markers, starts_open)
        assert stream_parts(splitter.push, splitter.finish, pieces) == whole, pieces
    return whole


@pytest.mark.parametrize("template, opens", [
    ("Qwen3.5-4B", True),                              # the prompt ends "<think>\n": "R\n</think>\n\nC"
    ("Qwen-Qwen3-0.6B", False),                        # the model writes "<think>\nR\n</think>\n\nC"
    ("GLM-4.6", False),                                # "\n<think>R</think>\nC"
    ("GLM-4.7-Flash", True),                           # the prompt ends "<think>": "R</think>C"
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True),     # the prompt ends "<think>\n": "R\n</think>\nC"
])
def test_reasoning_as_the_template_writes_it(template: str, opens: bool, vendor) -> None:
    reply = trained_reply(vendor(template), [SYSTEM, USER], assistant(ANSWER, reasoning=REASONING), "<think>")
    assert reply.starts_open is opens
    assert split(reply.text, reply.starts_open) == ReplyParts(content=ANSWER, reasoning=REASONING)


@pytest.mark.parametrize("template", ["Qwen3.5-4B", "GLM-4.7-Flash", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"])
def test_thinking_off_closes_the_block_in_the_prompt(template: str, vendor) -> None:
    """enable_thinking=False: the prompt holds an empty closed block, so the reply is content."""
    reply = trained_reply(vendor(template), [SYSTEM, USER], assistant(ANSWER), "<think>", enable_thinking=False)
    assert reply.prompt.rstrip().endswith("</think>") and not reply.starts_open
    assert split(reply.text, starts_open=False) == ReplyParts(content=ANSWER)


@pytest.mark.parametrize("text, starts_open, parts", [
    ("Still thinking about it\n", True, ("", "Still thinking about it")),            # cut short: all reasoning
    ("<think>\nStill thinking", False, ("", "Still thinking")),
    ("<think>\nR\n</think>\n\nC", True, ("C", "R")),                                  # a start marker written again
    ("  \n<think>R</think>C", False, ("C", "R")),
    ("<think>\n\n</think>\n\nC", False, ("C", None)),                                # empty reasoning is none
    ("\n\nR\n</think>", True, ("", "R")),
    ("R</thi", True, ("", "R</thi")),                                                 # half a marker is text
    ("Hi <think>x</think> y", False, ("Hi <think>x</think> y", None)),               # markers mid-content: text
    ("Answer first.\n<think>", False, ("Answer first.\n<think>", None)),
    ("<thin", False, ("<thin", None)),
    ("", False, ("", None)),
    ("", True, ("", None)),
    ("\n\n", False, ("\n\n", None)),
    ("R</think>\n\nC </think> again", True, ("C </think> again", "R")),             # one block: later markers are text
    ("\nA\n\n  B\n\n</think>\n\n\nC\n", True, ("C\n", "A\n\n  B")),
])
def test_edges(text: str, starts_open: bool, parts: tuple) -> None:
    assert split(text, starts_open) == ReplyParts(content=parts[0], reasoning=parts[1])


def test_an_end_marker_with_no_start_closes_reasoning() -> None:
    """The whole split reads an end marker with no start before it as the end of reasoning the reply began in
    (the prompt opened it in a way the server did not see); a stream, which already sent that text as content,
    only drops the marker."""
    text = "Weighing it up.\n</think>\n\nThe answer."
    assert split_reasoning(text, *THINK, starts_open=False) == ("Weighing it up.", "The answer.")
    streamed = ReplyParts(content="Weighing it up.\nThe answer.")
    for pieces in chunkings(text, random_ones=10):
        splitter = ReasoningSplitter(*THINK, starts_open=False)
        assert stream_parts(splitter.push, splitter.finish, pieces) == streamed


def test_without_markers_everything_is_content() -> None:
    text = "<think>\nnot reasoning for this family\n</think>\nC"
    assert split(text, starts_open=True, markers=(None, None)) == ReplyParts(content=text)


def test_markers_are_held_back_only_while_they_may_be_arriving() -> None:
    """A stream sends text as soon as it cannot be part of a marker or the newlines a marker takes."""
    splitter = ReasoningSplitter(*THINK, starts_open=True)
    assert splitter.push("Think") == [ReasoningDelta("Think")]
    assert splitter.push("ing\n</th") == [ReasoningDelta("ing")]
    assert splitter.push("ink>\n\nAns") == [ContentDelta("Ans")]
    assert splitter.push("wer </think>") == [ContentDelta("wer </think>")]
    assert splitter.finish() == []
    opening = ReasoningSplitter(*THINK, starts_open=False)
    assert opening.push("\n<th") == [] and opening.push("at is") == [ContentDelta("\n<that is")]
