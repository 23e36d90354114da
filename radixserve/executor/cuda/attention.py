"""Triton attention over the paged KV cache (the CUDA backend of ``AttentionBackend``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.executor.cuda import kernels
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.layers.attention import AttentionSpec

_BLOCK_N = 64  # keys per tile of the decode kernel


@dataclass
class TritonHostMetadata:
    """What ``prepare`` computes on the host (numpy): the step's shape and its index arrays,
    staged to the device by the runner in one copy. ``page_tables`` is [B, max_pages]."""

    is_decode: bool
    num_tokens: int
    max_q_len: int
    max_seq_len: int
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    page_tables: np.ndarray
    slot_mapping: np.ndarray


@dataclass
class TritonMetadata:
    """The step's indices on the device. Invariant: ``is_decode`` means one query token per
    request (row b of q is request b); ``num_splits`` is fixed per launch shape, so the
    decode grid never depends on sequence lengths (CUDA graphs replay it as captured)."""

    is_decode: bool
    num_tokens: int
    max_q_len: int
    num_splits: int
    query_start_loc: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    page_tables: torch.Tensor  # [B, >= max pages], rows contiguous
    slot_mapping: torch.Tensor  # [T]


class TritonAttention:
    """Writes each layer's new K/V into the pages with one kernel, then attends: decode-only
    steps with the split-K decode kernel, any other step (prefill chunks with or without a
    cached prefix, mixed with decodes) with the extend kernel.

    Both kernels take the layer's ``AttentionSpec`` (``specs[layer]``; by default
    ``head_dim ** -0.5``, no window, no cap): scale, sliding window and soft cap.

    Invariant: a step's K/V is stored before any of its queries read the cache, so a token
    sees itself and everything before it (in a sliding-window layer, the last ``window``
    positions only), and nothing after it.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        head_dim: int,
        specs: Sequence[AttentionSpec] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.k.shape[2]
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.specs = list(specs) if specs is not None else None
        if any(s.sinks is not None for s in self.specs or ()):
            raise ValueError("attention sinks (gpt-oss) have no Triton kernel yet: run on the CPU")
        self.default_spec = AttentionSpec(self.scale)

    def prepare(self, batch: ForwardBatch) -> TritonHostMetadata:
        return TritonHostMetadata(
            is_decode=batch.num_tokens == batch.num_requests,
            num_tokens=batch.num_tokens,
            max_q_len=int(batch.q_lens.max()) if batch.num_requests else 0,
            max_seq_len=int(batch.seq_lens.max()) if batch.num_requests else 0,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            page_tables=batch.page_tables,
            slot_mapping=batch.slot_mapping,
        )

    def num_splits(self, batch_size: int, max_seq_len: int) -> int:
        return kernels.default_num_splits(batch_size, self.num_kv_heads, max_seq_len, _BLOCK_N)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata
    ) -> torch.Tensor:
        cache = self.kv_cache
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        # an int8 cache: codes in k/v, each token-head's scale beside them
        scales = {}
        if cache.k_scale is not None and cache.v_scale is not None:
            scales = {"k_scale": cache.k_scale[layer], "v_scale": cache.v_scale[layer]}
        kernels.store_kv(k_cache, v_cache, k, v, meta.slot_mapping, **scales)
        out = q.new_empty(meta.num_tokens, self.num_heads, self.head_dim)
        spec = self.default_spec if self.specs is None else self.specs[layer]
        if meta.is_decode:
            kernels.paged_decode(
                q,
                k_cache,
                v_cache,
                meta.page_tables,
                meta.seq_lens,
                spec.scale,
                meta.num_splits,
                out=out,
                block_n=_BLOCK_N,
                window=spec.sliding_window,
                softcap=spec.softcap,
                **scales,
            )
        else:
            kernels.extend_attention(
                q,
                k_cache,
                v_cache,
                meta.page_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_q_len,
                spec.scale,
                out=out,
                window=spec.sliding_window,
                softcap=spec.softcap,
                **scales,
            )
        return out.view(meta.num_tokens, -1)
