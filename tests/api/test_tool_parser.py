"""Tool-call parsing (hermes tags, Llama 3 JSON; whole and streamed) and the frontend's
grammar pre-check, without a server."""

from __future__ import annotations

import asyncio
import json

import pytest

from radixserve.api.openai.tool_parser import ToolContext, ToolStreamer, parse_tool_calls
from radixserve.core.errors import InputError
from radixserve.serving.grammar import GrammarChecker
from tests.api.test_structured_server import WEATHER


def test_grammar_check_timeout_is_a_400():
    checker = GrammarChecker(timeout_s=1e-6)
    spec = {"regex": "(" + "|".join(f"w{i}[a-z]{{1,9}}" for i in range(400)) + ")+"}
    with pytest.raises(InputError) as info:
        asyncio.run(checker.check(spec, "structured_outputs"))
    assert info.value.param == "structured_outputs.regex"
    assert "did not compile within" in str(info.value)


@pytest.mark.parametrize(
    "spec, param, words",
    [
        ({"json": {"type": "objectx"}}, "structured_outputs.json", "Unsupported type"),
        ({"regex": "[a-"}, "structured_outputs.regex", "Unclosed"),
        ({"grammar": 'root ::= "a" | b'}, "structured_outputs.grammar", "not defined"),
    ],
)
def test_grammar_check_parses_without_a_tokenizer(spec, param, words):
    """The frontend's check finds a bad spec by parsing it (the engine compiles)."""
    checker = GrammarChecker()
    with pytest.raises(InputError) as info:
        asyncio.run(checker.check(spec, "structured_outputs"))
    assert info.value.param == param and words in str(info.value)
    asyncio.run(checker.check({"json": {"type": "object"}}, "structured_outputs"))


def test_tool_call_parsers_on_fixed_text():
    ctx = ToolContext(tools=[WEATHER], functions={"get_weather": {}}, mode="auto")
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ctx)
    assert content == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # streamed in small pieces: content before the marker streams, the call is held back
    streamer = ToolStreamer(ctx)
    streamed = "".join(streamer.feed(text[i : i + 3]) for i in range(0, len(text), 3))
    rest, scalls = streamer.finish()
    assert streamed + rest == content and len(scalls) == 1
    assert parse_tool_calls("no call here <tool", ctx) == ("no call here <tool", [])
    assert parse_tool_calls('<tool_call>{"name": "nope"}</tool_call>', ctx)[1] == []
    llama = ToolContext(
        tools=[WEATHER], functions={"get_weather": {}}, mode="auto", parser="llama3_json"
    )
    content, calls = parse_tool_calls(
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_weather", "parameters": {"city": "Bern"}}',
        llama,
    )
    assert content is None
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Rome", "Bern"]
    assert parse_tool_calls("Hello there", llama) == ("Hello there", [])


def test_calls_cut_off_by_max_tokens_keep_the_complete_ones():
    required = ToolContext(tools=[WEATHER], functions={"get_weather": {}}, mode="required")
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    cut = f'[{call}, {call}, {{"name": "get_wea'
    assert parse_tool_calls(cut, required) == (cut, [])  # not truncated: not calls
    content, calls = parse_tool_calls(cut, required, truncated=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert len(parse_tool_calls(f"[{call}, {call}]", required)[1]) == 2
    hermes = ToolContext(tools=[WEATHER], functions={"get_weather": {}}, mode="auto")
    text = f'<tool_call>{call.replace("parameters", "arguments")}</tool_call>\n<tool_call>{{"na'
    assert parse_tool_calls(text, hermes)[1] == []
    assert len(parse_tool_calls(text, hermes, truncated=True)[1]) == 1
    streamer = ToolStreamer(hermes)
    streamer.feed(text)
    assert len(streamer.finish(truncated=True)[1]) == 1


def test_parallel_tool_calls_false_returns_one_call():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    one = ToolContext(tools=[WEATHER], functions={"get_weather": {}}, mode="auto", parallel=False)
    many = ToolContext(tools=[WEATHER], functions={"get_weather": {}}, mode="auto")
    assert len(parse_tool_calls(call * 3, many)[1]) == 3
    assert len(parse_tool_calls(call * 3, one)[1]) == 1
    # required without parallel calls: the grammar allows a single-item list
    required = ToolContext(functions={"get_weather": {}}, mode="required", parallel=False)
    assert required.grammar_spec()["json"]["maxItems"] == 1
