"""One request, three entry points: the offline API, HTTP and gRPC build the same
``SamplingParams`` (the model's generation_config.json defaults included) and produce the
same greedy tokens. The model here asks for greedy decoding in its generation config, so a
request that leaves ``temperature`` unset is greedy everywhere (``--generation-config
auto``) and sampled with ``neutral``."""

from __future__ import annotations

import asyncio
import json
import shutil
import types

import httpx
import pytest

from radixserve import LLM
from radixserve.api.auth import ApiKeys
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.service import GenerateServicer
from radixserve.api.openai import converter as cv
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.serving import protocol as p
from radixserve.serving.frontend import Frontend
from tests.api.test_grpc import GrpcServer, _collect

GENERATION_CONFIG = {
    "eos_token_id": 2,
    "do_sample": False,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
}
PROMPT = "Paris is the capital of France; Berlin is"
MESSAGES = [{"role": "user", "content": "Name a city."}]


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("defaults") / "llama"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), dtype="float32")


def _frontend(model, llm: LLM, mode: str = "auto") -> Frontend:
    """A frontend as a server has it once its engine reported ready (nothing started)."""
    frontend = Frontend(EngineConfig(model=str(model), dtype="float32", generation_config=mode))
    engine = llm.engine
    defaults = engine.inputs.defaults if mode == "auto" else {}
    frontend.client.ready = p.Ready("m", engine.vocab_size, engine.max_model_len, defaults)
    return frontend


def test_sampling_params_are_the_same_from_every_entry_point(model, llm):
    frontend = _frontend(model, llm)
    server = types.SimpleNamespace(frontend=frontend, config=ServerConfig(), keys=ApiKeys(()))
    servicer = GenerateServicer(server)  # type: ignore[arg-type]

    offline = llm.engine.default_sampling_params(max_tokens=8, stop=["."], seed=3)
    assert (offline.temperature, offline.top_p, offline.top_k) == (0.0, 0.9, 20)
    assert offline.repetition_penalty == 1.05

    body = cv.parse_body(
        CompletionRequest, {"prompt": PROMPT, "max_tokens": 8, "stop": ".", "seed": 3}
    )
    http = cv.sampling_params(frontend, body, 8, ServerConfig())
    request = pb.GenerateRequest(
        text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=8, stop=["."], seed=3)
    )

    async def grpc_side() -> tuple[list[int], SamplingParams]:
        return await servicer._prompt(request, frontend)

    ids, grpc = asyncio.run(grpc_side())
    assert http == offline and grpc == offline
    assert ids == llm.engine.inputs.prompt_ids(PROMPT, offline)

    # a field the request sets wins over the model's default, on every path
    chat_body = cv.parse_body(
        ChatCompletionRequest, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.5}
    )
    assert cv.sampling_params(frontend, chat_body, 8, ServerConfig()) == (
        llm.engine.default_sampling_params(max_tokens=8, temperature=0.5)
    )

    # one chat template path: the offline API and the server render the same ids
    chat_ids = asyncio.run(cv.chat_prompt(frontend, chat_body))
    assert chat_ids == llm.apply_chat_template(MESSAGES)

    # neutral: the model's defaults are not applied (OpenAI-style temperature 1, top_p 1)
    neutral = cv.sampling_params(_frontend(model, llm, "neutral"), body, 8, ServerConfig())
    assert neutral == SamplingParams(max_tokens=8, stop=["."], seed=3)


@pytest.mark.slow
def test_greedy_tokens_are_the_same_from_every_entry_point(model, llm):
    """No temperature anywhere: the model's do_sample=false makes all three greedy."""
    expected = llm.generate(PROMPT, llm.engine.default_sampling_params(max_tokens=10))[0]
    assert len(expected.token_ids) > 0
    srv = GrpcServer("--model", str(model), "--dtype", "float32")
    try:
        http = httpx.post(
            srv.http.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 10},
            timeout=60,
        ).json()["choices"][0]
        req = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=10))
        grpc = _collect(srv.stub.Generate(req, timeout=60))[0]
        native = httpx.post(
            srv.http.url + "/generate",
            json={"text": PROMPT, "sampling_params": {"max_tokens": 10}},
            timeout=60,
        ).json()
        assert grpc["ids"] == expected.token_ids == native["output_ids"]
        assert http["text"] == expected.text == grpc["text"]
    finally:
        srv.stop()
