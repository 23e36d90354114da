"""A GGUF file as a Hugging Face config dict, HF-named float tensors and tokenizer metadata."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixserve.executor.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf_metadata

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# a ``llama`` file with experts is a Mixtral
_LLAMA_MOE = "MixtralForCausalLM"
# llama.cpp's rule for each MoE family's top-k weights (``expert_weights_norm`` in newer
# files says so itself): renormalised for Qwen3-MoE and Mixtral, not for Qwen2-MoE, OLMoE
_NORM_TOPK = {"qwen3moe": True, "llama": True, "qwen2moe": False, "olmoe": False, "gpt-oss": False}

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
    # mixtures of experts: the router, the shared expert and its gate (the experts' stacked
    # tensors are split per expert: ``_expert_slices``)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}

# Gemma 3 names its four norms differently (ffn_norm is the pre-MLP norm there)
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 keeps q/k/v and gate/up fused (llama.cpp's ffn_up holds gate then up)
_PHI3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
# gpt-oss: a post-attention norm (not ffn_norm), sinks, biases on o and the router
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate_inp.bias": "mlp.gate.bias",
}
_LAYER_TABLES = {
    "gemma3": _GEMMA3_LAYER_NAMES,
    "phi3": _PHI3_LAYER_NAMES,
    "gpt-oss": _GPT_OSS_LAYER_NAMES,
}

# What llama.cpp assumes of Gemma 3 files and they do not carry: every 6th layer global,
# the sliding layers' rotary base 10000
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE = 6, 10000.0
# end-of-turn tokens llama.cpp stops at besides the file's EOS, by architecture
_END_OF_TURN = {
    "gemma3": ("<end_of_turn>",),
    "phi3": ("<|end|>",),
    "gpt-oss": ("<|return|>", "<|call|>"),  # a reply's end, and a tool call's
}

_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# one expert's matrix: old Mixtral files store them so, and ``_expert_slices`` names the
# slices of a stacked ``ffn_*_exps`` tensor so
_EXPERT_RE = re.compile(r"ffn_(gate|up|down)\.(\d+)\.(weight|bias)")
_STACKED_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")


@dataclass
class GGUFContents:
    """What a GGUF file holds, in Hugging Face terms.

    Invariant: ``weights`` use Hugging Face tensor names and layouts (llama.cpp's q/k row
    permutation undone), as float32 (bfloat16 for the embedding and LM head of a group-code
    type with ``codes`` loading); with ``codes`` loading, the dense-layer tensors built
    from their codes are placeholders on the meta device in ``weights`` and their layers
    are in ``linears`` (by the name of their fused group's first tensor).
    """

    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    metadata: dict[str, Any]  # every scalar / list field, by GGUF key
    tensor_types: dict[str, str]  # GGML type name (F32, Q8_0, Q4_K ...) by Hugging Face name
    linears: dict[str, Any] = field(default_factory=dict)


def read_metadata(path: Path, skip_tokens: bool = False) -> dict[str, Any]:
    """Every metadata key of the GGUF file at ``path`` (the header only; a 262k-token
    vocabulary in ~0.2 s). ``skip_tokens`` drops the vocabulary arrays."""
    meta = read_gguf_metadata(path)
    if skip_tokens:
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            meta.pop(key, None)
    return meta


def gguf_tensor_names(path: Path) -> set[str]:
    """The GGUF names of the file's tensors."""
    return {t.name for t in GGUFFile(path).tensors}


def _reverse_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope → Hugging Face rotate-half)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _expert_slices(tensors: list[GGUFTensorInfo]) -> list[GGUFTensorInfo]:
    """``tensors`` with each stacked expert tensor (``blk.N.ffn_gate_exps.weight``
    [experts, rows, cols], llama.cpp's layout since 2024; gpt-oss's biases [experts, rows])
    replaced by one tensor per expert (``blk.N.ffn_gate.E.weight``), each a view of its
    slice of the file's bytes."""
    out = []
    for t in tensors:
        m = _STACKED_RE.fullmatch(t.name)
        if m is None:
            out.append(t)
            continue
        kind = m.group(3)
        if len(t.shape) != (3 if kind == "weight" else 2):
            raise ValueError(f"expert tensor {t.name} has shape {t.shape}: not one per expert")
        experts, shape = t.shape[0], t.shape[1:]
        per = t.data.size // experts
        for e in range(experts):
            name = f"blk.{m.group(1)}.ffn_{m.group(2)}.{e}.{kind}"
            out.append(GGUFTensorInfo(name, shape, t.ggml_type, t.data[e * per : (e + 1) * per]))
    return out


def load_gguf(
    path: Path,
    select: Callable[[dict[str, Any]], Callable[[str, torch.Tensor], torch.Tensor]] | None = None,
    codes: bool = False,
) -> GGUFContents:
    """The whole file as float32 tensors. ``select(hf_config)``, if given, returns a function
    applied to each tensor as soon as it is decoded (name, tensor → the part to keep), so
    only one whole tensor is in memory at a time (tensor-parallel shards).

    ``codes``: the decoder layers' dense weights whose every fused part has a group-code
    type (``gguf_codes.CODE_TYPES``) go straight from the file's blocks (read through the
    memory map) into the layer that executes them (``quant.linear_from_codes``), never
    through float32; the rest as above."""
    gguf_file = GGUFFile(path)
    meta = gguf_file.metadata
    hf_config = gguf_model_config(path, gguf_file)
    arch = meta["general.architecture"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config["num_key_value_heads"]
    keep = select(hf_config) if select is not None else None

    weights: dict[str, torch.Tensor] = {}
    tensor_types: dict[str, str] = {}
    tensors = _expert_slices(gguf_file.tensors)
    by_hf = {_hf_name(t.name, arch): t for t in tensors}
    groups = _code_groups(by_hf) if codes and keep is None else {}
    linears: dict[str, Any] = {}

    def build_group(first: str) -> None:
        from radixserve.executor.loader.gguf_codes import concat_codes, decode_codes
        from radixserve.executor.quant import linear_from_codes

        parts = []
        for name in groups[first]:
            info = by_hf[name]
            part = decode_codes(info.data, info.type_name, info.shape)
            if arch == "llama" and name.endswith(("self_attn.q_proj.weight", "k_proj.weight")):
                n_heads = heads if name.endswith("q_proj.weight") else kv_heads
                index = _reverse_permute(torch.arange(part.shape[0])[:, None], n_heads)[:, 0]
                part = part.permute_rows(index)
            parts.append(part)
        linears[first] = linear_from_codes(concat_codes(parts))
        for name in groups[first]:
            gguf_file.release(by_hf[name])

    coded = {name: first for first, names in groups.items() for name in names}
    _build_groups_in_parallel(groups, build_group, by_hf, path)
    # the LM head (the embedding table when tied) from its codes too: at decode it is the
    # largest matrix a step reads (Gemma 3: 262k x 640)
    head_source = "lm_head.weight" if "lm_head.weight" in by_hf else "model.embed_tokens.weight"
    head = by_hf.get(head_source) if codes and keep is None else None
    if head is not None and len(head.shape) == 2 and _codes_type(head.type_name):
        from radixserve.executor.loader.gguf_codes import decode_codes
        from radixserve.executor.quant import linear_from_codes

        linears["lm_head.weight"] = linear_from_codes(
            decode_codes(head.data, head.type_name, head.shape)
        )
        tensor_types["lm_head.weight"] = head.type_name
        gguf_file.release(head)
    for tensor in tensors:
        if tensor.name == "rope_freqs.weight":  # per-frequency rope divisors (llama3)
            factors = gguf_file.dequantize(tensor).reshape(-1).tolist()
            hf_config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
            continue
        name = _hf_name(tensor.name, arch)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r}")
        if name == "lm_head.weight" and name in linears:
            weights[name] = torch.empty(tensor.shape, device="meta")
            continue
        if name in coded:
            if coded[name] not in linears:
                try:
                    build_group(coded[name])
                except ValueError as exc:
                    raise ValueError(f"{path}: cannot decode {tensor.name}: {exc}") from None
            weights[name] = torch.empty(tensor.shape, device="meta")
            tensor_types[name] = tensor.type_name
            continue
        if (
            codes
            and keep is None
            and not name.startswith("model.layers.")
            and len(tensor.shape) == 2
            and _codes_type(tensor.type_name)
        ):
            # the embedding (and an untied LM head): straight to bfloat16, rows at a time
            t = _dequantize_bf16(tensor)
            gguf_file.release(tensor)
            weights[name] = t
            tensor_types[name] = tensor.type_name
            continue
        try:
            array = gguf_file.dequantize(tensor)
        except Exception as exc:
            raise ValueError(f"{path}: cannot decode tensor {tensor.name}: {exc}") from None
        t = torch.from_numpy(np.array(array, dtype=np.float32))
        gguf_file.release(tensor)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            t = _reverse_permute(t, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            t = _reverse_permute(t, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            t = t - 1.0  # llama.cpp stores Gemma's 1 + w; the model folds the 1 in itself
        weights[name] = t if keep is None else keep(name, t)
        tensor_types[name] = tensor.type_name
    return GGUFContents(
        hf_config=hf_config,
        weights=weights,
        metadata=meta,
        tensor_types=tensor_types,
        linears=linears,
    )


def _build_groups_in_parallel(
    groups: dict[str, list[str]], build: Callable[[str], None], by_hf: dict, path: Path
) -> None:
    """``build`` every group, on as many threads as torch uses: the decoding and the panel
    layouts are numpy, which lets go of the GIL (a 7B MoE file's 3,000 expert tensors load
    in about half the time on 2 cores). A group that fails names its first tensor."""
    from concurrent.futures import ThreadPoolExecutor

    def one(first: str) -> None:
        try:
            build(first)
        except ValueError as exc:
            gguf_name = getattr(by_hf.get(first), "name", first)
            raise ValueError(f"{path}: cannot decode {gguf_name}: {exc}") from None

    from radixserve.executor.native import load_int4_panels, load_int8_panels

    if not groups:
        return
    load_int4_panels(), load_int8_panels()  # built and loaded once, here, not in two threads
    workers = max(1, min(torch.get_num_threads(), 8))
    if workers == 1 or len(groups) < 2:
        for first in groups:
            one(first)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gguf-load") as pool:
        for _ in pool.map(one, groups):
            pass


def _codes_type(type_name: str) -> bool:
    from radixserve.executor.loader.gguf_codes import CODE_TYPES

    return type_name in CODE_TYPES


def _dequantize_bf16(tensor: Any, rows_at_a_time: int = 8192) -> torch.Tensor:
    """A 2-D tensor of a group-code type as bfloat16, decoded a slice of rows at a time
    (no float32 copy of the whole table)."""
    from radixserve.executor.loader.gguf_codes import decode_codes

    n, k = tensor.shape
    out = torch.empty(n, k, dtype=torch.bfloat16)
    raw = tensor.data.reshape(n, -1)
    for first in range(0, n, rows_at_a_time):
        last = min(n, first + rows_at_a_time)
        part = decode_codes(raw[first:last], tensor.type_name, (last - first, k))
        out[first:last] = part.dequantize()
    return out


def _code_groups(by_hf: dict[str | None, Any]) -> dict[str, list[str]]:
    """The decoder layers' dense weights that load from their codes: by the Hugging Face
    name of each fused group's first tensor, the group's names (every part present, 2-D,
    of a type in ``CODE_TYPES``)."""
    from radixserve.executor.loader.gguf_codes import CODE_TYPES
    from radixserve.executor.quant import EXPERT_FIELD_SOURCES, LAYER_FIELD_SOURCES

    out: dict[str, list[str]] = {}
    for name in by_hf:
        expert = name and re.fullmatch(
            r"(model\.layers\.\d+\.mlp\.(?:experts\.\d+|shared_expert)\.)(.+)", name
        )
        m = expert or (name and re.fullmatch(r"(model\.layers\.\d+\.)(.+)", name))
        if not m:
            continue
        prefix, rest = m.group(1), m.group(2)
        sources = EXPERT_FIELD_SOURCES if expert else LAYER_FIELD_SOURCES
        for options in sources.values():
            for group in options:
                if group[0] != rest:
                    continue
                names = [prefix + g for g in group]
                infos = [by_hf.get(n) for n in names]
                if all(
                    i is not None and len(i.shape) == 2 and i.type_name in CODE_TYPES for i in infos
                ):
                    out[names[0]] = names
    return out


def gguf_model_config(path: Path, gguf_file: Any = None) -> dict[str, Any]:
    """The config.json equivalent of the GGUF model at ``path`` (``gguf_file``: its
    ``GGUFFile`` when open already), as the loader builds the model from it: what
    ``gguf_hf_config`` reads, with the embedding's rows as the vocabulary where the
    metadata gives no size (a token list may be shorter)."""
    gguf_file = gguf_file if gguf_file is not None else GGUFFile(path)
    meta = gguf_file.metadata
    hf_config = gguf_hf_config(path, meta, {t.name for t in gguf_file.tensors})
    embedding = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    if embedding is not None and not meta.get(f"{meta['general.architecture']}.vocab_size"):
        hf_config["vocab_size"] = int(embedding.shape[0])
    return hf_config


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
    _moe_hf_config(arch, meta, tensor_names, hf_config)
    rope_scaling = _rope_scaling(arch, meta, path, tensor_names)
    if rope_scaling is not None:
        hf_config["rope_scaling"] = rope_scaling
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "gemma3":
        # llama.cpp's rule: head_dim ** -0.5, but hidden / heads for the 27B model
        scalar = hf_config["head_dim"]
        if str(meta.get("general.size_label", "")).upper() == "27B":
            scalar = hf_config["hidden_size"] // hf_config["num_attention_heads"]
        hf_config.update(
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=scalar,
            sliding_window=int(window or 4096),
            sliding_window_pattern=_GEMMA3_PATTERN,
            rope_local_base_freq=_GEMMA3_LOCAL_BASE,
            tie_word_embeddings="output.weight" not in tensor_names,
        )
        # newer files may say: a period, or per layer (true: sliding)
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            hf_config["layer_types"] = [
                "sliding_attention" if p else "full_attention" for p in pattern
            ]
        elif pattern:
            hf_config["sliding_window_pattern"] = int(pattern)
    elif window:
        hf_config["sliding_window"] = int(window)
        hf_config["use_sliding_window"] = True
    ends = [tokens.index(t) for t in _END_OF_TURN.get(arch, ()) if t in tokens]
    if ends and hf_config["eos_token_id"] is not None:
        hf_config["eos_token_id"] = sorted({int(hf_config["eos_token_id"]), *ends})
    return hf_config


def _moe_hf_config(
    arch: str, meta: dict[str, Any], tensor_names: set[str], hf_config: dict[str, Any]
) -> None:
    """The experts' fields of config.json from ``{arch}.expert_*`` (a ``llama`` file with
    experts becomes a Mixtral); a layer without a router (``ffn_gate_inp``) is dense."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        if arch in ("qwen2moe", "qwen3moe", "olmoe"):
            raise ValueError(f"GGUF metadata lacks {arch}.expert_count")
        return
    if arch not in _NORM_TOPK:
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported")
    layers = hf_config["num_hidden_layers"]
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    used = int(meta.get(f"{arch}.expert_used_count") or 2)
    # llama.cpp's fallbacks where a file lacks the sizes (older Qwen1.5-MoE conversions):
    # the dense size over the experts used, and the dense size for a shared expert
    expert_size = meta.get(f"{arch}.expert_feed_forward_length") or (
        hf_config["intermediate_size"] // used
        if arch == "qwen2moe"
        else hf_config["intermediate_size"]
    )
    shared_size = meta.get(f"{arch}.expert_shared_feed_forward_length") or (
        hf_config["intermediate_size"]
        if any(name.endswith("ffn_gate_shexp.weight") for name in tensor_names)
        else 0
    )
    norm = meta.get(f"{arch}.expert_weights_norm")
    hf_config.update(
        num_experts=experts,
        num_local_experts=experts,
        num_experts_per_tok=used,
        moe_intermediate_size=int(expert_size),
        norm_topk_prob=_NORM_TOPK[arch] if norm is None else bool(norm),
        mlp_only_layers=dense,
        shared_expert_intermediate_size=int(shared_size),
    )
    if arch in ("llama", "gpt-oss") and dense:
        raise ValueError(f"a {arch} file with experts needs a router in every layer ({dense})")
    if arch == "gpt-oss":
        hf_config["intermediate_size"] = int(expert_size)
        hf_config["attention_bias"] = True
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 2)
        if isinstance(pattern, list):
            sliding = [bool(p) for p in pattern]
        elif int(pattern) == 0:  # llama.cpp: a period of 0 slides every layer
            sliding = [True] * layers
        else:  # llama.cpp's rule: every layer but each period-th slides
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
        hf_config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if arch == "llama":
        hf_config["architectures"] = [_LLAMA_MOE]
        hf_config["intermediate_size"] = int(expert_size)
    elif arch == "olmoe":
        hf_config["intermediate_size"] = int(expert_size)
        clamp = meta.get(f"{arch}.attention.clamp_kqv")
        if clamp:
            hf_config["clip_qkv"] = float(clamp)


def _rope_scaling(
    arch: str, meta: dict[str, Any], path: Path, names: set[str]
) -> dict[str, Any] | None:
    """``rope_scaling`` of config.json from ``{arch}.rope.scaling.*`` (linear), or, for files
    with a ``rope_freqs.weight`` tensor (Llama 3.1/3.2: llama3 scaling baked into
    per-frequency divisors, as llama.cpp applies them), ``freq_factors``."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if arch == "phi3" and "rope_factors_long.weight" in names:
        return _phi3_longrope(meta, path)
    if "rope_freqs.weight" in names:
        # the factors themselves are the tensor's values: load_gguf fills them in
        return {"rope_type": "freq_factors", "factors": None}
    if kind in (None, "none") or not factor:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if not original:
            raise ValueError(f"{path}: YaRN without {arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast") or 32.0),
            "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow") or 1.0),
            # gpt-oss was trained with an unrounded correction range (its config.json's
            # truncate: false); llama.cpp rounds it for every model
            "truncate": arch != "gpt-oss",
        }
    raise ValueError(f"{path}: GGUF rope scaling {kind!r} is not supported (linear, llama3, yarn)")


def _phi3_longrope(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """LongRoPE as llama.cpp's converter stores it for Phi-3 (128k) files: the short and long
    per-frequency factors as the tensors ``rope_factors_short/long.weight``, the original
    context length and the attention factor in the metadata."""
    original = meta.get("phi3.rope.scaling.original_context_length")
    if not original:
        raise ValueError(
            f"{path}: Phi-3 LongRoPE factors without phi3.rope.scaling.original_context_length"
        )
    gguf_file = GGUFFile(path)
    factors = {
        t.name: gguf_file.dequantize(t).reshape(-1).astype(float).tolist()
        for t in gguf_file.tensors
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")
    }
    if len(factors) != 2:
        raise ValueError(f"{path}: Phi-3 LongRoPE needs both rope_factors_long and _short")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": factors["rope_factors_long.weight"],
        "short_factor": factors["rope_factors_short.weight"],
        "original_max_position_embeddings": int(original),
    }
    attn_factor = meta.get("phi3.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return scaling


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor ``gguf_name`` of an ``arch`` model (None: one
    radixserve does not load)."""
    return _hf_name(gguf_name, arch)


def reverse_rope_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A llama-arch GGUF q or k projection's rows (or a LoRA B's) in Hugging Face order."""
    return _reverse_permute(w, num_heads)


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    table = _LAYER_TABLES.get(arch, _LAYER_NAMES)
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    expert = m and _EXPERT_RE.fullmatch(m.group(2))
    if expert:
        kind, e, leaf = expert.group(1), expert.group(2), expert.group(3)
        return f"model.layers.{m.group(1)}.mlp.experts.{e}.{kind}_proj.{leaf}"
    if gguf_name.startswith("rope_"):
        return f"rotary_emb.{gguf_name}"  # precomputed rope tables: dropped by the model
    return None
