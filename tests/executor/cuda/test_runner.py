"""The CUDA model runner end to end: greedy tokens equal to the CPU path in float32 (on CPU
tensors under the Triton interpreter in CI; on the GPU with the ``cuda`` marker), device
sampling, dummy weights from a config-only folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.executor.model_config import ModelConfig

build = pytest.importorskip("radixserve.executor.cuda.build")

REPO = Path(__file__).resolve().parents[3]
PREFIX = list(range(3, 40))  # 37 tokens: a shared prefix ending mid-page
PROMPTS = [
    [5, 6, 7],
    [*PREFIX, 50, 51],
    [*PREFIX, 60, 61, 62, 63, 64],
    list(range(100, 121)),
]


def _swap_in_cuda_runner(llm: LLM, device: torch.device, graphs: int | None = None) -> None:
    """Replace the CPU runner of an engine by the CUDA runner on ``device``."""
    eng = llm.engine
    if device.type != "cpu":
        for layer_weights in (eng.model.__dict__, *[w.__dict__ for w in eng.model.layers]):
            for name, value in list(layer_weights.items()):
                if isinstance(value, torch.Tensor):
                    layer_weights[name] = value.to(device)
        for w in eng.model.layers:
            for lin in (w.qkv, w.o, w.gate_up, w.down):
                lin.weight = lin.weight.to(device)
                lin.bias = None if lin.bias is None else lin.bias.to(device)
                lin.packed = None
        eng.model.lm_head.weight = eng.model.lm_head.weight.to(device)
        eng.model.lm_head.packed = None
    eng.runner, eng.sampler = build.build_cuda_runner(
        eng.model,
        eng.pool.num_pages,
        eng.config.page_size,
        eng.page_table,
        eng.vocab_size,
        eng.eos_token_ids,
        device,
        graphs,
        kv_cache_dtype=eng.config.kv_cache_dtype,
    )


def _greedy(llm: LLM, prompts, max_tokens=6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    first = llm.generate(prompts[:2], params, use_tqdm=False)  # warm the prefix cache
    rest = llm.generate(prompts[2:], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + rest]


def _compare(tiny_models, arch, page_size, device, graphs=None, kv_cache_dtype="auto"):
    kwargs = dict(
        dtype="float32",
        page_size=page_size,
        max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=64,  # narrow page tables: interpreted kernels cost by their width
    )
    reference = _greedy(LLM(str(tiny_models[arch]), device="cpu", **kwargs), PROMPTS)
    llm = LLM(str(tiny_models[arch]), device="cpu", **kwargs)
    _swap_in_cuda_runner(llm, torch.device(device), graphs)
    assert llm.engine.runner.kv_cache.quantized == (kv_cache_dtype == "int8")
    assert _greedy(llm, PROMPTS) == reference
    assert llm.engine.cache_stats()["hit_tokens"] >= 32  # the shared prefix was a hit


@pytest.mark.slow  # interpreted Triton kernels (CI runs it)
@pytest.mark.parametrize(
    "arch,page_size,kv_cache_dtype",
    [
        ("qwen3", 1, "auto"),
        ("gemma3", 4, "auto"),
        ("qwen3", 16, "int8"),
        # on a GPU only: under the interpreter (40 s) Llama's path runs in the graph-runner
        # and pooling tests below, Phi-3's differs from it only on the CPU side (its rotary
        # tables)
        pytest.param("llama", 16, "auto", marks=pytest.mark.cuda),
        pytest.param("phi3", 16, "auto", marks=pytest.mark.cuda),
    ],
)
def test_greedy_equals_cpu_path_float32(tiny_models, arch, page_size, kv_cache_dtype):
    """Chunked prefill (64-token budget), prefix hits mid-page, batched decodes: Qwen3 (q/k
    norms, one-token pages), Gemma 3 (sliding windows, GeGLU), Llama and Phi-3; and an int8
    KV cache (Triton's writer and readers against the CPU's C kernels)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _compare(tiny_models, arch, page_size, device, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_cpu_path_with_cuda_graphs(tiny_models, arch):
    _compare(tiny_models, arch, 16, "cuda", graphs=8)


@pytest.mark.slow  # interpreted Triton kernels (CI runs it)
def test_pooling_equals_cpu_path(tiny_models):
    """Pooling requests through the CUDA runner (last and mean, chunked, a prefix hit, a
    generation in the same steps) give the CPU runner's embeddings and tokens."""
    import numpy as np

    kwargs = dict(dtype="float32", page_size=4, max_num_batched_tokens=16, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def run(llm: LLM) -> tuple[list, list]:
        vecs = [*llm.embed(PROMPTS, "last", normalize=False), *llm.embed(PROMPTS, "mean")]
        eng = llm.engine
        eng.add_request("g", PROMPTS[3], params)
        eng.add_pooling_request("e", PROMPTS[2], "mean")
        tokens = []
        while eng.has_unfinished():
            for d in eng.step():
                tokens.extend(d.token_ids)
                if d.request_id == "e" and d.finished:
                    vecs.append(d.embedding)
        eng.check_idle()
        return vecs, tokens

    want, want_tokens = run(LLM(str(tiny_models["llama"]), device="cpu", **kwargs))
    llm = LLM(str(tiny_models["llama"]), device="cpu", **kwargs)
    _swap_in_cuda_runner(llm, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    got, tokens = run(llm)
    assert tokens == want_tokens
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_device_sampler_seeded_rows_do_not_depend_on_the_batch(tiny_models):
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", max_model_len=64)
    _swap_in_cuda_runner(llm, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=5, seed=7)
    other = SamplingParams(temperature=1.0, max_tokens=5)
    alone = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([[9, 9], [5, 6, 7], [11]], [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([[5, 6, 7]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    different = SamplingParams(temperature=1.0, max_tokens=5, seed=8)
    outs = {
        tuple(llm.generate([[5, 6, 7]], different, use_tqdm=False)[0].outputs[0].token_ids),
        tuple(alone),
    }
    assert len(outs) == 2  # the seed matters (5 draws from a 512-token vocabulary)


def test_seeded_exponential_is_exp1_and_counter_based():
    from radixserve.executor.cuda.sampler import seeded_exponential

    seeds = torch.tensor([1, 1, 2])
    index = torch.tensor([0, 1, 0])
    noise = seeded_exponential(seeds, index, 20000)
    assert noise.shape == (3, 20000) and bool((noise > 0).all())
    assert abs(noise.mean().item() - 1.0) < 0.03  # Exp(1): mean 1
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    again = seeded_exponential(seeds[[2, 0]], index[[2, 0]], 20000)
    assert torch.equal(again[1], noise[0]) and torch.equal(again[0], noise[2])


def test_dummy_weights_from_a_config_only_folder(tiny_models, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_models["qwen3"] / "config.json", folder / "config.json")
    llm = LLM(str(folder), load_format="dummy", dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate(["some text"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], params)


@pytest.mark.parametrize("name,params_billion", [("Llama-3.1-8B", 8.03), ("Qwen3-0.6B", 0.596)])
def test_shipped_configs(name, params_billion):
    cfg = ModelConfig.from_hf_dict(
        json.loads((REPO / "benchmarks" / "configs" / name / "config.json").read_text())
    )
    c = cfg
    per_layer = (
        c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        + c.num_attention_heads * c.head_dim * c.hidden_size
        + 3 * c.hidden_size * c.intermediate_size
    )
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    total = c.num_hidden_layers * per_layer + embeddings
    assert abs(total / 1e9 - params_billion) / params_billion < 0.01


def test_device_auto_is_cpu_without_a_gpu():
    from radixserve.engine.config import EngineConfig

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig(device="auto").resolved_device == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            EngineConfig(device="cuda")


def _hf_greedy_cuda(model_path, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model = model.to("cuda").eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("graphs", [True, False])
def test_engine_on_cuda_equals_transformers_on_cuda_and_the_cpu_path(tiny_models, arch, graphs):
    """The engine as users get it (--device cuda: weights moved by the loader, overlapped
    loop, CUDA graphs or eager) in float32."""
    kwargs = dict(dtype="float32", max_num_batched_tokens=64)
    cpu = _greedy(LLM(str(tiny_models[arch]), device="cpu", **kwargs), PROMPTS)
    llm = LLM(str(tiny_models[arch]), device="cuda", disable_cuda_graph=not graphs, **kwargs)
    assert llm.engine.overlap
    assert (llm.engine.runner.graphs is not None) == graphs
    assert _greedy(llm, PROMPTS) == cpu
    assert _hf_greedy_cuda(tiny_models[arch], PROMPTS, 6) == cpu
    llm.engine.close()


class _EagerReplay:
    def __init__(self, run) -> None:
        self.replay = run


@pytest.mark.slow  # many interpreted Triton launches
def test_graph_runner_static_buffers_and_padding_on_cpu(tiny_models):
    """The graph runner's replay path (static buffers, padding rows on the scratch page,
    bucket choice) with each 'graph' re-running the forward on the static buffers: the
    tokens equal the CPU path's. A real capture needs a GPU (the cuda tests above)."""
    from radixserve.executor.cuda.graph_runner import CudaGraphRunner

    class EagerGraphRunner(CudaGraphRunner):
        def capture(self) -> None:
            for bs in self.buckets:
                self.logits[bs] = self._forward(bs)
                self.graphs[bs] = _EagerReplay(
                    lambda bs=bs: self.logits[bs].copy_(self._forward(bs))
                )

    kwargs = dict(dtype="float32", page_size=16, max_num_batched_tokens=256, max_model_len=64)
    prompts = [*PROMPTS[:2], [7, 8, 9, 10, 11]]  # one batch: decodes of 3 rows, padded to 4
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = run(LLM(str(tiny_models["llama"]), device="cpu", **kwargs))
    llm = LLM(str(tiny_models["llama"]), device="cpu", **kwargs)
    _swap_in_cuda_runner(llm, torch.device("cpu"))
    runner = llm.engine.runner
    graphs = EagerGraphRunner(
        llm.engine.model,
        runner.attention,
        4,
        llm.engine.page_table.table.shape[1],
        llm.engine.pool.num_pages,
        torch.device("cpu"),
    )
    graphs.capture()
    runner.graphs = graphs
    replays = []
    real_replay = graphs.replay
    graphs.replay = lambda staged: replays.append(staged.input_ids.shape[0]) or real_replay(staged)
    assert run(llm) == reference
    assert 3 in replays  # decode steps went through the graph path, padded to 4
    assert graphs.buckets == [1, 2, 4]
