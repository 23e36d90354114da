"""Schema fuzzing with schemathesis against the live server's own OpenAPI document:
whatever it is sent, the server answers without a 5xx and keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.api.server_helpers import ServerProcess


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    # a short context and small n keep each fuzzed generation quick
    srv = ServerProcess(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--max-model-len",
        "96",
        "--max-n",
        "3",
        "--max-logprobs",
        "4",
        "--max-body-mb",
        "0.01",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def test_openapi_document_declares_the_request_bodies(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["properties"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in chat["content"]["application/json"]["schema"]["required"]
    assert "ChatMessage" in doc["components"]["schemas"]


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_fuzzed_requests_never_get_a_server_error(case, fuzz_server):
    response = case.call(timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {case.body!r}"
    )
    if response.status_code >= 400:
        error = response.json()["error"]  # every error is OpenAI-shaped JSON
        assert set(error) == {"message", "type", "param", "code"}


def test_server_limits_from_the_command_line(fuzz_server):
    url = fuzz_server.url + "/v1/completions"
    too_many = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "logprobs": 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
    assert httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "logprobs": 4}).is_success
    big = httpx.post(url, json={"prompt": "x" * 20_000, "max_tokens": 2})
    assert big.status_code == 413


def test_server_still_serves_after_fuzzing(fuzz_server):
    r = httpx.post(
        fuzz_server.url + "/v1/completions",
        json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
