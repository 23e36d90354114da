"""``--reasoning-parser`` through a live server and the official clients: the thinking
comes back apart from the answer (Chat's ``reasoning_content``, Responses' reasoning item,
Messages' thinking block, gRPC's ``reasoning_text``), whole and streamed the same, never as
content, counted in the usage's reasoning tokens; a grammar starts after the thinking.
Tiny random models do not think, so a chain model answers "!think" with exactly a
thinking block and "Yes." (as added tokens), and a random model under DeepSeek-R1's
parser (whose replies start inside the thinking) shows a reply cut off while thinking."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.server_helpers import InProcessServer, free_port

pytestmark = pytest.mark.slow  # starts servers


@pytest.fixture(scope="module")
def r1_client(tiny_llama):
    srv = InProcessServer(
        "--model", str(tiny_llama), "--dtype", "float32", "--reasoning-parser", "deepseek_r1"
    )  # fmt: skip
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    srv.stop()


def test_a_reply_cut_inside_the_thinking_is_all_reasoning(r1_client):
    """DeepSeek-R1's replies start inside the thinking: a random model never closes it, so
    at max_tokens the whole reply is reasoning, no content, every token a reasoning token;
    streamed, the same text."""
    ask = {
        "model": r1_client.models.list().data[0].id,
        "messages": [{"role": "user", "content": "Think."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    out = r1_client.chat.completions.create(**ask)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert message.content is None and message.reasoning_content
    assert out.usage.completion_tokens_details.reasoning_tokens == out.usage.completion_tokens
    chunks = list(
        r1_client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert streamed == message.reasoning_content
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 12


def test_encrypted_reasoning_is_refused_clearly(r1_client):
    with pytest.raises(openai.BadRequestError, match="encrypted_content"):
        r1_client.responses.create(
            model=r1_client.models.list().data[0].id,
            input="hi",
            include=["reasoning.encrypted_content"],
        )


# a model whose greedy answer to a message ending in "!think" is exactly these tokens
THINKER = ["<think>", "Weighing it.", "</think>", "Yes."]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    from tests.api.console_helpers import build_chain_model

    model = build_chain_model(tmp_path_factory.mktemp("thinker") / "m", "!think", THINKER)
    srv = InProcessServer(
        "--model", str(model), "--dtype", "float32", "--reasoning-parser", "qwen3",
        "--grpc-port", str(free_port()),
    )  # fmt: skip
    yield srv
    srv.stop()


def test_messages_return_thinking_blocks_whole_and_streamed(thinker):
    import anthropic

    client = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    model = httpx.get(thinker.url + "/v1/models").json()["data"][0]["id"]
    ask = {
        "model": model,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "Is it so? !think"}],
    }
    whole = client.messages.create(**ask)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content
    ] == [
        ("thinking", "Weighing it."),
        ("text", "Yes."),
    ]
    assert whole.stop_reason == "end_turn"
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]


def _openai(thinker) -> openai.OpenAI:
    return openai.OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)


def test_chat_reasoning_content_whole_and_streamed_and_exact_tokens(thinker):
    client = _openai(thinker)
    ask = {
        "model": client.models.list().data[0].id,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "So? !think"}],
    }
    out = client.chat.completions.create(**ask)
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("Weighing it.", "Yes.")
    # <think>, the thought, </think>: three of the four answer tokens (then EOS)
    assert out.usage.completion_tokens_details.reasoning_tokens == 3
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Weighing it.", "Yes.")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3


def test_a_grammar_starts_after_the_thinking(thinker):
    """structured output on a reasoning model: the grammar lets the thinking through and
    constrains the answer (without it, the regex would force "Yes." as the first token)."""
    client = _openai(thinker)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        max_tokens=20,
        messages=[{"role": "user", "content": "So? !think"}],
        extra_body={"structured_outputs": {"regex": "(Yes|No)\\."}},
    )
    message = out.choices[0].message
    assert (message.reasoning_content, message.content) == ("Weighing it.", "Yes.")


def test_responses_return_the_thinking_as_a_reasoning_item_whole_and_streamed(thinker):
    client = _openai(thinker)
    ask = {
        "model": client.models.list().data[0].id,
        "input": "Is it so? !think",
        "max_output_tokens": 20,
    }
    whole = client.responses.create(**ask)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "Weighing it." and whole.output_text == "Yes."
    assert whole.usage.output_tokens_details.reasoning_tokens == 3
    reasoning = content = ""
    done = None
    with client.responses.stream(**ask) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                reasoning += event.delta
            elif event.type == "response.output_text.delta":
                content += event.delta
            elif event.type == "response.completed":
                done = event.response
    assert (reasoning, content) == ("Weighing it.", "Yes.")
    assert done is not None and [item.type for item in done.output] == ["reasoning", "message"]
    assert done.usage.output_tokens_details.reasoning_tokens == 3


def test_grpc_chat_carries_the_thinking_apart(thinker):
    import grpc

    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
    from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{thinker.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="So? !think")])
        params = pb.SamplingParams(max_tokens=20, temperature=0)
        replies = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling_params=params)))
        reasoning = "".join(r.reasoning_text for r in replies)
        text = "".join(r.text for r in replies)
        assert (reasoning, text) == ("Weighing it.", "Yes.")
        assert replies[-1].usage.reasoning_tokens == 3
        # a text input is a raw completion: nothing is split
        raw = list(stub.Generate(pb.GenerateRequest(text="So? !think", sampling_params=params)))
        assert "".join(r.reasoning_text for r in raw) == ""


def test_messages_thinking_budget_caps_the_thinking(thinker):
    """budget_tokens 1: the thinking stops after its first token, the end marker is put in
    its place, and the answer follows (the chain model answers "</think>" with "Yes.");
    the same streamed. Without a budget the thinking is the model's own."""
    import anthropic

    client = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    model = httpx.get(thinker.url + "/v1/models").json()["data"][0]["id"]
    ask = {
        "model": model,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "Is it so? !think"}],
        "thinking": {"type": "enabled", "budget_tokens": 1},
    }

    def blocks(message):
        return [
            (b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content
        ]

    capped = client.messages.create(**ask)
    assert blocks(capped) == [("thinking", None), ("text", "Yes.")]  # (an empty thought)
    # the prompt's own cached tokens, not the continuation's (which finds the thinking)
    assert capped.usage.input_tokens >= 0
    with client.messages.stream(**ask) as stream:
        assert blocks(stream.get_final_message()) == blocks(capped)
    roomy = client.messages.create(**{**ask, "thinking": {"type": "enabled", "budget_tokens": 8}})
    assert blocks(roomy) == [("thinking", "Weighing it."), ("text", "Yes.")]
    for thinking, _param in [
        ({"type": "enabled", "budget_tokens": 20}, "thinking.budget_tokens"),  # not < max_tokens
        ({"type": "enabled"}, "thinking.budget_tokens"),
        ({"type": "sometimes"}, "thinking"),
    ]:
        r = httpx.post(thinker.url + "/v1/messages", json={**ask, "thinking": thinking})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
