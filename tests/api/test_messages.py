"""Anthropic's Messages API on a live server, driven by the official ``anthropic`` client:
the same greedy text as Chat Completions, the streamed event sequence, stop sequences,
tool use round trips, count_tokens, x-api-key auth and Anthropic-shaped errors."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts a server (pytest -m "not slow" leaves it out)

KEY = "sk-messages-test"
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
MESSAGES = [{"role": "user", "content": "Say something about Paris."}]
# this SDK's messages.create has no temperature argument (the API still takes it)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = InProcessServer(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--api-key",
        KEY,
        "--enable-debug-endpoints",
    )
    yield srv
    flushed = httpx.post(
        srv.url + "/debug/flush_cache", headers={"authorization": f"Bearer {KEY}"}
    ).json()
    srv.stop()
    assert flushed["idle"] and flushed["error"] is None and flushed["pages_leaked"] == 0


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _model(oai) -> str:
    return oai.models.list().data[0].id


def test_text_equals_chat_completions_and_streams_in_order(client, oai):
    model = _model(oai)
    msg = client.messages.create(
        model=model, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=MESSAGES
    )
    chat = oai.chat.completions.create(
        model=model,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert msg.stop_reason == expected
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens

    with client.messages.stream(
        model=model, max_tokens=12, extra_body=GREEDY, system="Be brief.", messages=MESSAGES
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text
    assert final.stop_reason == msg.stop_reason
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.index("content_block_start") < events.index("content_block_stop")
    assert events[-2] == "message_delta"


def test_stop_sequences(client, oai):
    model = _model(oai)
    free = client.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=MESSAGES)
    text = free.content[0].text
    assert len(text) > 4, text
    stop = text[2:4]
    msg = client.messages.create(
        model=model, max_tokens=16, extra_body=GREEDY, messages=MESSAGES, stop_sequences=[stop]
    )
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


def test_tool_use_round_trip_whole_and_streamed(client, oai):
    model = _model(oai)
    kwargs = dict(
        model=model,
        max_tokens=40,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    msg = client.messages.create(**kwargs)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and uses[0].input["city"] in ("Oslo", "Rome")
    assert uses[0].id.startswith("toolu_")

    with client.messages.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    suses = [b for b in streamed.content if b.type == "tool_use"]
    assert [u.input for u in suses] == [u.input for u in uses]

    # any: at least one call; the answer to it goes back as a tool_result
    any_call = {"type": "any", "disable_parallel_tool_use": True}
    forced = client.messages.create(**{**kwargs, "max_tokens": 100, "tool_choice": any_call})
    assert forced.stop_reason == "tool_use", forced
    call = next(b for b in forced.content if b.type == "tool_use")
    follow = client.messages.create(
        model=model,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump() for b in forced.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
                ],
            },
        ],
    )
    assert follow.content and follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    counted = client.messages.count_tokens(
        model=model,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    auto = client.messages.create(
        model=model,
        max_tokens=1,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    used = auto.usage.input_tokens + auto.usage.cache_read_input_tokens
    assert counted.input_tokens == used > 0  # the prompt as templated with the tools


def test_count_tokens_equals_the_prompt_of_a_message(client, oai):
    model = _model(oai)
    counted = client.messages.count_tokens(model=model, system="Be brief.", messages=MESSAGES)
    msg = client.messages.create(model=model, max_tokens=2, system="Be brief.", messages=MESSAGES)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_errors_are_anthropic_shaped_and_x_api_key_is_checked(server, client, oai):
    url = server.url + "/v1/messages"
    good = {"x-api-key": KEY}
    r = httpx.post(url, json={"messages": MESSAGES}, headers=good)  # max_tokens is required
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = httpx.post(url, json={"max_tokens": 4, "messages": MESSAGES}, headers={"x-api-key": "no"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for bad, field in [
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"model": "other-model"}, "model"),
    ]:
        r = httpx.post(url, json={"max_tokens": 4, "messages": MESSAGES, **bad}, headers=good)
        assert r.status_code in (400, 404), (bad, r.text)
        assert r.json()["type"] == "error" and field in r.json()["error"]["message"], r.text
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=_model(oai), max_tokens=0, messages=MESSAGES)
    # the OpenAI routes keep OpenAI's error shape
    r = httpx.post(server.url + "/v1/completions", json={}, headers=good)
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()
    assert json.loads(r.text)["error"]["param"] == "prompt"
