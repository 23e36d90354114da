"""Each family's tool-call format (``--tool-call-parser``), on outputs written as the
families' chat templates and model cards show them: whole, streamed in every cut, cut
off by max_tokens, and malformed (content, never an error)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api.openai.tool_parser import ToolContext, ToolStreamer, parse_tool_calls

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
FUNCTIONS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
OSLO = ("get_weather", {"city": "Oslo", "days": 2})
NOW = ("get_time", {})

# (parser, output, content, calls): what each family writes
CASES = [
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [OSLO, NOW],
    ),
    (
        "mistral",  # the v11 tokenizer's form
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [OSLO, NOW],
    ),
    (
        "qwen3_coder",
        "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n</function>\n</tool_call>",
        "Let me look.\n",
        [OSLO, NOW],
    ),
    (
        "pythonic",
        "[get_weather(city='Oslo', days=2), get_time()]",
        None,
        [OSLO, NOW],
    ),
    (
        "pythonic",
        '<|python_start|>[get_weather(city="Oslo", days=2)]<|python_end|>',
        None,
        [OSLO],
    ),
    (
        "deepseek_v3",
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
        "<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [OSLO, NOW],
    ),
    ("hermes", 'Ok.<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Ok.", [NOW]),
]


def _ctx(parser: str) -> ToolContext:
    return ToolContext(tools=[], functions=FUNCTIONS, mode="auto", parser=parser)


def _named(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_family_whole(parser, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, _ctx(parser))
    assert got_content == content and _named(got_calls) == calls


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=10))
def test_each_family_streamed_in_any_cut_equals_whole(parser, text, content, calls, cuts):
    """Calls split across stream chunks anywhere: the content streamed plus the rest
    equals the whole parse's, and the calls are the same."""
    streamer = ToolStreamer(_ctx(parser))
    streamed, last = "", 0
    for cut in [*sorted({c for c in cuts if c <= len(text)}), len(text)]:
        streamed += streamer.feed(text[last:cut])
        last = cut
    rest, got = streamer.finish()
    assert streamed + rest == (content or "") and _named(got) == calls


@pytest.mark.parametrize(
    "parser, text",
    [
        ("mistral", "[TOOL_CALLS][{\"name\": \"nope\", \"arguments\": {}}]"),  # not declared
        ("mistral", "[TOOL_CALLS]get_weather[ARGS]{not json"),
        ("qwen3_coder", "<tool_call>\n<function=unknown>\n</function>\n</tool_call>"),
        ("pythonic", "[get_weather(city=open('x'))]"),  # not a literal: never evaluated
        ("pythonic", "[get_weather('Oslo')]"),  # positional: not a call we can name
        ("pythonic", "[1, 2"),
        ("pythonic", "[get_weather(city=b'Oslo')]"),  # bytes: no JSON for them
        ("pythonic", "[get_weather(city={1, 2})]"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{oops}\n```"),
    ],
)  # fmt: skip
def test_malformed_calls_are_content(parser, text):
    assert parse_tool_calls(text, _ctx(parser)) == (text, [])


@pytest.mark.parametrize(
    "parser, text",
    [
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_wea'),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOs"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"ci"),
    ],
)  # fmt: skip
def test_a_call_cut_by_max_tokens_keeps_the_complete_ones(parser, text):
    content, calls = parse_tool_calls(text, _ctx(parser), truncated=True)
    assert content is None and _named(calls) == [NOW]
    assert parse_tool_calls(text, _ctx(parser)) == (text, [])  # not cut: not calls


@pytest.mark.parametrize(
    "template, parser",
    [
        ("... <tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>", "hermes"),
        ("<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>", "qwen3_coder"),
        ("{{- '[TOOL_CALLS][' }}", "mistral"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] }}", "deepseek_v3"),
        ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
        ('{"name": function name, "parameters": dictionary of argument name and its value}', "llama3_json"),
        ("{{ messages }}", None),
    ],
)  # fmt: skip
def test_auto_picks_the_format_the_template_teaches(template, parser):
    from radixserve.api.openai.tool_parser import detect_tool_parser

    assert detect_tool_parser(template) == parser


def test_auto_is_resolved_once_from_the_model_template():
    import types

    from radixserve.api.openai.config import ServerConfig
    from radixserve.api.openai.state import _resolve_auto

    qwen3 = types.SimpleNamespace(
        chat_template="{% if enable_thinking %}<think>\\n\\n</think>{% endif %}<tool_call>"
    )
    config = _resolve_auto(ServerConfig(reasoning_parser="auto", tool_call_parser="auto"), qwen3)
    assert (config.reasoning_parser, config.tool_call_parser) == ("qwen3", "hermes")
    plain = types.SimpleNamespace(chat_template={"default": "{{ messages }}"})
    config = _resolve_auto(ServerConfig(reasoning_parser="auto", tool_call_parser="auto"), plain)
    assert (config.reasoning_parser, config.tool_call_parser) == (None, "hermes")
    assert _resolve_auto(ServerConfig(), plain) == ServerConfig()  # nothing auto: unchanged


def test_formats_with_special_markers_keep_special_tokens_in_the_text():
    from radixserve.api.openai.tool_parser import keep_markers
    from radixserve.core.sampling_params import SamplingParams

    params = SamplingParams()
    assert keep_markers(params, _ctx("mistral")).skip_special_tokens is False
    assert keep_markers(params, _ctx("deepseek_v3")).skip_special_tokens is False
    assert keep_markers(params, _ctx("hermes")) is params
    assert keep_markers(params, ToolContext(parser="mistral")) is params  # no tools asked
