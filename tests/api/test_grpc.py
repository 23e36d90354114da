"""The gRPC API (``serve --grpc-port``), live on 127.0.0.1, driven by a Python grpc client and
compared with the HTTP API of the same server."""

from __future__ import annotations

import asyncio
import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from tests.api.server_helpers import ServerProcess, free_port

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

REPO = Path(__file__).resolve().parents[2]
PROTO = "radixserve/api/grpc/proto/radixserve/v1/generate.proto"
KEY = "grpc-test-key"


class GrpcServer:
    """A ``radixserve serve`` with ``--grpc-port``; ``stub``/``health`` use a sync channel."""

    def __init__(self, *args: str) -> None:
        self.grpc_port = free_port()
        self.http = ServerProcess(*args, "--grpc-port", str(self.grpc_port))
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.channel = grpc.insecure_channel(self.target)
        self.stub = pb_grpc.GenerateServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.http.stop()

    def engine_stats(self) -> dict[str, float]:
        text = httpx.get(self.http.url + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    def wait_engine_idle(self, timeout: float = 5.0) -> int:
        """Wait until the engine reports no request running or waiting and no KV page in
        use; the number of engine steps it took meanwhile (an aborted request stops at
        once: a few; one left running takes a step per remaining token: hundreds)."""
        deadline = time.monotonic() + timeout
        start = None
        while True:
            stats = self.engine_stats()
            start = stats["radixserve_engine_steps_total"] if start is None else start
            if (
                stats.get("radixserve_num_requests_running") == 0
                and stats.get("radixserve_num_requests_waiting") == 0
                and stats.get("radixserve_kv_cache_usage_ratio") == 0
            ):
                return int(stats["radixserve_engine_steps_total"] - start)
            assert time.monotonic() < deadline, f"requests or pages left: {stats}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def srv(tiny_llama):
    s = GrpcServer("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def guarded(tiny_llama):
    """Small capacity, no prefix cache (so an idle engine holds no pages), an API key."""
    s = GrpcServer(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--disable-radix-cache",
        "--no-engine-restart",  # engine death stays visible (restarts: test_reliability)
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--api-key",
        KEY,
    )
    yield s
    s.stop()


AUTH = (("authorization", f"Bearer {KEY}"),)


def _collect(responses) -> dict[int, dict]:
    """Per sample: joined text, token ids, logprobs, finish reason and usage."""
    out: dict[int, dict] = {}
    for r in responses:
        o = out.setdefault(
            r.index, {"text": "", "ids": [], "logprobs": [], "finish": None, "usage": None}
        )
        assert o["finish"] is None, "a message after the sample's last one"
        o["text"] += r.text
        o["ids"] += list(r.token_ids)
        o["logprobs"] += list(r.logprobs)
        if r.finish_reason:
            o["finish"], o["usage"] = r.finish_reason, r.usage
    return out


def _sse_texts(url: str, path: str, body: dict) -> dict[int, str]:
    """The joined streamed text of each choice of an HTTP SSE response."""
    import orjson

    texts: dict[int, str] = {}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in orjson.loads(line[6:])["choices"]:
                piece = ch["text"] if "text" in ch else (ch["delta"].get("content") or "")
                texts[ch["index"]] = texts.get(ch["index"], "") + piece
    return texts


def test_checked_in_stubs_are_what_the_proto_generates(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(REPO / PROTO),
        ],
        check=True,
    )
    folder = Path(PROTO).parent
    for name in ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / folder / name, REPO / folder / name, shallow=False), name


def test_greedy_stream_equals_http(srv):
    prompt = "Paris is the capital of France; Berlin is the capital"
    sampling = dict(max_tokens=12, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(text=prompt, sampling_params=pb.SamplingParams(**sampling))
    out = _collect(srv.stub.Generate(req, timeout=60))[0]
    assert out["finish"] == "length" and len(out["ids"]) == 12
    http_text = _sse_texts(srv.http.url, "/v1/completions", {"prompt": prompt, **sampling})
    assert out["text"] == http_text[0]
    native = httpx.post(
        srv.http.url + "/generate", json={"text": prompt, "sampling_params": sampling}
    ).json()
    assert out["ids"] == native["output_ids"]
    prompt_ids = httpx.post(srv.http.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert out["usage"].prompt_tokens == len(prompt_ids)
    assert out["usage"].completion_tokens == 12
    # token ids in, the same tokens out; Tokenize/Detokenize agree with HTTP
    tok = srv.stub.Tokenize(pb.TokenizeRequest(text=prompt))
    assert list(tok.token_ids) == prompt_ids and tok.count == len(prompt_ids)
    by_ids = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids), sampling_params=pb.SamplingParams(**sampling)
    )
    again = _collect(srv.stub.Generate(by_ids))[0]
    assert again["ids"] == out["ids"]
    assert again["usage"].cached_tokens > 0  # the same prompt ran before: a prefix-cache hit
    assert srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=out["ids"])).text == out["text"]
    info = srv.stub.GetModelInfo(pb.GetModelInfoRequest())
    model = httpx.get(srv.http.url + "/v1/models").json()["data"][0]
    assert (info.model_name, info.max_model_len) == (model["id"], model["max_model_len"])


def test_seeded_samples_and_logprobs_equal_http(srv):
    prompt = "The quick brown"
    sampling = dict(max_tokens=10, temperature=1.0, seed=11, n=3, ignore_eos=True)
    req = pb.GenerateRequest(text=prompt, sampling_params=pb.SamplingParams(**sampling, logprobs=2))
    out = _collect(srv.stub.Generate(req, timeout=60))
    http = httpx.post(
        srv.http.url + "/v1/completions", json={"prompt": prompt, **sampling, "logprobs": 2}
    ).json()
    assert len({o["text"] for o in out.values()}) > 1  # seeded samples differ from each other
    for choice in http["choices"]:
        o = out[choice["index"]]
        assert o["text"] == choice["text"]
        lp = choice["logprobs"]
        assert [x.token for x in o["logprobs"]] == lp["tokens"]
        assert [x.logprob for x in o["logprobs"]] == pytest.approx(lp["token_logprobs"])
        assert all(len(x.top_logprobs) == 2 for x in o["logprobs"])
        assert [x.token_id for x in o["logprobs"]] == o["ids"]


def test_chat_and_stop_equal_http(srv):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    sampling = dict(max_tokens=8, temperature=0, ignore_eos=True)
    req = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]),
        sampling_params=pb.SamplingParams(**sampling),
    )
    out = _collect(srv.stub.Generate(req))[0]
    http = _sse_texts(srv.http.url, "/v1/chat/completions", {"messages": messages, **sampling})
    assert out["text"] == http[0] and out["finish"] == "length"
    tok = srv.stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=req.chat.messages)))
    http_tok = httpx.post(srv.http.url + "/tokenize", json={"messages": messages}).json()
    assert list(tok.token_ids) == http_tok["tokens"]
    assert out["usage"].prompt_tokens == tok.count
    # a stop string ends the sample where HTTP ends it
    stop = out["text"][3:6]
    stopped = pb.GenerateRequest(
        chat=req.chat, sampling_params=pb.SamplingParams(**sampling, stop=[stop])
    )
    got = _collect(srv.stub.Generate(stopped))[0]
    assert got["finish"] == "stop" and got["text"] == out["text"][: out["text"].index(stop)]


def _sp(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


BAD = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids.ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token_ids.ids"),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(max_tokens=0)),
        "sampling_params.max_tokens",
    ),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(max_tokens=100000)),
        "sampling_params.max_tokens",
    ),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(temperature=-1)),
        "sampling_params.temperature",
    ),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(temperature=2.5)),
        "sampling_params.temperature",
    ),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(top_p=0)), "sampling_params.top_p"),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(top_k=-5)), "sampling_params.top_k"),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(n=0)), "sampling_params.n"),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(n=1000)), "sampling_params.n"),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(logprobs=50)), "sampling_params.logprobs"),
    (pb.GenerateRequest(text="hi", sampling_params=_sp(stop=["x"] * 17)), "sampling_params.stop"),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(min_tokens=20, max_tokens=4)),
        "sampling_params.min_tokens",
    ),
    (
        pb.GenerateRequest(text="hi", sampling_params=_sp(logit_bias={5: 500.0})),
        "sampling_params.logit_bias",
    ),
    (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    (
        pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])),
        "chat.messages.0.role",
    ),
    (
        pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]),
            sampling_params=_sp(logprobs=21),
        ),
        "sampling_params.logprobs",
    ),
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(srv, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub.Generate(request_, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}: "), info.value.details()


def test_other_bad_calls_and_message_size(srv):
    with pytest.raises(grpc.RpcError) as info:
        srv.stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 100000]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("token_ids: ")
    with pytest.raises(grpc.RpcError) as info:
        srv.stub.Tokenize(pb.TokenizeRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    huge = pb.GenerateRequest(text="a" * (8 * 2**20 + 16))  # over the 8 MiB default limit
    with pytest.raises(grpc.RpcError) as info:
        list(srv.stub.Generate(huge, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # still serving
    ok = srv.stub.Generate(pb.GenerateRequest(text="hi", sampling_params=_sp(max_tokens=2)))
    assert _collect(ok)[0]["finish"] in ("length", "stop")


def test_200_concurrent_streams_complete(srv):
    async def main() -> list[dict]:
        async with grpc.aio.insecure_channel(srv.target) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)

            async def one(i: int) -> dict:
                req = pb.GenerateRequest(
                    text=f"request {i}",
                    sampling_params=_sp(max_tokens=4, temperature=0, ignore_eos=True),
                )
                return _collect([r async for r in stub.Generate(req, timeout=120)])[0]

            return await asyncio.gather(*(one(i) for i in range(200)))

    outs = asyncio.run(main())
    assert len(outs) == 200
    assert all(o["finish"] == "length" and len(o["ids"]) == 4 for o in outs)
    assert all(o["usage"].completion_tokens == 4 for o in outs)


def test_sigterm_drains_streams_in_flight(srv):
    """(Stops ``srv``: the last test on it.) SIGTERM lets a running gRPC stream finish, then
    the server exits 0."""
    req = pb.GenerateRequest(
        text="drain", sampling_params=_sp(max_tokens=300, temperature=0, ignore_eos=True)
    )
    call = srv.stub.Generate(req, timeout=60)
    first = next(call)
    srv.http.proc.send_signal(signal.SIGTERM)
    out = _collect([first, *call])[0]
    assert out["finish"] == "length" and len(out["ids"]) == 300
    assert srv.http.proc.wait(30) == 0


def test_health_serving_and_api_key(guarded):
    check = guarded.health.Check(health_pb2.HealthCheckRequest(service=""))  # no key needed
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    named = health_pb2.HealthCheckRequest(service="radixserve.v1.GenerateService")
    assert guarded.health.Check(named).status == health_pb2.HealthCheckResponse.SERVING
    req = pb.GenerateRequest(text="hi", sampling_params=_sp(max_tokens=2))
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as info:
            list(guarded.stub.Generate(req, metadata=metadata))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            guarded.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _collect(guarded.stub.Generate(req, metadata=AUTH))[0]["finish"] is not None


def _long(rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        text="count",
        sampling_params=_sp(max_tokens=2000, ignore_eos=True),
    )


def test_cancel_mid_stream_and_abort_free_the_engine(guarded):
    call = guarded.stub.Generate(_long(), metadata=AUTH)
    got = [next(call) for _ in range(3)]
    assert all(not r.finish_reason for r in got)
    assert guarded.engine_stats()["radixserve_num_requests_running"] == 1
    call.cancel()
    assert guarded.wait_engine_idle() < 50

    # Abort by request id: the stream ends with finish_reason "abort"
    call = guarded.stub.Generate(_long("mine"), metadata=AUTH)
    first = next(call)
    assert first.request_id == "mine"
    with pytest.raises(grpc.RpcError) as info:  # the id is taken while it runs
        list(guarded.stub.Generate(_long("mine"), metadata=AUTH))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert guarded.stub.Abort(pb.AbortRequest(request_id="mine"), metadata=AUTH).found
    rest = _collect([first, *call])[0]
    assert rest["finish"] == "abort" and len(rest["ids"]) < 2000
    assert not guarded.stub.Abort(pb.AbortRequest(request_id="mine"), metadata=AUTH).found
    assert guarded.wait_engine_idle() < 50


def test_deadline_aborts_in_the_engine(guarded):
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for r in guarded.stub.Generate(_long(), metadata=AUTH, timeout=0.5):
            got.append(r)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got and not any(r.finish_reason for r in got)  # it ran, and was cut off
    assert guarded.wait_engine_idle() < 50


def test_overload_is_resource_exhausted(guarded):
    async def main() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(guarded.target) as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            req = pb.GenerateRequest(
                text="count", sampling_params=_sp(max_tokens=100, ignore_eos=True)
            )

            async def one() -> grpc.StatusCode:
                try:
                    async for _ in stub.Generate(req, metadata=AUTH, timeout=60):
                        pass
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            return await asyncio.gather(*(one() for _ in range(6)))

    codes = asyncio.run(main())
    # at most 2 run and 1 waits (--max-num-seqs 2, --max-waiting-requests 1); the rest are
    # refused at once, and the admitted ones complete
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) <= 3
    guarded.wait_engine_idle()


def test_engine_death_flips_health_and_is_unavailable(guarded):
    call = guarded.stub.Generate(_long(), metadata=AUTH)
    assert not next(call).finish_reason
    os.kill(guarded.http.engine_pid(), signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:  # the stream in flight ends UNAVAILABLE
        list(call)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    deadline = time.monotonic() + 2.0
    request = health_pb2.HealthCheckRequest(service="")
    while guarded.health.Check(request).status != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING within 2 s"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as info:
        list(guarded.stub.Generate(pb.GenerateRequest(text="hi"), metadata=AUTH))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_taken_grpc_port_fails_startup(tiny_llama):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "radixserve.cli",
                "serve",
                "--model",
                str(tiny_llama),
                "--port",
                str(free_port()),
                "--grpc-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0
    assert f"could not bind the gRPC port 127.0.0.1:{port}" in proc.stderr + proc.stdout
