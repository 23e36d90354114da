"""The server on the real default model (SmolLM2-135M from its GGUF file): what an OpenAI
client gets equals the offline API's greedy output, streamed or not."""

from __future__ import annotations

import openai
import pytest

from radixserve import SamplingParams
from tests.api.server_helpers import ServerProcess

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Écris une phrase sur la mer."},
    ],
]


@pytest.fixture(scope="module")
def smollm2_server():
    srv = ServerProcess("--dtype", "float32", startup_timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(smollm2_server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.mark.parametrize("messages", MESSAGES)
def test_chat_equals_offline_greedy_streamed_or_not(client, smollm2_llm, messages):
    offline = smollm2_llm.chat(
        messages, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False
    )[0]
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=messages, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == offline.text
    assert full.usage.completion_tokens == len(offline.token_ids)
    assert full.usage.prompt_tokens == len(offline.prompt_token_ids)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == offline.text


def test_repeated_prompt_hits_the_prefix_cache(client):
    model = client.models.list().data[0].id
    prompt = "Paris is a city of art, history and food. " * 8
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0
