"""``POST /v1/embeddings`` on live servers with the official ``openai`` client: the engine's
pooled hidden states (what ``LLM.embed`` gives), float and base64, every input shape,
an embedding model's own pooling and Matryoshka sizes, a generative model refused unless
``--enable-embeddings``, and bad inputs as 400s naming the field."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest

from radixserve import LLM
from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves them out)

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]


def _stop_checked(srv: InProcessServer) -> None:
    """Stop ``srv`` after checking its page accounting at idle (the debug flush)."""
    flushed = httpx.post(srv.url + "/debug/flush_cache").json()
    srv.stop()
    assert flushed["idle"] and flushed["error"] is None and flushed["pages_leaked"] == 0


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = InProcessServer(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--enable-debug-endpoints",
        "--enable-embeddings",
        "--max-prompts-per-request",
        "4",
        "--max-prompt-tokens-per-request",
        "300",
        "--max-model-len",
        "128",
    )
    yield srv
    _stop_checked(srv)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.02)


def _close(got, want) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float32), want, rtol=1e-4, atol=1e-5)


def test_float_and_base64_equal_the_engine(client, offline):
    want = offline.embed(TEXTS, pooling="last")
    model = client.models.list().data[0].id
    # the client's default: it asks for base64 and decodes it
    resp = client.embeddings.create(model=model, input=TEXTS)
    assert resp.object == "list" and resp.model == model
    assert [d.index for d in resp.data] == [0, 1]
    assert all(d.object == "embedding" for d in resp.data)
    for d, w in zip(resp.data, want, strict=True):
        _close(d.embedding, w)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    ids = [offline.tokenizer(t)["input_ids"] for t in TEXTS]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in ids)
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    for d, w in zip(floats.data, want, strict=True):
        _close(d.embedding, w)
    # base64 asked for explicitly: the client hands the string over as is
    raw = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    assert decoded.shape == (64,)
    _close(decoded, want[0])
    # token ids, and lists of them, are the same inputs
    one = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    _close(one.data[0].embedding, want[1])
    many = client.embeddings.create(model=model, input=ids, encoding_format="float")
    for d, w in zip(many.data, want, strict=True):
        _close(d.embedding, w)
    # vLLM's normalize=false: the raw pooled hidden state
    (unnormalised,) = offline.embed(TEXTS[:1], pooling="last", normalize=False)
    plain = client.embeddings.create(
        model=model, input=TEXTS[0], encoding_format="float", extra_body={"normalize": False}
    )
    _close(plain.data[0].embedding, unnormalised)
    # the full size is always a valid dimensions
    full = client.embeddings.create(model=model, input=TEXTS[0], dimensions=64)
    assert len(full.data[0].embedding) == 64


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": ["a", 5]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [5, 99999]}, "input"),
        ({"input": [5] * 129}, "input"),  # longer than --max-model-len 128
        ({"input": ["a", "b", "c", "d", "e"]}, "input"),  # --max-prompts-per-request 4
        ({"input": [[5] * 100] * 4}, "input"),  # 400 tokens > 300 per request
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": 65}, "dimensions"),
        ({"input": "a", "dimensions": 32}, "dimensions"),  # not a Matryoshka model
        ({"input": "a", "dimensions": "8"}, "dimensions"),
        ({"input": "a", "normalize": "yes"}, "normalize"),
        ({"input": "a", "pooling": "mean"}, "pooling"),  # unknown fields are refused
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]


def test_unknown_model_is_a_404_and_user_is_accepted(server):
    r = _post(server, {"input": "a", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, {"input": "a", "user": "someone"})
    assert r.status_code == 200
    r = httpx.post(server.url + "/v1/embeddings", content=b"{", timeout=30)
    assert r.status_code == 400


def test_generative_model_without_the_flag_is_refused(tiny_llama):
    srv = InProcessServer("--model", str(tiny_llama), "--dtype", "float32")
    try:
        r = _post(srv, {"input": "hello"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "embeddings_not_enabled" and "--enable-embeddings" in err["message"]
        # generation is unaffected
        r = httpx.post(
            srv.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
    finally:
        srv.stop()


def test_embedding_model_pools_as_configured_with_matryoshka_sizes(tiny_llama, tmp_path):
    """A sentence-transformers folder (mean pooling in ``1_Pooling``, Matryoshka sizes in
    ``config.json``) is served without the flag, mean-pooled; ``dimensions`` truncates to a
    listed size and renormalises."""
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    (want,) = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.02).embed(
        TEXTS[:1], pooling="mean", normalize=False
    )
    srv = InProcessServer("--model", str(folder), "--dtype", "float32", "--enable-debug-endpoints")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        full = client.embeddings.create(model="st", input=TEXTS[0], encoding_format="float")
        _close(full.data[0].embedding, want / np.linalg.norm(want))
        cut = client.embeddings.create(model="st", input=TEXTS[0], dimensions=16)
        assert len(cut.data[0].embedding) == 16
        _close(cut.data[0].embedding, want[:16] / np.linalg.norm(want[:16]))
        r = _post(srv, {"input": "a", "dimensions": 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    finally:
        _stop_checked(srv)
