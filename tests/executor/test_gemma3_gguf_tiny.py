"""A tiny Gemma 3 written as a GGUF file the way llama.cpp's converter writes one (its
tensor names, norms stored as 1 + w, no layer pattern or local rope base in the metadata),
loaded by radixserve and compared with transformers on the Hugging Face folder it came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from radixserve import LLM
from tests.conftest import build_tiny_model
from tests.executor.test_models_vs_hf import NEW_TOKENS, _prompts
from tests.helpers import generate_ids, greedy, hf_greedy, write_gguf_vocab

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gemma3_gguf(folder: Path, out: Path) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    writer = gguf.GGUFWriter(str(out), "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(config.sliding_window)
    write_gguf_vocab(writer, tok)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter stores Gemma's 1 + w
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, leaf = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{_NAMES[leaf]}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gemma3_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gemma3-gguf")
    # what a GGUF file implies: six layers in the default pattern (layer 5 global), the
    # attention scaled by head_dim ** -0.5 (llama.cpp's rule for every Gemma 3 but 27B)
    folder = build_tiny_model(
        root / "hf", "gemma3", num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32
    )
    out = root / "tiny-gemma3.gguf"
    write_gemma3_gguf(folder, out)
    return folder, out


def test_tiny_gemma3_gguf_matches_transformers(gemma3_pair):
    folder, path = gemma3_pair
    prompts = _prompts(51)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(path), dtype="float32", page_size=4, max_num_batched_tokens=32)
    config = llm.engine.model_config
    assert [config.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert config.rope_local_theta == 10000.0 and config.tie_word_embeddings
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected
