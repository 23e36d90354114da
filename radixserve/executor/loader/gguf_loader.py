"""A GGUF file as a Hugging Face config dict, HF-named float tensors and tokenizer metadata."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFContents:
    """What a GGUF file holds, in Hugging Face terms.

    Invariant: ``weights`` use Hugging Face tensor names and layouts (llama.cpp's q/k row
    permutation undone), as float32.
    """

    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    metadata: dict[str, Any]  # every scalar / list field, by GGUF key
    tensor_types: dict[str, str]  # GGML type name (F32, Q8_0, Q4_K ...) by Hugging Face name


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # malformed field: keep going, callers check what they need
        return None


def open_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError, struct.error, IndexError, ...
        raise ValueError(f"cannot read {path}: corrupt or not a GGUF file ({exc})") from None


def read_metadata(path: Path, skip_tokens: bool = False) -> dict[str, Any]:
    reader = open_reader(path)
    big = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    return {
        key: _field_value(field)
        for key, field in reader.fields.items()
        if not (skip_tokens and key in big)
    }


def _reverse_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope → Hugging Face rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def load_gguf(
    path: Path,
    select: Callable[[dict[str, Any]], Callable[[str, torch.Tensor], torch.Tensor]] | None = None,
) -> GGUFContents:
    """The whole file as float32 tensors. ``select(hf_config)``, if given, returns a function
    applied to each tensor as soon as it is decoded (name, tensor → the part to keep), so
    only one whole tensor is in memory at a time (tensor-parallel shards)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = open_reader(path)
    meta = {key: _field_value(field) for key, field in reader.fields.items()}
    hf_config = gguf_hf_config(path, meta, {t.name for t in reader.tensors})
    arch = meta["general.architecture"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config["num_key_value_heads"]
    keep = select(hf_config) if select is not None else None

    weights: dict[str, torch.Tensor] = {}
    tensor_types: dict[str, str] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r}")
        try:
            if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = np.asarray(tensor.data, dtype=np.float32)
            else:
                array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ValueError(f"{path}: cannot decode tensor {tensor.name}: {exc}") from None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        t = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            t = _reverse_permute(t, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            t = _reverse_permute(t, kv_heads)
        weights[name] = t if keep is None else keep(name, t)
        tensor_types[name] = tensor.tensor_type.name
    return GGUFContents(
        hf_config=hf_config, weights=weights, metadata=meta, tensor_types=tensor_types
    )


def gguf_hf_config(path: Path, meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    hidden = int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    hf_config = {
        "architectures": [_ARCHITECTURES[arch]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(meta.get(f"{arch}.attention.key_length") or hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    if arch == "qwen2":
        hf_config["attention_bias"] = True
    return hf_config


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    if gguf_name.startswith("rope_"):
        return f"rotary_emb.{gguf_name}"  # precomputed rope tables: dropped by the model
    return None
