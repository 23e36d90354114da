"""Gemma 3 (text) against transformers, token for token (float32): whole prompts longer than
the 12-token window, chunked prefill, radix hits past the window; the config's layer pattern,
rotary bases and norm folding; the tensor-parallel model equal to the whole one."""

from __future__ import annotations

import threading

import pytest
import torch

from radixserve import LLM
from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.layers.norms import fold_one_plus
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.loader.sharded import ShardLayout
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.gemma3 import Gemma3ForCausalLM
from radixserve.executor.models.registry import build_model, model_class
from tests.executor.test_models_vs_hf import (
    NEW_TOKENS,
    _prompts,
    assert_window_runs_match_transformers,
)
from tests.executor.test_tensor_parallel import _prefill_batch, _ThreadGroup
from tests.helpers import generate_ids, greedy, hf_greedy


def test_config_reads_gemma3_text(tiny_models):
    config = ModelConfig.from_hf_dict(read_hf_config(tiny_models["gemma3"]))
    assert config.architecture == "Gemma3ForCausalLM"
    assert model_class(config.architecture) is Gemma3ForCausalLM
    assert config.layer_types[2] == "full_attention" and config.is_sliding(0)
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.query_pre_attn_scalar == 24 and config.qk_norm and config.tie_word_embeddings
    assert config.max_model_len == 2048  # the full context, not the window


def test_config_of_a_hub_gemma3_text_config():
    """The older hub form: no ``architectures`` (model_type gemma3_text), a
    ``sliding_window_pattern`` instead of ``layer_types``, ``rope_local_base_freq``."""
    config = ModelConfig.from_hf_dict(
        {
            "model_type": "gemma3_text",
            "vocab_size": 262144,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_hidden_layers": 18,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "max_position_embeddings": 32768,
        }
    )
    globals_ = [i for i in range(18) if not config.is_sliding(i)]
    assert globals_ == [5, 11, 17]
    assert config.rope_local_theta == 10000.0 and config.query_pre_attn_scalar == 256
    assert config.tie_word_embeddings and config.max_model_len == 32768
    specs = build_specs(config)
    assert specs[0].sliding_window == 512 and specs[5].sliding_window is None
    assert specs[0].scale == pytest.approx(256**-0.5)


def build_specs(config: ModelConfig):
    from radixserve.executor.loader.dummy import dummy_weights

    small = ModelConfig(
        **{**config.__dict__, "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8}
    )
    return Gemma3ForCausalLM(
        small, dummy_weights(small, torch.float32), torch.float32
    ).attention_specs()


def test_norms_are_folded_at_load():
    w = torch.tensor([-0.5, 0.0, 0.25])
    assert torch.equal(fold_one_plus(w), torch.tensor([0.5, 1.0, 1.25]))


@pytest.mark.parametrize("page_size", [1, 16])
def test_gemma3_matches_transformers(tiny_models, page_size):
    path = tiny_models["gemma3"]
    prompts = _prompts(31)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=page_size, kv_cache_memory_gb=0.01)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


def test_gemma3_chunked_prefill_and_radix_hits_past_the_window(tiny_models):
    assert_window_runs_match_transformers(tiny_models["gemma3"])


def test_gemma3_bfloat16_stays_close_to_float32(tiny_models):
    """bfloat16 (the C kernels' fast path) runs and mostly agrees with float32: a smoke
    check on the bfloat16 path, not an equality."""
    path = tiny_models["gemma3"]
    prompts = _prompts(32)
    ref = generate_ids(LLM(str(path), dtype="float32"), prompts, greedy(8))
    out = generate_ids(LLM(str(path), dtype="bfloat16"), prompts, greedy(8))
    same = sum(a == b for x, y in zip(ref, out, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 0.75 * 8 * len(prompts)


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_gemma3_equals_the_whole_model(tiny_models, n):
    """Each rank's part (thread-backed collectives) computes the whole model's hidden states
    and logits: the four norms and the row-parallel reductions in their places."""
    assert_parallel_model_equals_whole(tiny_models["gemma3"], n)


def assert_parallel_model_equals_whole(path, n: int) -> None:
    from safetensors.torch import load_file

    config = ModelConfig.from_hf_dict(read_hf_config(path))
    full = load_file(str(path / "model.safetensors"))
    page_size = 4
    batch = _prefill_batch([5, 19, 1], page_size)
    num_pages = int(batch.page_tables.max()) + 1
    ids, pos = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions)
    rows = torch.from_numpy(batch.logits_indices)

    def run(model):
        c = model.config
        cache = KVCache(
            c.num_hidden_layers,
            num_pages,
            page_size,
            c.num_key_value_heads,
            c.head_dim,
            torch.float32,
        )
        attention = TorchNativeAttention(
            cache, c.num_attention_heads, c.head_dim, specs=model.attention_specs()
        )
        hidden = model.forward(ids, pos, attention, attention.prepare(batch))
        return hidden, model.compute_logits(hidden[rows])

    ref_hidden, ref_logits = run(
        build_model(config, {k: v.clone() for k, v in full.items()}, torch.float32)
    )
    group = _ThreadGroup(n)
    results: list = [None] * n

    def rank_main(rank: int) -> None:
        layout = ShardLayout(config, rank, n)
        shard = {name: layout.shard_tensor(name, t) for name, t in full.items()}
        model = build_model(
            layout.local_config(),
            shard,
            torch.float32,
            layout.tensor_parallel(group.rank_view(rank)),
        )
        results[rank] = run(model)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for hidden, logits in results:
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
