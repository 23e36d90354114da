"""Phi-3 against transformers, token for token (float32): fused qkv and gate_up, LongRoPE;
the rotary tables against transformers' LongRoPE frequencies in both regimes; fused weights
cut per rank."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.phi3 import Phi3ForCausalLM
from radixserve.executor.models.registry import model_class
from radixserve.executor.rotary import RotaryEmbedding
from tests.executor.test_gemma3 import assert_parallel_model_equals_whole
from tests.executor.test_models_vs_hf import NEW_TOKENS, _prompts
from tests.helpers import generate_ids, greedy, hf_greedy


def test_config_reads_phi3(tiny_models):
    config = ModelConfig.from_hf_dict(read_hf_config(tiny_models["phi3"]))
    assert model_class(config.architecture) is Phi3ForCausalLM
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == 2048
    assert config.sliding_window is None and config.layer_types == ()


@pytest.mark.parametrize("page_size", [1, 16])
def test_phi3_matches_transformers(tiny_models, page_size):
    path = tiny_models["phi3"]
    prompts = _prompts(41)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=page_size, kv_cache_memory_gb=0.01)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


def test_phi3_chunked_prefill_matches_transformers(tiny_models):
    path = tiny_models["phi3"]
    prompts = _prompts(42)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, page_size=4)
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


def test_longrope_tables_equal_transformers_in_both_regimes(tiny_models):
    """Positions below the original context rotate with transformers' short-factor
    frequencies, positions from it on with its long-factor ones; both scaled by its
    attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tiny_models["phi3"]
    hf = AutoConfig.from_pretrained(str(path))
    short, mscale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4096)
    assert not torch.allclose(short, long)
    config = ModelConfig.from_hf_dict(read_hf_config(path))
    rotary = RotaryEmbedding(
        config.head_dim, 4096, config.rope_theta, config.rope_scaling, torch.float64
    )
    for position, inv_freq in ((0, short), (7, short), (2047, short), (2048, long), (4000, long)):
        angles = position * inv_freq.double()
        expected = torch.cat([angles.cos(), angles.cos()]) * mscale
        torch.testing.assert_close(rotary.cos[position], expected, atol=2e-4, rtol=0)
        sin = angles.sin() * mscale
        torch.testing.assert_close(
            rotary.sin_signed[position], torch.cat([-sin, sin]), atol=2e-4, rtol=0
        )


def test_partial_rotary_is_refused():
    cfg = {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "partial_rotary_factor": 0.75,
    }
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("n", [2, 4])
def test_parallel_phi3_equals_the_whole_model(tiny_models, n):
    """The fused qkv_proj and gate_up_proj are cut per rank as their q/k/v and gate/up parts."""
    assert_parallel_model_equals_whole(tiny_models["phi3"], n)
