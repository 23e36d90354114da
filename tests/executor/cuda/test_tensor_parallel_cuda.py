"""Tensor parallelism on the CUDA path: the CUDA runner (Triton kernels, device sampler) on
every rank. Without a GPU it runs on CPU tensors under Triton's interpreter over gloo (TP=2:
rank 0 here, rank 1 a worker process that inherits TRITON_INTERPRET); the ``cuda``-marked
test runs a one-rank group over NCCL on a GPU. float32 throughout (bfloat16 is wrong under
the interpreter)."""

from __future__ import annotations

import json

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.executor.distributed import TensorParallelGroup, WorkerSpec
from radixserve.executor.loader.dummy import dummy_weights
from radixserve.executor.loader.sharded import ShardLayout
from radixserve.executor.models.base import CausalLM
from radixserve.executor.models.registry import build_model
from tests.helpers import greedy, hf_greedy

build = pytest.importorskip("radixserve.executor.cuda.build")
from radixserve.executor.cuda.layer_ops import TritonLayerOps  # noqa: E402
from radixserve.executor.cuda.runner import CudaModelRunner  # noqa: E402
from radixserve.executor.cuda.tp_runner import CudaTPModelRunner  # noqa: E402

pytestmark = pytest.mark.slow  # starts process groups (pytest -m "not slow" leaves it out)

PREFIX = list(range(3, 24))  # 21 tokens: a shared prefix ending mid-page (page size 4)
PROMPTS = [[*PREFIX, 40, 41], [5, 6, 7], [*PREFIX, 50, 51, 52], list(range(60, 75))]
NEW_TOKENS = 4
GPU = torch.cuda.is_available()
KWARGS = dict(
    dtype="float32",
    runner="cuda",
    page_size=4,
    max_num_batched_tokens=16,  # the 23-token prompts prefill in chunks
    max_num_seqs=4,
    kv_cache_memory_gb=0.01,
    max_model_len=64,
)


def _greedy_warm(llm: LLM) -> list[list[int]]:
    """The first prompt alone (its prefix enters the radix tree), then the rest at once
    (page accounting checked at the end)."""
    first = llm.generate(PROMPTS[:1], greedy(NEW_TOKENS), use_tqdm=False)
    rest = llm.generate(PROMPTS[1:], greedy(NEW_TOKENS), use_tqdm=False)
    hits = llm.engine.cache_stats()["hit_tokens"]
    assert hits >= 20, hits  # the shared prefix was a hit
    llm.engine.check_idle()
    return [o.token_ids for o in first + rest]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_cuda_runner_equals_tp1_and_transformers(tiny_models, arch):
    """Llama with GQA (4 heads, 2 kv heads: one per rank), untied LM head, vocabulary split
    256 + 256; Qwen3 with q/k norm; chunked prefill and a prefix hit; every rank on the
    CUDA runner's code."""
    path = tiny_models[arch]
    device = "cuda" if GPU else "cpu"
    tp1 = LLM(str(path), device=device, **KWARGS)
    assert type(tp1.engine.runner) is CudaModelRunner
    reference = _greedy_warm(tp1)
    reference_logprobs = _logprobs(tp1)
    tp1.engine.close()
    assert reference == hf_greedy(path, PROMPTS, NEW_TOKENS)

    if GPU and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on cuda needs two GPUs")
    tp2 = LLM(str(path), device=device, tensor_parallel_size=2, **KWARGS)
    try:
        runner = tp2.engine.runner
        assert isinstance(runner, CudaTPModelRunner) and runner.graphs is None
        assert runner.tp.group.backend == ("nccl" if GPU else "gloo")
        assert isinstance(tp2.engine.model.ops, TritonLayerOps)
        assert tp2.engine.model.tp.world_size == 2
        assert tp2.engine.model.config.num_key_value_heads == 1  # this rank's
        assert _greedy_warm(tp2) == reference
        # sampled-row and prompt logprobs: gathered logits of the sampled rows and prompt
        # chunks (ModelRunner.prompt_logits on every rank)
        for x, y in zip(reference_logprobs, _logprobs(tp2), strict=True):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
                assert lx.token_id == ly.token_id
                assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4)
                assert [t for t, _ in lx.top] == [t for t, _ in ly.top]
            assert len(x.prompt_logprobs) == len(y.prompt_logprobs) > 1
            for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
                assert px.logprob == pytest.approx(py.logprob, abs=1e-4)
    finally:
        tp2.engine.close()


def _logprobs(llm: LLM):
    params = SamplingParams(
        temperature=0.0, max_tokens=2, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    return llm.generate(PROMPTS[1:3], params, use_tqdm=False)


class _OneRank:
    """The collectives of a one-rank group (nothing to sum or gather)."""

    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]


def test_a_worker_follows_steps_with_the_runner_rank0_uses(tiny_models):
    """``spec.runner`` picks the worker's runner: the CUDA one (Triton ops behind the
    all-reduce, KV of rank 0's size with the scratch page, no sampler, no graphs)."""
    from radixserve.executor.model_config import ModelConfig
    from radixserve.executor.model_runner import ModelRunner
    from radixserve.executor.worker import worker_runner

    path = tiny_models["llama"]
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    layout = ShardLayout(config, 0, 1)

    def model() -> CausalLM:
        return build_model(
            layout.local_config(),
            dummy_weights(config, torch.float32),
            torch.float32,
            layout.tensor_parallel(_OneRank()),
        )

    spec = WorkerSpec(kind="hf", path=str(path), world_size=1, runner="cuda")
    runner = worker_runner(spec, model(), num_pages=9, page_size=4)
    assert type(runner) is CudaModelRunner and runner.graphs is None and runner.sampler is None
    assert isinstance(runner.model.ops, TritonLayerOps)
    assert runner.kv_cache.num_pages == 9
    cpu = worker_runner(WorkerSpec(kind="hf", path=str(path), world_size=1), model(), 9, 4)
    assert type(cpu) is ModelRunner and not isinstance(cpu.model.ops, TritonLayerOps)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=["gloo", "nccl"]
)
def test_one_rank_group_over_the_tensor_backend_equals_the_plain_runner(tiny_models, device):
    """Rank 0's TP path with a group of one (NCCL on a GPU: the only NCCL a one-GPU machine
    can run; gloo here): the CUDA TP runner's greedy tokens equal the plain CUDA runner's."""
    path = tiny_models["qwen3"]  # q/k norm
    kwargs = {**KWARGS, "device": device, "disable_cuda_graph": True}
    reference = _greedy_warm(LLM(str(path), **kwargs))
    spec = WorkerSpec(
        kind="hf", path=str(path), world_size=1, dtype="float32", device=device, runner="cuda"
    )
    tp = TensorParallelGroup(spec)
    try:
        assert tp.group.backend == ("nccl" if device == "cuda" else "gloo")
        llm = LLM(str(path), **kwargs)
        eng = llm.engine
        eng.model = tp.loaded.model
        eng.runner, eng.sampler = build.build_cuda_runner(
            eng.model,
            eng.pool.num_pages,
            KWARGS["page_size"],
            eng.page_table,
            eng.vocab_size,
            eng.eos_token_ids,
            tp.group.device,
            8,  # asked for graphs: off under TP
            tp,
        )
        assert isinstance(eng.runner, CudaTPModelRunner) and eng.runner.graphs is None
        try:
            assert _greedy_warm(llm) == reference
        finally:
            eng.close()
    finally:
        tp.close()
