"""Attention over the paged KV cache: the backend interface and a torch-native backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache


class AttentionBackend(Protocol):
    """Computes causal attention of a step's queries against the paged KV cache.

    ``prepare`` turns a ``ForwardBatch`` into whatever metadata the backend needs once per
    step; ``forward`` is called once per layer: it writes the step's K/V into the cache at
    ``slot_mapping`` and returns the attention output [T, heads * head_dim].
    """

    def prepare(self, batch: ForwardBatch) -> object: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: object
    ) -> torch.Tensor: ...


@dataclass
class _Group:
    """Requests attended together as one padded batch.

    ``token_index[b, j]`` is the flat index of request b's j-th query token (padding points at
    a valid token and is dropped on output); ``page_tables`` [b, max_pages] gathers the KV;
    ``mask`` [b, 1, max_q, max_kv] allows kv position <= query position < seq_len.
    """

    token_index: torch.Tensor  # [b, max_q]
    valid: torch.Tensor  # [b, max_q] bool
    out_index: torch.Tensor  # [n_valid] flat token indices, in valid order
    page_tables: torch.Tensor  # [b, max_pages]
    mask: torch.Tensor | None  # None: decode of equal-length rows with no padding


@dataclass
class TorchNativeMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]
    num_tokens: int


class TorchNativeAttention:
    """Gathers each request's KV pages into a padded batch and runs one masked SDPA call per
    group and layer: one group for decodes (one query token each) and one for prefill chunks,
    so a decode is never padded to a prefill's length.

    Invariant: the KV written by a step is visible to that step's own queries (writes happen
    before the gather), and no query attends past its own position.
    """

    def __init__(self, kv_cache: KVCache, num_heads: int, head_dim: int) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def prepare(self, batch: ForwardBatch) -> TorchNativeMetadata:
        decode = batch.q_lens == 1
        groups = [
            self._group(batch, np.flatnonzero(decode), is_decode=True),
            self._group(batch, np.flatnonzero(~decode), is_decode=False),
        ]
        return TorchNativeMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping),
            groups=[g for g in groups if g is not None],
            num_tokens=batch.num_tokens,
        )

    def _group(self, batch: ForwardBatch, idx: np.ndarray, is_decode: bool) -> _Group | None:
        if idx.size == 0:
            return None
        ps = batch.page_size
        q_lens = batch.q_lens[idx]
        seq_lens = batch.seq_lens[idx]
        max_q = int(q_lens.max())
        max_pages = int(-(-seq_lens.max() // ps))
        max_kv = max_pages * ps
        j = np.arange(max_q)
        valid = j[None, :] < q_lens[:, None]
        token_index = batch.query_start_loc[idx][:, None] + np.minimum(
            j[None, :], q_lens[:, None] - 1
        )
        mask = None
        if not (is_decode and np.all(seq_lens == max_kv)):
            q_pos = seq_lens[:, None] - q_lens[:, None] + j[None, :]  # [b, max_q]
            kv_pos = np.arange(max_kv)
            allowed = kv_pos[None, None, :] <= q_pos[:, :, None]
            allowed[:, :, 0] = True  # padded query rows attend somewhere (output dropped)
            mask = torch.from_numpy(allowed[:, None, :, :])
        return _Group(
            token_index=torch.from_numpy(token_index),
            valid=torch.from_numpy(valid),
            out_index=torch.from_numpy(token_index[valid]),
            page_tables=torch.from_numpy(np.ascontiguousarray(batch.page_tables[idx, :max_pages])),
            mask=mask,
        )

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchNativeMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.write(layer, meta.slot_mapping, k, v)
        if len(meta.groups) == 1 and meta.groups[0].valid.numel() == meta.num_tokens:
            return self._attend(meta.groups[0], q, k_cache, v_cache).reshape(meta.num_tokens, -1)
        out = q.new_empty(meta.num_tokens, self.num_heads, self.head_dim)
        for group in meta.groups:
            out[group.out_index] = self._attend(group, q, k_cache, v_cache)[group.valid]
        return out.view(meta.num_tokens, -1)

    def _attend(
        self, g: _Group, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Attention of group ``g``: returns [b, max_q, heads, head_dim]."""
        b, max_pages = g.page_tables.shape
        # [num_pages, page_size, kv_heads, d] -> [b, max_kv, kv_heads, d] -> [b, kv_heads, max_kv, d]
        keys = k_cache[g.page_tables].flatten(1, 2).transpose(1, 2)
        values = v_cache[g.page_tables].flatten(1, 2).transpose(1, 2)
        queries = q[g.token_index].transpose(1, 2)  # [b, heads, max_q, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=g.mask, scale=self.scale, enable_gqa=True
        )
        return out.transpose(1, 2)
