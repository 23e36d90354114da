"""Random weights for any config (``load_format="dummy"``): measure a model's speed without
its checkpoint."""

from __future__ import annotations

import torch

from radixserve.executor.model_config import ModelConfig


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every tensor the model of ``config.architecture`` takes, by Hugging Face name, created on ``device``:
    matrices ~ N(0, 0.02²), norm weights 1. Deterministic for a seed and device."""
    c = config
    gen = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        w = torch.empty(rows, cols, dtype=dtype, device=device)
        return w.normal_(0.0, 0.02, generator=gen)

    gemma = c.architecture == "Gemma3ForCausalLM"

    def ones(n: int) -> torch.Tensor:
        # a norm that multiplies by 1: Gemma stores w in (1 + w)
        return (torch.zeros if gemma else torch.ones)(n, dtype=dtype, device=device)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    q_size = c.num_attention_heads * c.head_dim
    kv_size = c.num_key_value_heads * c.head_dim
    weights = {"model.embed_tokens.weight": matrix(c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            weights[p + f"self_attn.{name}_proj.weight"] = matrix(rows, c.hidden_size)
            if c.attention_bias:
                weights[p + f"self_attn.{name}_proj.bias"] = torch.zeros(
                    rows, dtype=dtype, device=device
                )
        weights[p + "self_attn.o_proj.weight"] = matrix(c.hidden_size, q_size)
        if c.o_bias:
            weights[p + "self_attn.o_proj.bias"] = zeros(c.hidden_size)
        if c.attention_sinks:
            weights[p + "self_attn.sinks"] = zeros(c.num_attention_heads)
        if c.qk_norm and not c.qk_norm_whole:
            weights[p + "self_attn.q_norm.weight"] = ones(c.head_dim)
            weights[p + "self_attn.k_norm.weight"] = ones(c.head_dim)
        if c.qk_norm and c.qk_norm_whole:  # OLMoE: over the whole projections
            weights[p + "self_attn.q_norm.weight"] = ones(q_size)
            weights[p + "self_attn.k_norm.weight"] = ones(kv_size)
        moe = c.moe
        mlps = [(p + "mlp.", c.intermediate_size)]
        if moe is not None and moe.sparse_layers[i]:
            weights[p + "mlp.gate.weight"] = matrix(moe.num_experts, c.hidden_size)
            if moe.router_bias:
                weights[p + "mlp.gate.bias"] = zeros(moe.num_experts)
            mlps = [(f"{p}mlp.experts.{e}.", moe.intermediate_size) for e in range(moe.num_experts)]
            if moe.shared_intermediate_size:
                mlps.append((p + "mlp.shared_expert.", moe.shared_intermediate_size))
                weights[p + "mlp.shared_expert_gate.weight"] = matrix(1, c.hidden_size)
        for q, inter in mlps:
            weights[q + "gate_proj.weight"] = matrix(inter, c.hidden_size)
            weights[q + "up_proj.weight"] = matrix(inter, c.hidden_size)
            weights[q + "down_proj.weight"] = matrix(c.hidden_size, inter)
            if moe is not None and moe.expert_bias and q != p + "mlp.":
                for name, size in (("gate", inter), ("up", inter), ("down", c.hidden_size)):
                    weights[q + f"{name}_proj.bias"] = zeros(size)
        weights[p + "input_layernorm.weight"] = ones(c.hidden_size)
        weights[p + "post_attention_layernorm.weight"] = ones(c.hidden_size)
        if gemma:
            weights[p + "pre_feedforward_layernorm.weight"] = ones(c.hidden_size)
            weights[p + "post_feedforward_layernorm.weight"] = ones(c.hidden_size)
    weights["model.norm.weight"] = ones(c.hidden_size)
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = matrix(c.vocab_size, c.hidden_size)
    return weights
