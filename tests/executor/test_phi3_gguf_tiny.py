"""A tiny Phi-3 with LongRoPE written as a GGUF file the way llama.cpp's converter writes one
(fused ``attn_qkv`` and ``ffn_up`` = gate then up, the factors as ``rope_factors_long/short``
tensors, the original context and the attention factor in the metadata), loaded by radixserve
and compared with transformers on the Hugging Face folder it came from."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import LLM
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.rotary import RotaryEmbedding
from tests.executor.test_models_vs_hf import NEW_TOKENS, _prompts
from tests.helpers import generate_ids, greedy, hf_greedy, write_gguf_vocab

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_phi3_gguf(folder: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ours = ModelConfig.from_hf_dict(read_hf_config(folder))  # rope fields, whatever the version
    scaling = ours.rope_scaling
    original = scaling["original_max_position_embeddings"]
    writer = gguf.GGUFWriter(str(out), "phi3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(ours.rope_theta)
    # llama.cpp's converter: the original context and sqrt(1 + ln(s) / ln(original))
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    write_gguf_vocab(writer, tok)
    for kind in ("long", "short"):
        factors = np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_NAMES[leaf]}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor.float().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def phi3_pair(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    folder = tiny_models["phi3"]
    out = tmp_path_factory.mktemp("phi3-gguf") / "tiny-phi3.gguf"
    write_phi3_gguf(folder, out)
    return folder, out


def test_longrope_read_from_the_file_equals_the_folders(phi3_pair):
    """The file's factors, original context and attention factor give the rotary tables the
    Hugging Face config gives, below the original context and past it."""
    from radixserve.executor.loader.gguf_loader import (
        gguf_hf_config,
        gguf_tensor_names,
        read_metadata,
    )

    folder, path = phi3_pair
    hf = ModelConfig.from_hf_dict(read_hf_config(folder))
    ours = ModelConfig.from_hf_dict(
        gguf_hf_config(path, read_metadata(path), gguf_tensor_names(path))
    )
    assert ours.rope_scaling["rope_type"] == "longrope"
    assert ours.rope_scaling["original_max_position_embeddings"] == 2048
    assert ours.max_position_embeddings == hf.max_position_embeddings == 4096
    tables = [
        RotaryEmbedding(c.head_dim, 4096, c.rope_theta, c.rope_scaling, torch.float64)
        for c in (hf, ours)
    ]
    # float32 factors in the file: equal to float32 rounding of the angles
    torch.testing.assert_close(tables[1].cos, tables[0].cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(tables[1].sin_signed, tables[0].sin_signed, atol=1e-5, rtol=0)
    assert not torch.allclose(tables[1].cos[100], tables[1].cos[100 + 2048])


def test_tiny_phi3_gguf_matches_transformers(phi3_pair):
    folder, path = phi3_pair
    prompts = _prompts(61)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=4, max_num_batched_tokens=32)
    assert llm.engine.max_model_len == 4096
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected


def test_longrope_factors_without_the_original_context_are_refused(phi3_pair, tmp_path):
    from radixserve.executor.loader.gguf_loader import (
        gguf_hf_config,
        gguf_tensor_names,
        read_metadata,
    )

    _, path = phi3_pair
    meta = read_metadata(path)
    del meta["phi3.rope.scaling.original_context_length"]
    with pytest.raises(ValueError, match="original_context_length"):
        gguf_hf_config(path, meta, gguf_tensor_names(path))
