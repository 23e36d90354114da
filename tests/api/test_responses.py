"""OpenAI's Responses API on a live server with the official ``openai`` client: the same
greedy text as Chat Completions, the streamed semantic events in order, ``responses.parse``
with a pydantic model, a function-call round trip, ``previous_response_id``, the store
(retrieve, delete, 404s) and fields that are refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts a server (pytest -m "not slow" leaves it out)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class City(BaseModel):
    name: str = Field(pattern=r"^[A-Z][a-z]{1,8}$")
    population: int = Field(ge=0, le=100)


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = InProcessServer(
        "--model", str(tiny_llama), "--dtype", "float32", "--enable-debug-endpoints"
    )
    yield srv
    flushed = httpx.post(srv.url + "/debug/flush_cache").json()
    srv.stop()
    assert flushed["idle"] and flushed["error"] is None and flushed["pages_leaked"] == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_text_equals_chat_and_streams_the_documented_events(client):
    model = _model(client)
    kwargs = dict(model=model, instructions="Be brief.", max_output_tokens=12, temperature=0)
    resp = client.responses.create(input="Tell me about Paris.", **kwargs)
    chat = client.chat.completions.create(
        model=model,
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about Paris."},
        ],
    )
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text == chat.choices[0].message.content
    incomplete = chat.choices[0].finish_reason == "length"
    assert resp.status == ("incomplete" if incomplete else "completed")
    if incomplete:
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.input_tokens == chat.usage.prompt_tokens

    with client.responses.stream(input="Tell me about Paris.", **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",  # (status "incomplete" when max_output_tokens cut it)
    ]
    assert final.status == resp.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == resp.output_text


def test_parse_with_a_pydantic_model(client):
    parsed = client.responses.parse(
        model=_model(client),
        input="A small city as JSON.",
        text_format=City,
        max_output_tokens=200,
    )
    city = parsed.output_parsed
    assert isinstance(city, City) and 0 <= city.population <= 100


def test_function_call_round_trip_and_previous_response_id(client, server):
    model = _model(client)
    first = client.responses.create(
        model=model,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Oslo", "Rome")
    # the output of the call goes back, continuing the stored conversation
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
        tools=[WEATHER],
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.status in (
        "completed",
        "incomplete",
    )
    # the same conversation sent whole gives the same prompt (and the same answer)
    whole = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
        tools=[WEATHER],
        max_output_tokens=6,
        temperature=0,
    )
    assert whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text
    # streamed function calls: the arguments arrive in function_call_arguments events
    with client.responses.stream(
        model=model,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    fcalls = [o for o in final.output if o.type == "function_call"]
    assert [c.arguments for c in fcalls] == [done[0].arguments]

    # the store: retrieve, delete, then 404s naming the id
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(first.id)
    assert first.id in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=model, input="hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    assert "resp_nope" in info.value.message
    unstored = client.responses.create(model=model, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"made_up_field": 1}, "made_up_field"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_unsupported_fields_are_400s_naming_them(server, extra, param):
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
