"""Schema fuzzing with schemathesis against the live server's own OpenAPI document:
whatever it is sent, the server answers without a 5xx and keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts a server and fuzzes it (pytest -m "not slow" leaves it out)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    # a short context and small n keep each fuzzed generation quick
    srv = InProcessServer(
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
        "--enable-embeddings",
    )
    yield srv
    srv.stop()


# Operations the server's OpenAPI document must declare, each fuzzed below. A plugin or
# schema-loading failure that yields fewer operations, or none at all, fails the test
# instead of passing on zero examples.
FUZZED_OPERATIONS = {
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /generate",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "POST /v1/embeddings",
}
EXAMPLES_PER_OPERATION = 25


def test_openapi_document_declares_the_request_bodies(fuzz_server):
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["properties"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in chat["content"]["application/json"]["schema"]["required"]
    assert "ChatMessage" in doc["components"]["schemas"]


def _check_response(case) -> None:
    response = case.call(timeout=60)
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
        f"body: {case.body!r}"
    )
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        else:  # every other error is OpenAI-shaped JSON
            assert set(body["error"]) == {"message", "type", "param", "code"}


def _fuzz_operation(op, label: str, ran: dict[str, int]) -> None:
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    strategy = st.one_of(*(op.as_strategy(generation_mode=m) for m in modes))

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        ran[label] += 1
        _check_response(case)

    fuzz()


def test_fuzzed_requests_never_get_a_server_error(fuzz_server):
    """Schemathesis generates cases from the served document; Hypothesis drives them.

    The schemathesis pytest plugin is not used: its collection hooks break across pytest
    releases, and a plugin failure could pass as zero examples. Here every operation is
    fuzzed explicitly, and the test counts what ran."""
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = {}
    for result in schema.get_all_operations():
        op = result.ok()
        operations[f"{op.method.upper()} {op.path}"] = op
    missing = FUZZED_OPERATIONS - set(operations)
    assert not missing, f"operations missing from the OpenAPI document: {sorted(missing)}"

    ran: dict[str, int] = dict.fromkeys(operations, 0)
    for label, op in sorted(operations.items()):
        _fuzz_operation(op, label, ran)
    # every operation ran; those with a request body ran many distinct cases
    assert all(count >= 1 for count in ran.values()), ran
    with_body = [label for label in ran if label.startswith("POST ")]
    assert all(ran[label] >= 10 for label in with_body), ran


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
