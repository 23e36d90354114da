"""Phi-3 / Phi-3.5 (``Phi3ForCausalLM``)."""

from __future__ import annotations

from radixserve.executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3's decoder: Llama's, with q/k/v stored as one ``qkv_proj`` and gate/up as one
    ``gate_up_proj`` (taken as they are: already the fused GEMMs ``LlamaForCausalLM`` builds),
    LongRoPE (``longrope``/``su``: short factors below ``original_max_position_embeddings``,
    long factors from there, cos/sin scaled by the attention factor; ``RotaryEmbedding``)
    and a sliding window on every layer when the config has one shorter than the context.

    Invariant: ``forward`` computes transformers' ``Phi3ForCausalLM`` for every sequence
    that stays within ``original_max_position_embeddings`` (and, with ``longrope``, for every
    position past it the long factors, position by position: transformers instead
    recomputes the whole sequence with the long factors once it crosses that length, which a
    prefix cache cannot do; see docs/models.md).
    """
