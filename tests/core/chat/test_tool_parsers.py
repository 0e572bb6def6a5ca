"""The built-in tool parsers on what the real models were trained to write: assistant messages rendered through
the vendors' chat templates, parsed whole and streamed in every chunking (the deltas must add up to the whole
parse), plus the text around calls, typed values and malformed calls."""

from __future__ import annotations

import json
import re

import pytest
from chat_cases import CASES, PAIRS, chat_format, pair_id

from tensorfold.chat.api import ReplyParts, ToolParser
from tensorfold.chat.reasoning import split_reasoning
from tensorfold.chat.tools import PARSERS, schema_types, tool_parser, typed_value
from tensorfold.testing.chat_replies import (
    SYSTEM,
    TOOLS,
    USER,
    call_tuple,
    chunkings,
    expected,
    same_parts,
    stream_parts,
    trained_reply,
)


def parsed(name: str, text: str, tools=TOOLS) -> ReplyParts:
    """The whole parse of `text` by parser `name`, as ReplyParts."""
    content, calls = tool_parser(name).parse(text, tools)
    return ReplyParts(content=content, tool_calls=calls)


def check_streams(name: str, text: str, tools=TOOLS, random_ones: int = 25) -> ReplyParts:
    """The whole parse, after checking that every chunking of a stream gives the same parts."""
    whole = parsed(name, text, tools)
    for pieces in chunkings(text, seed=len(text), random_ones=random_ones):
        stream = tool_parser(name).stream(tools)
        got = stream_parts(stream.push, stream.finish, pieces)
        assert same_parts(got, whole), f"{name} streamed in {pieces!r}"
    return whole


def rendered_content(pair: tuple, message: dict, vendor) -> str:
    """What the tool parser sees of `message` as the model writes it: the reply after its reasoning."""
    reply = trained_reply(vendor(pair[0]), [SYSTEM, USER], message, pair[2][0], tools=TOOLS)
    return split_reasoning(reply.text, *pair[2], reply.starts_open)[1]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_parser_reads_what_the_template_writes(pair: tuple, case: str, vendor) -> None:
    """Every call the template renders comes back with its arguments typed as they were, the content trimmed,
    streamed or whole."""
    text = rendered_content(pair, CASES[case], vendor)
    whole = check_streams(pair[1], text)
    assert same_parts(whole, expected(CASES[case])), text


def test_ids_are_fresh_call_ids(vendor) -> None:
    text = rendered_content(PAIRS[1], CASES["several"], vendor)
    ids = [c.id for c in tool_parser("qwen3_coder").parse(text, TOOLS)[1]]
    ids += [c.id for c in tool_parser("qwen3_coder").parse(text, TOOLS)[1]]
    assert len(set(ids)) == 4 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def blocks(pair: tuple, vendor) -> tuple[str, str]:
    """Two rendered call blocks of a format, each alone (no content around it)."""
    one = rendered_content(pair, CASES["one"], vendor).strip()
    two = rendered_content(pair, CASES["no_arguments"], vendor).strip()
    return one, two


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_text_around_calls_is_content(pair: tuple, vendor) -> None:
    """Text before, between and after calls is content; the whitespace touching a call is the template's and goes,
    and what is left on the two sides of a call is joined by a blank line."""
    one, two = blocks(pair, vendor)
    text = f"First.\n\n{one}\nMiddle, ünïcode.\n{two}\n\nLast.\n"
    whole = check_streams(pair[1], text, random_ones=5)
    assert whole.content == "First.\n\nMiddle, ünïcode.\n\nLast.\n"
    assert [c.name for c in whole.tool_calls] == ["search", "now"]
    only = check_streams(pair[1], f"\n{one}\n{two}\n", random_ones=5)
    assert only.content == "" and len(only.tool_calls) == 2


def test_text_without_calls_is_untouched() -> None:
    """Text with no whole call is content as written, markers and whitespace included."""
    text = "  Plain <tool reply> with </tool_call> and <TOOLCALL> or <tool_call> words? \n\n"
    for name in PARSERS:
        assert check_streams(name, text, random_ones=5) == ReplyParts(content=text), name


MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',     # bad JSON
               '<tool_call>\n{"arguments": {"query": "x"}}\n</tool_call>',                  # no name
               '<tool_call>\n{"name": "search", "arguments": [1]}\n</tool_call>',           # arguments not an object
               '<tool_call>\n{"name": "search", "arguments": {"query": "NaN"}, "x": NaN}\n</tool_call>'],
    "qwen3_coder": ["<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",
                    "<tool_call>\n<function=two words>\n</function>\n</tool_call>",
                    "<tool_call>\nsearch(query='x')\n</tool_call>",
                    "<tool_call>\n<function=search>\nstray text\n</function>\n</tool_call>"],
    "glm47": ["<tool_call>search<arg_key>query</arg_key></tool_call>",
              "<tool_call><arg_key>query</arg_key><arg_value>x</arg_value></tool_call>",
              "<tool_call>search stray<arg_key>query</arg_key><arg_value>x</arg_value></tool_call>",
              "<tool_call>search<arg_key>query</arg_key><arg_value>x</arg_value>tail</tool_call>"],
    "nemotron": ['<TOOLCALL>[{"name": "search", "arguments": {"query": "x"}}, {"arguments": {}}]</TOOLCALL>',
                 "<TOOLCALL>[]</TOOLCALL>",
                 '<TOOLCALL>{"name": "search", "arguments": "not json"}</TOOLCALL>'],
}


@pytest.mark.parametrize("name, block", [(n, b) for n, found in MALFORMED.items() for b in found])
def test_a_malformed_call_stays_content(name: str, block: str) -> None:
    """A block that does not decode is content as written (with the whitespace around it), never an error."""
    text = f"Before.\n{block}\nAfter."
    whole = check_streams(name, text, random_ones=10)
    assert whole == ReplyParts(content=text)


@pytest.mark.parametrize("pair", PAIRS, ids=pair_id)
def test_an_unclosed_call_is_content(pair: tuple, vendor) -> None:
    """A reply cut inside a call (max_tokens): the call's text is content; an unclosed call followed by a whole
    one gives the whole one."""
    one, two = blocks(pair, vendor)
    cut = one[:-3]
    assert check_streams(pair[1], f"Sure.\n{cut}", random_ones=10) == ReplyParts(content=f"Sure.\n{cut}")
    broken = cut[:len(cut) // 2]
    whole = check_streams(pair[1], f"{broken}\n{two}", random_ones=10)
    assert whole.content == broken.rstrip() and [c.name for c in whole.tool_calls] == ["now"]


def test_end_marker_inside_a_value_does_not_end_the_call() -> None:
    code = 'print("</tool_call>")\nx = "<tool_call>"'
    hermes = '<tool_call>\n{"name": "run_code", "arguments": {"code": ' + json.dumps(code) + '}}\n</tool_call>'
    xml = f"<tool_call>\n<function=run_code>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    glm = f"<tool_call>run_code<arg_key>code</arg_key><arg_value>{code}</arg_value></tool_call>"
    for name, text in (("hermes", hermes), ("qwen3_coder", xml), ("glm47", glm), ("nemotron", xml)):
        whole = check_streams(name, text, random_ones=10)
        assert [call_tuple(c) for c in whole.tool_calls] == [("run_code", json.dumps({"code": code}))], name
        assert whole.content == ""


def test_a_parameter_value_may_hold_parameter_markup() -> None:
    """Only a `</parameter>` followed by the next parameter or the function's end closes a value."""
    value = "a </parameter> b\n<parameter=fake>"
    text = f"<tool_call>\n<function=run_code>\n<parameter=code>\n{value}\n</parameter>\n</function>\n</tool_call>"
    assert parsed("qwen3_coder", text).tool_calls[0].arguments == json.dumps({"code": value})


def test_hermes_reads_arguments_written_as_json_text_and_parameters() -> None:
    text = ('<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>'
            '<tool_call>\n{"name": "search", "parameters": {"query": "y"}}\n</tool_call>'
            '<tool_call>\n{"name": "now"}\n</tool_call>')
    assert [call_tuple(c) for c in parsed("hermes", text).tool_calls] == [
        ("search", '{"query": "x"}'), ("search", '{"query": "y"}'), ("now", "{}")]


def test_values_are_strings_without_tools() -> None:
    """Without a schema (or for a parameter it does not declare) a bare-text value is a string."""
    xml = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    glm = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>x</arg_key>" \
          "<arg_value>4</arg_value></tool_call>"
    assert parsed("qwen3_coder", xml, tools=()).tool_calls[0].arguments == '{"days": "3"}'
    assert parsed("qwen3_coder", xml).tool_calls[0].arguments == '{"days": 3}'
    assert parsed("glm47", glm).tool_calls[0].arguments == '{"days": 3, "x": "4"}'


@pytest.mark.parametrize("text, schema, value", [
    ("3", {"type": "integer"}, 3),
    ("3.5", {"type": "number"}, 3.5),
    ("three", {"type": "integer"}, "three"),
    ("123", {"type": "string"}, "123"),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1, {"b": null}]}', {"type": "object"}, {"a": [1, {"b": None}]}),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("null", {"type": ["integer", "null"]}, None),
    ("7", {"type": ["integer", "null"]}, 7),
    ("NaN", {"type": "number"}, "NaN"),
    (" 4 ", {"type": "integer"}, 4),
    (" 4 ", None, " 4 "),
])
def test_typed_value(text: str, schema, value) -> None:
    assert typed_value(text, schema) == value and type(typed_value(text, schema)) is type(value)


def test_schema_types() -> None:
    assert schema_types({"oneOf": [{"type": ["integer", "null"]}, {"anyOf": [{"type": "string"}]}]}) == {
        "integer", "null", "string"}
    assert schema_types("string") == set() and schema_types({"enum": ["a"]}) == set()


def test_every_builtin_is_a_tool_parser() -> None:
    for name, parser in PARSERS.items():
        assert isinstance(parser, ToolParser) and parser.name == name
    assert chat_format(PAIRS[0]).problems() == []
    with pytest.raises(ValueError, match=r"no built-in tool parser 'nope' \(built in: glm47, hermes, nemotron"):
        tool_parser("nope")


def test_glm_reads_spaces_between_tags() -> None:
    """GLM-4.5-Air has been seen writing spaces where its template has newlines."""
    text = "Let me look: <tool_call>search <arg_key>query</arg_key> <arg_value>backend</arg_value> </tool_call>"
    whole = check_streams("glm47", text, random_ones=5)
    assert whole.content == "Let me look:" and call_tuple(whole.tool_calls[0]) == ("search", '{"query": "backend"}')
