"""LoRA adapters on a live server (docs/lora.md): chosen by the request's ``model`` on
every surface (Completions, Chat, Responses, Messages, gRPC), listed in ``/v1/models``
with their parent, loaded and unloaded at run time with the admin key (a request in flight
finishes on its adapter), restricted per key by the keys file; an adapter that is not
served is the API's model-not-found error, never the base model's answer."""

from __future__ import annotations

import grpc
import httpx
import pytest

from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from tests.api.server_helpers import InProcessServer, free_port
from tests.engine.test_lora import hf_greedy_logprobs, make_adapter

pytestmark = pytest.mark.slow  # starts a server (pytest -m "not slow" leaves it out)

pytest.importorskip("peft")

KEYS = """\
alice:sk-alice-0001 loras=a1
bob:sk-bob-00002
"""
ALICE = {"authorization": "Bearer sk-alice-0001"}
BOB = {"authorization": "Bearer sk-bob-00002"}
ADMIN = {"authorization": "Bearer root-key-01"}
IDS = [5, 17, 33, 9, 100, 41]
GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def setup(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    made = {n: make_adapter(tiny_llama, root / n, seed) for n, seed in (("a1", 11), ("a2", 12))}
    keys = root / "keys"
    keys.write_text(KEYS)
    port = free_port()
    srv = InProcessServer(
        "--model", str(tiny_llama), "--dtype", "float32", "--served-model-name", "base",
        "--lora-modules", f"a1={root / 'a1'}", f"a2={root / 'a2'}",
        "--api-keys-file", str(keys), "--admin-api-key", "root-key-01",
        "--grpc-port", str(port),
    )  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield srv, pb_grpc.GenerateServiceStub(channel), made, root
    channel.close()
    srv.stop()


def _post(srv, path, body, headers=BOB):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60)


def _grpc_ids(stub, model, headers=BOB):
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=IDS),
        sampling_params=pb.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
        model=model,
    )
    metadata = [(k, v) for k, v in headers.items()]
    ids, text = [], ""
    for r in stub.Generate(req, timeout=60, metadata=metadata):
        ids += list(r.token_ids)
        text += r.text
    return ids, text


def test_models_lists_the_adapters_a_key_may_use(setup):
    srv, *_ = setup
    bob = httpx.get(srv.url + "/v1/models", headers=BOB).json()["data"]
    assert [c["id"] for c in bob] == ["base", "a1", "a2"]
    assert bob[1]["parent"] == "base" and bob[1]["root"].endswith("a1")
    alice = httpx.get(srv.url + "/v1/models", headers=ALICE).json()["data"]
    assert [c["id"] for c in alice] == ["base", "a1"]
    assert httpx.get(srv.url + "/v1/models/a2", headers=BOB).json()["parent"] == "base"
    assert httpx.get(srv.url + "/v1/models/a2", headers=ALICE).status_code == 404


def test_the_adapter_answers_on_every_surface(setup):
    srv, stub, made, _ = setup
    want, _ = hf_greedy_logprobs(made["a1"], IDS, 10)
    ids, text = _grpc_ids(stub, "a1")
    assert ids == want
    assert _grpc_ids(stub, "")[0] != want  # (the base model differs)
    r = _post(srv, "/v1/completions", {"model": "a1", "prompt": IDS, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a1" and r.json()["choices"][0]["text"] == text
    base = _post(srv, "/v1/completions", {"model": "base", "prompt": IDS, **GREEDY})
    assert base.json()["model"] == "base" and base.json()["choices"][0]["text"] != text
    messages = [{"role": "user", "content": "hello there"}]
    chat = {"model": "a2", "messages": messages, **GREEDY}
    r = _post(srv, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["model"] == "a2"
    a2_text = r.json()["choices"][0]["message"]["content"]
    r = _post(srv, "/v1/chat/completions", {**chat, "model": "a1"})
    assert r.json()["choices"][0]["message"]["content"] != a2_text
    r = _post(
        srv,
        "/v1/responses",
        {"model": "a2", "input": messages, "max_output_tokens": 10, "temperature": 0},
    )
    assert r.status_code == 200 and r.json()["model"] == "a2", r.text
    r = _post(
        srv,
        "/v1/messages",
        {"model": "a2", "messages": messages, "max_tokens": 10, "temperature": 0},
        headers={"x-api-key": "sk-bob-00002"},
    )
    assert r.status_code == 200 and r.json()["model"] == "a2", r.text


def test_an_adapter_not_served_is_model_not_found(setup):
    srv, stub, *_ = setup
    for model, headers in (("nope", BOB), ("a2", ALICE)):  # alice's key may not use a2
        r = _post(srv, "/v1/completions", {"model": model, "prompt": IDS, **GREEDY}, headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = _post(
            srv,
            "/v1/messages",
            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers,
        )
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        with pytest.raises(grpc.RpcError) as err:
            _grpc_ids(stub, model, headers)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    ok = _post(srv, "/v1/completions", {"model": "a1", "prompt": IDS, **GREEDY}, ALICE)
    assert ok.status_code == 200


def test_load_and_unload_at_run_time(setup, tmp_path):
    srv, stub, made, root = setup
    body = {"lora_name": "late", "lora_path": str(root / "a2")}
    assert _post(srv, "/v1/load_lora_adapter", body).status_code in (401, 403)  # admin only
    bad = _post(srv, "/v1/load_lora_adapter", {**body, "lora_path": str(tmp_path)}, ADMIN)
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    taken = _post(srv, "/v1/load_lora_adapter", {**body, "lora_name": "a1"}, ADMIN)
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    assert _post(srv, "/v1/load_lora_adapter", body, ADMIN).status_code == 200
    want, _ = hf_greedy_logprobs(made["a2"], IDS, 10)
    assert _grpc_ids(stub, "late")[0] == want
    # requests in flight on it (six streams) finish on it after the unload
    import threading
    from concurrent.futures import ThreadPoolExecutor

    started = threading.Barrier(7)
    long = {"model": "late", "prompt": IDS, "max_tokens": 200, "temperature": 0}

    def stream(i: int) -> list[str]:
        body = {**long, "prompt": [*IDS, i], "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", srv.url + "/v1/completions", json=body, headers=BOB, timeout=120
        ) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            first = next(lines)
            started.wait(60)
            return [first, *lines]

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(stream, i) for i in range(6)]
        started.wait(60)
        gone = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "late"}, ADMIN)
        assert gone.status_code == 200
        results = [f.result(120) for f in futures]
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in lines[-2].replace(" ", "")
    r = _post(srv, "/v1/completions", {"model": "late", "prompt": IDS, **GREEDY})
    assert r.status_code == 404
    again = _post(srv, "/v1/unload_lora_adapter", {"lora_name": "late"}, ADMIN)
    assert again.status_code == 404
    ids = [c["id"] for c in httpx.get(srv.url + "/v1/models", headers=BOB).json()["data"]]
    assert ids == ["base", "a1", "a2"]
