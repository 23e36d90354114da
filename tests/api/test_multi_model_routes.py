"""Several models behind one server, fast: two names for the tiny model, engines on threads
of the test process, a ``--memory-budget`` for one. A request holds its model until its
answer is sent (a stream to its end): the model is not unloaded meanwhile, another model
waits for the memory and is answered 503 with Retry-After; ``keep_alive``, pins and the
admin routes; metrics by model."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import grpc
import httpx
import pytest

from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from tests.api.server_helpers import InProcessServer, free_port

GREEDY = {"prompt": "hello", "max_tokens": 4, "temperature": 0}


def _status(url: str) -> dict[str, dict]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models").json()["data"]}


def _ids(r: httpx.Response) -> str:
    """A rendered request's id (random), or "" for other answers."""
    answer = r.json()
    first = answer[0] if isinstance(answer, list) else answer
    return str(first.get("request_id", "")) or "\x00"


def _wait_for(check, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def two_models(tiny_llama, monkeypatch):
    # every step 10 ms: a stream of 300 tokens is still running while the test looks
    monkeypatch.setenv("RADIXSERVE_FAULTS", "slow_step_ms:10")
    srv = InProcessServer(
        "--model", f"a={tiny_llama}", "--model", f"b={tiny_llama}",
        "--dtype", "float32", "--kv-cache-memory", "0.05",
        "--memory-budget", "0.5",  # one of them (each counts ~0.37 GiB before it loads)
        "--max-load-wait", "1.5", "--idle-unload", "-1", "--grpc-port", str(free_port()),
    )  # fmt: skip
    try:
        yield srv
    finally:
        srv.stop()


def test_a_request_holds_its_model_until_its_answer_is_sent(two_models):
    url = two_models.url
    status = _status(url)
    assert [status[n]["status"] for n in "ab"] == ["unloaded", "unloaded"]
    body = {**GREEDY, "model": "a", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        card = _status(url)["a"]
        assert card["status"] == "loaded" and card["in_flight"] == 1 and card["loads"] == 1
        r = httpx.post(url + "/v1/models/unload", json={"model": "a"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy"
        # b needs a's memory, which a's stream holds: b waits, then is told to come back
        r = httpx.post(url + "/v1/completions", json={**GREEDY, "model": "b"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert int(r.headers["retry-after"]) >= 1
        assert _status(url)["a"]["in_flight"] == 1  # (still streaming)
        assert [line for line in lines if line][-1] == "data: [DONE]"
    _wait_for(lambda: _status(url)["a"]["in_flight"] == 0, "the stream's lease was kept")
    # now a is idle: b takes its place
    r = httpx.post(url + "/v1/completions", json={**GREEDY, "model": "b"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "b"
    status = _status(url)
    assert (status["a"]["status"], status["b"]["status"]) == ("unloaded", "loaded")
    assert status["a"]["memory_bytes"] == 0 and status["b"]["memory_bytes"] > 0
    assert 'model="b"' in httpx.get(url + "/metrics").text


def test_a_bad_request_for_a_model_not_loaded_loads_nothing(two_models):
    """Each route reads its body against the model's files first: its 400 (or 404) comes
    without the model being loaded, or another one unloaded for it."""
    url = two_models.url
    chat = [{"role": "user", "content": "hi"}]
    bad = [
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, None),
        ("/v1/completions", {"prompt": [10**7]}, 400, None),  # (past the vocabulary)
        ("/v1/chat/completions", {"messages": chat, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": chat, "n": 10**4}, 400, "n"),
        ("/v1/completions/render", {"prompt": "hi", "temperature": 3}, 400, "temperature"),
        ("/v1/responses", {"input": "hi", "previous_response_id": "resp_0"}, 404, None),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, 400, None),
        ("/v1/messages", {"messages": chat, "max_tokens": 10**6}, 400, None),
        ("/v1/messages/count_tokens", {"messages": []}, 400, None),
        ("/v1/embeddings", {"input": ""}, 400, "input"),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 2}}, 400, None),
        ("/v1/rerank", {"query": "q", "documents": ["d"]}, 400, None),  # (not a reranker)
        ("/v1/score", {"text_1": "q", "text_2": "d"}, 400, None),
    ]
    for path, body, status, param in bad:
        r = httpx.post(url + path, json={**body, "model": "b"}, timeout=30)
        assert r.status_code == status, (path, body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param, (path, r.text)
    # and the routes that need no engine answer without one (tokenizer and template only)
    good = [
        ("/tokenize", {"prompt": "hello world"}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
        ("/v1/messages/count_tokens", {"messages": chat}),
        ("/v1/completions/render", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/chat/completions/render", {"messages": chat}),
    ]
    cold = [httpx.post(url + path, json={**body, "model": "b"}, timeout=30) for path, body in good]
    assert [r.status_code for r in cold] == [200] * len(good), [r.text for r in cold]
    card = _status(url)["b"]
    assert (card["status"], card["loads"]) == ("unloaded", 0)
    # the same limits as the loaded model's: a good request loads it and is answered
    r = httpx.post(url + "/v1/completions", json={**GREEDY, "model": "b"}, timeout=60)
    assert r.status_code == 200 and _status(url)["b"]["loads"] == 1
    for path, body, status, _ in bad:  # (and the loaded model answers them alike)
        assert httpx.post(url + path, json={**body, "model": "b"}).status_code == status
    warm = [httpx.post(url + path, json={**body, "model": "b"}, timeout=30) for path, body in good]
    for w, c in zip(warm, cold, strict=True):  # (but each render's random request id)
        assert str(w.json()).replace(_ids(w), "") == str(c.json()).replace(_ids(c), ""), w.text


def test_keep_alive_pins_and_the_admin_routes(two_models):
    url = two_models.url

    def complete(model: str | None = None, **extra) -> httpx.Response:
        body = {**GREEDY, **extra} if model is None else {**GREEDY, "model": model, **extra}
        return httpx.post(url + "/v1/chat/completions" if "messages" in extra else
                          url + "/v1/completions", json=body, timeout=60)  # fmt: skip

    # no model: the first one; keep_alive 0 unloads it once answered, and the next request
    # without keep_alive falls back to the server's default (never, here)
    r = complete(keep_alive=0)
    assert r.status_code == 200 and r.json()["model"] == "a"
    _wait_for(lambda: _status(url)["a"]["status"] == "unloaded", "keep_alive 0 kept it")
    assert complete("a").status_code == 200
    time.sleep(0.3)
    assert _status(url)["a"]["status"] == "loaded"
    for bad in ("5x", "nan", True):
        r = complete("a", keep_alive=bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("keep_alive"), bad
    # a pinned model is not unloaded to make room, nor by hand
    r = httpx.post(url + "/v1/models/pin", json={"model": "a"})
    assert r.status_code == 200 and r.json()["pinned"] is True
    r = complete("b")
    assert r.status_code == 500 and "pinned models hold" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/models/unload", json={"model": "a"}).status_code == 409
    httpx.post(url + "/v1/models/pin", json={"model": "a", "pinned": False})
    r = httpx.post(url + "/v1/models/load", json={"model": "b"}, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    assert _status(url)["a"]["status"] == "unloaded"
    r = httpx.post(url + "/v1/models/unload", json={"model": "b"})
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    r = httpx.post(url + "/v1/models/load", json={"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = complete("nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/v1/models/b").json()["status"] == "unloaded"
    # the console's views look at a loaded model only (they never load one)
    assert httpx.get(url + "/v1/engine/stats?model=b").status_code == 503

    # gRPC names its model too: b is loaded for the call and let go after it
    with grpc.insecure_channel(f"127.0.0.1:{two_models.grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        # a bad request is refused before b is loaded for it
        loads = _status(url)["b"]["loads"]
        bad = pb.GenerateRequest(text="hi", model="b", sampling_params=pb.SamplingParams(top_p=2))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(bad, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (_status(url)["b"]["status"], _status(url)["b"]["loads"]) == ("unloaded", loads)
        params = pb.SamplingParams(max_tokens=3, temperature=0)
        request = pb.GenerateRequest(text="hello", model="b", sampling_params=params)
        out = list(stub.Generate(request, timeout=60))
        assert out[-1].finish_reason == "length" and len(out[-1].token_ids) >= 1
        card = _status(url)["b"]
        assert card["status"] == "loaded" and card["in_flight"] == 0
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi", model="nope"), timeout=30))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        # and so do Tokenize, Detokenize and GetModelInfo (each holds its model while it runs)
        assert stub.GetModelInfo(pb.GetModelInfoRequest(model="b"), timeout=30).model_name == "b"
        ids = stub.Tokenize(pb.TokenizeRequest(text="hello", model="b"), timeout=30).token_ids
        assert (
            ids
            == httpx.post(url + "/tokenize", json={"model": "b", "prompt": "hello"}).json()[
                "tokens"
            ]
        )
        text = stub.Detokenize(pb.DetokenizeRequest(token_ids=ids, model="b"), timeout=30).text
        assert "hello" in text
        assert _status(url)["b"]["in_flight"] == 0
        for call, request in (
            (stub.GetModelInfo, pb.GetModelInfoRequest(model="nope")),
            (stub.Tokenize, pb.TokenizeRequest(text="x", model="nope")),
            (stub.Detokenize, pb.DetokenizeRequest(token_ids=[1], model="nope")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=30)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    "{# the model closes it with </think> #}"
)


def _with_template(folder: Path, to: Path, template: str) -> Path:
    """A copy of a model folder with another chat template (wherever the tokenizer keeps
    it: ``chat_template.jinja`` or ``tokenizer_config.json``)."""
    shutil.copytree(folder, to)
    jinja = to / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template)
    else:
        cfg = json.loads((to / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (to / "tokenizer_config.json").write_text(json.dumps(cfg))
    return to


def test_parsers_and_adapters_are_each_models_own(tiny_llama, tmp_path):
    """``--reasoning-parser auto`` behind one server: the model whose template opens a
    thinking block gets a parser (Messages' ``thinking`` is accepted, Chat splits
    ``reasoning_content`` off), the other none (``thinking`` is a 400), whichever is first.
    A LoRA adapter loaded at run time goes onto the model the body names."""
    thinker = _with_template(tiny_llama, tmp_path / "thinker", THINKING_TEMPLATE)
    srv = InProcessServer(
        "--model", f"plain={tiny_llama}", "--model", f"thinker={thinker}",
        "--dtype", "float32", "--kv-cache-memory", "0.02", "--idle-unload", "-1",
        "--reasoning-parser", "auto",
    )  # fmt: skip
    try:
        body = {
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 2},
        }
        r = httpx.post(srv.url + "/v1/messages", json={**body, "model": "plain"}, timeout=60)
        assert r.status_code == 400 and "reasoning model" in r.text
        r = httpx.post(srv.url + "/v1/messages", json={**body, "model": "thinker"}, timeout=60)
        assert r.status_code == 200, r.text
        chat = {"max_tokens": 4, "messages": body["messages"], "temperature": 0}
        for name, split in (("plain", False), ("thinker", True)):
            r = httpx.post(
                srv.url + "/v1/chat/completions", json={**chat, "model": name}, timeout=60
            )
            assert r.status_code == 200, r.text
            assert ("reasoning_content" in r.json()["choices"][0]["message"]) == split, name

        # the console's dashboard and radix view: the model asked for, else the default
        stats = httpx.get(srv.url + "/v1/engine/stats?model=thinker").json()
        assert stats["model"] == "thinker" and stats["engine"]["steps"] > 0
        assert httpx.get(srv.url + "/v1/engine/stats").json()["model"] == "plain"
        r = httpx.get(srv.url + "/v1/engine/radix?model=thinker")
        assert r.status_code == 200 and r.json()["total_tokens"] > 0
        assert httpx.get(srv.url + "/v1/engine/stats?model=nope").status_code == 404

        from tests.engine.test_lora import make_adapter

        make_adapter(tiny_llama, tmp_path / "ad", 1)
        load = {"lora_name": "ad", "lora_path": str(tmp_path / "ad"), "model": "thinker"}
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json=load, timeout=60)
        assert r.status_code == 200 and r.json()["parent"] == "thinker", r.text
        cards = {c["id"]: c for c in httpx.get(srv.url + "/v1/models").json()["data"]}
        assert cards["ad"]["parent"] == "thinker"
        r = httpx.post(srv.url + "/v1/chat/completions", json={**chat, "model": "ad"}, timeout=60)
        assert r.status_code == 200 and "reasoning_content" in r.json()["choices"][0]["message"]
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={**load, "model": "nope"})
        assert r.status_code == 404
        r = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "ad"})
        assert r.status_code == 200, r.text
        assert "ad" not in {c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]}
    finally:
        srv.stop()
