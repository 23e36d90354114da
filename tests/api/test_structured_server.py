"""Structured output and tool calling through the live server with the official openai
client: constrained output of a random-weight model parses and validates; bad specs and
undeclared fields are 400s naming the field, and the server keeps serving."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{2}[0-9]{3}$")
    qty: int = Field(ge=1, le=50)


class Order(BaseModel):
    customer: str = Field(pattern=r"^[A-Z][a-z]{1,8}$")
    status: Literal["new", "paid", "shipped"]
    total: float = Field(ge=0, le=1000)
    items: list[Item] = Field(min_length=1, max_length=3)
    rush: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = InProcessServer("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_parse_with_a_pydantic_model_on_a_random_model(client):
    model = _model(client)
    for seed in range(3):
        done = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "an order please"}],
            response_format=Order,
            max_tokens=400,
            temperature=1.0,
            seed=seed,
        )
        msg = done.choices[0].message
        assert isinstance(msg.parsed, Order), msg.content
        assert done.choices[0].finish_reason == "stop"


def test_completions_json_schema_regex_and_choice(client):
    model = _model(client)
    out = client.completions.create(
        model=model,
        prompt="Order:",
        max_tokens=400,
        temperature=1.0,
        seed=5,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": Order.model_json_schema()},
            }
        },
    )
    Order.model_validate_json(out.choices[0].text)
    for seed in range(3):
        chat = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": r"\d{3}-[a-z]{2,5}"}},
        )
        assert re.fullmatch(r"\d{3}-[a-z]{2,5}", chat.choices[0].message.content)
        comp = client.completions.create(
            model=model,
            prompt="Pick:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
        )
        assert comp.choices[0].text in ("red", "green", "blue")


def _bad(client, status: int = 400, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(
            model=_model(client), messages=MESSAGES, max_tokens=8, **kwargs
        )
    assert info.value.status_code == status
    return info.value


def test_bad_specs_and_undeclared_fields_are_400s_naming_the_field(client, server):
    err = _bad(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
        },
    )
    assert err.body["param"] == "response_format.json_schema.schema"
    assert "nonsense" in err.body["message"]
    err = _bad(client, extra_body={"structured_outputs": {"regex": "a(b"}})
    assert err.body["param"] == "structured_outputs.regex"
    err = _bad(client, extra_body={"structured_outputs": {"grammar": "root ::= foo"}})
    assert err.body["param"] == "structured_outputs.grammar"
    err = _bad(client, extra_body={"structured_outputs": {"json": 3}})
    assert err.body["param"] == "structured_outputs.json"
    err = _bad(client, response_format={"type": "xml"})
    assert err.body["param"] == "response_format.type"
    err = _bad(client, tool_choice="required")
    assert err.body["param"] == "tool_choice"
    err = _bad(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}})
    assert err.body["param"] == "tool_choice"
    err = _bad(
        client,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"regex": "a"}},
    )
    assert "cannot be combined" in err.body["message"]
    for field, value in [("functions", [{"name": "f"}]), ("best_of", 2), ("suffix", "x")]:
        err = _bad(client, extra_body={field: value})
        assert err.body["param"] == field and "not supported" in err.body["message"]
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    err = _bad(
        client,
        stream=True,
        stream_options={"include_usage": True, "made_up_option": True},
    )
    assert err.body["param"] == "stream_options.made_up_option"
    # harmless metadata is accepted
    ok = client.chat.completions.create(
        model=_model(client), messages=MESSAGES, max_tokens=2, user="u", metadata={"a": "b"}
    )
    assert ok.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(
        server.url + "/generate",
        json={
            "text": "x",
            "sampling_params": {"max_tokens": 4, "structured_output": {"regex": "("}},
        },
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "sampling_params.structured_output.regex"
    assert httpx.get(server.url + "/health").status_code == 200


def _call_args(call) -> dict:
    return json.loads(call.function.arguments)


def test_tool_choice_required_and_named_always_give_valid_calls(client):
    model = _model(client)
    for seed in range(3):
        out = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            args = _call_args(call)
            if call.function.name == "get_weather":
                assert re.fullmatch(r"[A-Z][a-z]{1,10}", args["city"]) and args["unit"] in "cf"
            else:
                assert call.function.name == "get_time" and args["zone"] in ("utc", "cet")
    named = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=1.0,
        seed=1,
    )
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert _call_args(calls[0])["zone"] in ("utc", "cet")


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            reason = ch.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


def test_streamed_tool_calls_equal_the_non_streamed_ones(client):
    base = dict(
        model=_model(client),
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        max_tokens=200,
        temperature=0,
    )
    # required (grammar) and auto with a Hermes-format call forced by a regex
    hermes = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,6}", "unit": "[cf]"\}\}</tool_call>'
    )
    for extra in (
        {"tool_choice": "required"},
        {"extra_body": {"structured_outputs": {"regex": hermes}}},
    ):
        full = client.chat.completions.create(**base, **extra)
        msg = full.choices[0].message
        assert full.choices[0].finish_reason == "tool_calls"
        want = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
        content, calls, reason = _streamed(client, **base, **extra)
        assert calls == want and reason == "tool_calls"
        assert content == (msg.content or "")
    assert msg.content == "Sure. " and want[0][0] == "get_weather"


def test_tool_history_goes_through_the_template(client):
    out = client.chat.completions.create(
        model=_model(client),
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER],
        max_tokens=4,
    )
    assert out.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=_model(client),
            messages=[
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ],
            max_tokens=4,
        )
    assert info.value.body["param"] == "messages.0.tool_calls.0.function.arguments"


@pytest.mark.parametrize(
    "field,value,check",
    [
        (
            "guided_json",
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
            lambda text: isinstance(json.loads(text)["n"], int),
        ),
        (
            "json_schema",
            json.dumps(
                {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}
            ),
            lambda text: all(isinstance(x, bool) for x in json.loads(text)),
        ),
        (
            "guided_regex",
            "[0-9]{3}-[a-z]{2}",
            lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text),
        ),
        ("regex", "(yes|no)!", lambda text: text in ("yes!", "no!")),
        ("guided_choice", ["red", "green"], lambda text: text in ("red", "green")),
        ("guided_grammar", 'root ::= "a" [bc]+ "d"', lambda text: re.fullmatch("a[bc]+d", text)),
        ("ebnf", 'root ::= ("x" | "y") ("x" | "y")', lambda text: re.fullmatch("[xy]{2}", text)),
    ],
)
def test_legacy_structured_output_fields_clients_send(client, field, value, check):
    """vLLM's guided_* fields and SGLang's regex/json_schema/ebnf constrain the output as
    structured_outputs does (each is one spec by itself)."""
    out = client.completions.create(
        model=_model(client),
        prompt="Answer:",
        max_tokens=60,
        temperature=1.0,
        seed=3,
        extra_body={field: value, "guided_decoding_backend": "xgrammar"},
    ).choices[0]
    assert out.finish_reason == "stop" and check(out.text), out.text


def test_legacy_structured_output_errors_name_their_field(client):
    err = _bad(client, extra_body={"guided_regex": "(unclosed"})
    assert err.body["param"] == "guided_regex"
    err = _bad(client, extra_body={"guided_choice": ["a"], "regex": "b"})
    assert "cannot be combined" in err.message
    err = _bad(
        client,
        extra_body={"guided_json": {"type": "string"}, "guided_decoding_backend": "outlines"},
    )
    assert err.body["param"] == "guided_decoding_backend"
