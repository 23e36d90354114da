"""Attention over the paged KV cache: the backend interface and a torch-native backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache, QuantizedPages
from radixserve.executor.layers.attention import AttentionSpec
from radixserve.executor.native import (
    SharedPrefix,
    load_paged_decode,
    load_paged_prefill,
    make_shared_prefix,
    paged_decode,
    paged_decode_int8,
    paged_decode_supports,
    paged_prefill,
    paged_prefill_supports,
)


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
class _DecodeGroup:
    """Requests with one query token each: ``token_index[b]`` is the flat index of request b's
    token, ``page_tables`` [b, max_pages] (int32) its pages, ``seq_lens`` [b] (int32) its KV
    length. For the PyTorch path only, ``bias`` [b, max_pages, 1, 1, page_size] is 0 where a
    kv position is < seq_len and -inf beyond (None when every row is full, or natively).
    ``prefix``: the leading pages every request shares, attended once for all (native
    AVX-512 BF16 path only; None otherwise). ``whole_batch``: these are all of the step's
    tokens, in order (token_index is 0..T-1), so q and the output need no gathers."""

    token_index: torch.Tensor
    page_tables: torch.Tensor
    seq_lens: torch.Tensor
    bias: torch.Tensor | None
    prefix: SharedPrefix | None = None
    whole_batch: bool = False
    max_seq_len: int = 0
    # every row is its request's one token (a decode step); False where prompt tokens are
    # rows of their own too (``_row_group``)
    one_per_request: bool = True


@dataclass
class _PrefillGroup:
    """Prefill chunks that extend cached context, as one padded batch.

    ``token_index[b, j]`` is the flat index of request b's j-th query token (padding points at
    a valid token and is dropped on output); ``mask`` [b, 1, max_q, max_kv] allows
    kv position <= query position.
    """

    token_index: torch.Tensor  # [b, max_q]
    valid: torch.Tensor  # [b, max_q] bool
    out_index: torch.Tensor  # [n_valid]
    page_tables: torch.Tensor  # [b, max_pages]
    mask: torch.Tensor
    q_pos: torch.Tensor  # [b, max_q] int64: each query's position


@dataclass
class _NativePrefillGroup:
    """Every request of the step with more than one query (fresh prompts and chunks extending
    cached KV alike), for the C kernel: request b's queries are flat rows
    ``q_starts[b] .. q_starts[b] + q_lens[b] - 1``, at positions ``seq_lens[b] - q_lens[b] ..``,
    and its KV fills ``page_tables[b, :ceil(seq_lens[b] / page_size)]``. All int32."""

    page_tables: torch.Tensor  # [b, max_pages]
    q_starts: torch.Tensor  # [b]
    q_lens: torch.Tensor  # [b]
    seq_lens: torch.Tensor  # [b]


@dataclass
class TorchNativeMetadata:
    slots: torch.Tensor  # [T] int64: the KV slot of each new token
    num_tokens: int
    decode: _DecodeGroup | None
    fresh_spans: list[tuple[int, int]]  # prompts with no prior KV: [start, end) flat spans
    # short chunks extending cached KV: (start, end, kv length, its pages), attended with
    # explicit scores like fresh prompts
    context_spans: list[tuple[int, int, int, torch.Tensor]]
    prefill: _PrefillGroup | None
    native_prefill: _NativePrefillGroup | None = None
    # every sequence (query start, end, kv length, its pages): the layers with attention
    # sinks attend each with explicit scores (set only where some layer has sinks)
    sequences: list[tuple[int, int, int, torch.Tensor]] | None = None


_SMALL_CAUSAL = 1024  # longest prompt attended with explicit scores (L x L per head group)
_SMALL_CONTEXT = 4096  # longest KV a short chunk extending cached KV attends explicitly


class TorchNativeAttention:
    """Paged attention in plain PyTorch, one batched call per group and layer:

    * decodes: the batch's pages are gathered whole (one contiguous copy per page) and
      attended page by page with two batched matmuls and a softmax across pages;
    * prompts with no cached prefix: causal attention on the step's own q/k/v (no cache
      read), batched matmuls for short prompts, torch's flash kernel for long ones;
    * chunks that extend cached KV: pages gathered into a padded batch + masked SDPA.

    Where the C prefill kernel builds (``native/paged_prefill.c``), every prompt chunk, fresh
    or extending cached KV, goes to it instead, in one call per layer: it reads the pages in
    place, blockwise with an online softmax, so a chunk's cost grows with its queries times
    its keys and nothing else; the PyTorch paths above are the fallback.

    Over an int8 cache, and in deterministic mode, every token of the step (prompt or
    decode) is a query row of the C decode kernel over its own request's keys up to its
    position (``_row_group``): one path, so a token's output does not depend on whether it
    came in a prompt's chunk, a decode step or a verify step.

    Every path honours the layer's ``AttentionSpec`` (``specs[layer]``; by default
    ``head_dim ** -0.5`` and no window or cap): the C kernels take the window and the cap,
    the PyTorch paths mask and cap their scores. A decode batch's shared prefix is attended
    once only in layers where it lies inside every sequence's window.

    Invariant: the KV written by a step is visible to that step's own queries (writes happen
    before any read), and no query attends past its own position, nor, in a sliding-window
    layer, before its window.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        head_dim: int,
        use_native: bool = True,
        specs: Sequence[AttentionSpec] | None = None,
        deterministic: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        # deterministic mode (executor/batch_invariant.py): every query row, prompt or
        # decode, through the decode kernel over the keys up to its own position, no
        # shared prefix: a row's output is the same whatever its step holds
        self.deterministic = deterministic
        # the C decode kernel (reads pages in place), when it builds on this machine and
        # handles this cache's shapes ([..., kv_heads, page_size, head_dim])
        *_, kv_heads, page_size, _ = kv_cache.k.shape
        # an int8 cache (``KVCache.quantized``): every row, prompt or decode, read by the C
        # decode kernel (``paged_decode_int8``, any tier; ``_row_group``)
        self.quantized = bool(getattr(kv_cache, "quantized", False))
        compute_dtype = getattr(kv_cache, "dtype", kv_cache.k.dtype)
        supported = kv_cache.k.device.type == "cpu" and paged_decode_supports(
            compute_dtype, num_heads // kv_heads, head_dim, page_size
        )
        self.native = load_paged_decode() if use_native and supported else None
        prefill_supported = (
            not self.quantized
            and kv_cache.k.device.type == "cpu"
            and paged_prefill_supports(kv_cache.k.dtype, num_heads // kv_heads, head_dim)
        )
        self.native_prefill = load_paged_prefill() if use_native and prefill_supported else None
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.specs = list(specs) if specs is not None else None
        self.default_spec = AttentionSpec(self.scale)
        # decode batches whose requests share leading pages attend them once (two passes)
        self.shared_prefix = not deterministic
        self.has_sinks = any(s.sinks is not None for s in self.specs or ())
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    # -- per step -------------------------------------------------------------------------
    def prepare(self, batch: ForwardBatch) -> TorchNativeMetadata:
        meta = self._prepare(batch)
        if self.has_sinks:
            starts, seq_lens = batch.query_start_loc, batch.seq_lens
            meta.sequences = []
            for i in range(len(batch.q_lens)):
                num_pages = -(-int(seq_lens[i]) // batch.page_size)
                pages = torch.from_numpy(batch.page_tables[i, :num_pages].copy())
                meta.sequences.append((int(starts[i]), int(starts[i + 1]), int(seq_lens[i]), pages))
        return meta

    def _prepare(self, batch: ForwardBatch) -> TorchNativeMetadata:
        # an int8 cache's prompt chunks as rows of the C decode kernel too (the PyTorch paths
        # would dequantize every page they read, per chunk)
        if (self.deterministic or self.quantized) and self.native is not None:
            return TorchNativeMetadata(
                slots=torch.from_numpy(batch.slot_mapping.astype(np.int64, copy=False)),
                num_tokens=batch.num_tokens,
                decode=self._row_group(batch),
                fresh_spans=[],
                context_spans=[],
                prefill=None,
            )
        is_decode = batch.q_lens == 1
        if self.native_prefill is not None:
            return TorchNativeMetadata(
                slots=torch.from_numpy(batch.slot_mapping.astype(np.int64, copy=False)),
                num_tokens=batch.num_tokens,
                decode=self._decode_group(batch, np.flatnonzero(is_decode)),
                fresh_spans=[],
                context_spans=[],
                prefill=None,
                native_prefill=self._native_prefill_group(batch, np.flatnonzero(~is_decode)),
            )
        is_fresh = ~is_decode & (batch.seq_lens == batch.q_lens)
        is_short_context = (
            ~is_decode
            & ~is_fresh
            & (batch.q_lens <= _SMALL_CAUSAL)
            & (batch.seq_lens <= _SMALL_CONTEXT)
        )
        starts = batch.query_start_loc
        fresh = np.flatnonzero(is_fresh)
        context_spans = []
        for i in np.flatnonzero(is_short_context).tolist():
            num_pages = -(-int(batch.seq_lens[i]) // batch.page_size)
            pages = torch.from_numpy(batch.page_tables[i, :num_pages].copy())
            context_spans.append(
                (int(starts[i]), int(starts[i + 1]), int(batch.seq_lens[i]), pages)
            )
        return TorchNativeMetadata(
            slots=torch.from_numpy(batch.slot_mapping.astype(np.int64, copy=False)),
            num_tokens=batch.num_tokens,
            decode=self._decode_group(batch, np.flatnonzero(is_decode)),
            fresh_spans=list(zip(starts[fresh].tolist(), starts[fresh + 1].tolist(), strict=True)),
            context_spans=context_spans,
            prefill=self._prefill_group(
                batch, np.flatnonzero(~is_decode & ~is_fresh & ~is_short_context)
            ),
        )

    def _decode_group(self, batch: ForwardBatch, idx: np.ndarray) -> _DecodeGroup | None:
        if idx.size == 0:
            return None
        seq_lens = batch.seq_lens[idx]
        max_pages = int(-(-seq_lens.max() // batch.page_size))
        max_kv = max_pages * batch.page_size
        bias = None
        if self.native is None and not np.all(seq_lens == max_kv):
            beyond = np.arange(max_kv)[None, :] >= seq_lens[:, None]
            bias = torch.zeros(beyond.shape, dtype=torch.float32)
            bias.masked_fill_(torch.from_numpy(beyond), float("-inf"))
            bias = bias.view(len(idx), max_pages, 1, 1, batch.page_size)
        page_tables = batch.page_tables[idx, :max_pages].astype(np.int32)
        prefix = None
        if self.native is not None and self.shared_prefix and not self.quantized:
            k = self.kv_cache.k
            *_, kv_heads, page_size, head_dim = k.shape
            prefix = make_shared_prefix(
                self.native,
                page_tables,
                seq_lens,
                page_size,
                kv_heads,
                head_dim,
                self.num_heads // kv_heads,
                k.dtype,
            )
        return _DecodeGroup(
            token_index=torch.from_numpy(batch.query_start_loc[idx]),
            page_tables=torch.from_numpy(page_tables),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            bias=bias,
            prefix=prefix,
            whole_batch=idx.size == batch.num_tokens,  # one token per request: all decode
            max_seq_len=int(seq_lens.max()),
        )

    @staticmethod
    def _row_group(batch: ForwardBatch) -> _DecodeGroup:
        """Every token of the step as a decode query of its own (deterministic mode, an int8
        cache): token j of request i attends request i's keys up to its position, through
        its pages (the page table repeated per token: [tokens, pages] int32)."""
        q_lens = batch.q_lens.astype(np.int64, copy=False)
        seq_lens = batch.seq_lens.astype(np.int64, copy=False)
        # each token's position + 1: its request's keys before its chunk, then its own
        within = np.arange(batch.num_tokens) - np.repeat(batch.query_start_loc[:-1], q_lens)
        token_lens = np.repeat(seq_lens - q_lens, q_lens) + within + 1
        max_pages = int(-(-seq_lens.max() // batch.page_size))
        pages = np.repeat(batch.page_tables[:, :max_pages], q_lens, axis=0)
        return _DecodeGroup(
            token_index=torch.arange(batch.num_tokens),
            page_tables=torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int32)),
            seq_lens=torch.from_numpy(token_lens.astype(np.int32)),
            bias=None,
            whole_batch=True,
            max_seq_len=int(token_lens.max()),
            one_per_request=batch.num_tokens == batch.num_requests,
        )

    @staticmethod
    def _native_prefill_group(batch: ForwardBatch, idx: np.ndarray) -> _NativePrefillGroup | None:
        if idx.size == 0:
            return None
        max_pages = int(-(-batch.seq_lens[idx].max() // batch.page_size))

        def int32(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))

        return _NativePrefillGroup(
            page_tables=int32(batch.page_tables[idx, :max_pages]),
            q_starts=int32(batch.query_start_loc[idx]),
            q_lens=int32(batch.q_lens[idx]),
            seq_lens=int32(batch.seq_lens[idx]),
        )

    def _prefill_group(self, batch: ForwardBatch, idx: np.ndarray) -> _PrefillGroup | None:
        if idx.size == 0:
            return None
        q_lens = batch.q_lens[idx]
        seq_lens = batch.seq_lens[idx]
        max_q = int(q_lens.max())
        max_pages = int(-(-seq_lens.max() // batch.page_size))
        j = np.arange(max_q)
        valid = j[None, :] < q_lens[:, None]
        token_index = batch.query_start_loc[idx][:, None] + np.minimum(
            j[None, :], q_lens[:, None] - 1
        )
        q_pos = (seq_lens - q_lens)[:, None] + j[None, :]  # [b, max_q]
        allowed = np.arange(max_pages * batch.page_size)[None, None, :] <= q_pos[:, :, None]
        return _PrefillGroup(
            token_index=torch.from_numpy(token_index),
            valid=torch.from_numpy(valid),
            out_index=torch.from_numpy(token_index[valid]),
            page_tables=torch.from_numpy(np.ascontiguousarray(batch.page_tables[idx, :max_pages])),
            mask=torch.from_numpy(allowed[:, None, :, :]),
            q_pos=torch.from_numpy(q_pos),
        )

    # -- per layer ------------------------------------------------------------------------
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchNativeMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.write(layer, meta.slots, k, v)
        spec = self.default_spec if self.specs is None else self.specs[layer]
        if spec.sinks is not None:  # explicit scores, sequence by sequence
            assert meta.sequences is not None
            out = q.new_empty(meta.num_tokens, self.num_heads, self.head_dim)
            page_size = k_cache.shape[2]
            for start, end, kv_len, pages in meta.sequences:
                # a window reads its own pages only
                first = spec.lowest_key(kv_len - (end - start)) // page_size
                offset = first * page_size
                keys = self._gather_sequence(k_cache, pages[first:], kv_len - offset)
                values = self._gather_sequence(v_cache, pages[first:], kv_len - offset)
                out[start:end] = _sink_attention(q[start:end], keys, values, spec, offset)
            return out.view(meta.num_tokens, -1)
        if meta.decode is not None and meta.decode.whole_batch:  # a pure decode step
            return self._decode(meta.decode, q, k_cache, v_cache, spec).view(meta.num_tokens, -1)
        out = q.new_empty(meta.num_tokens, self.num_heads, self.head_dim)
        if meta.decode is not None:
            out[meta.decode.token_index] = self._decode(meta.decode, q, k_cache, v_cache, spec)
        for start, end in meta.fresh_spans:
            out[start:end] = self._causal(q[start:end], k[start:end], v[start:end], spec)
        for start, end, kv_len, pages in meta.context_spans:
            keys = self._gather_sequence(k_cache, pages, kv_len)
            values = self._gather_sequence(v_cache, pages, kv_len)
            out[start:end] = self._explicit(q[start:end], keys, values, spec)
        if meta.prefill is not None:
            g = meta.prefill
            out[g.out_index] = self._prefill(g, q, k_cache, v_cache, spec)[g.valid]
        if meta.native_prefill is not None:
            n = meta.native_prefill
            paged_prefill(
                self.native_prefill,
                q,
                k_cache,
                v_cache,
                n.page_tables,
                n.q_starts,
                n.q_lens,
                n.seq_lens,
                spec.scale,
                out,
                window=spec.sliding_window,
                softcap=spec.softcap,
            )
        return out.view(meta.num_tokens, -1)

    def _causal(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """Causal self-attention of one prompt with no cached prefix: q [L, heads, d] and
        k/v [L, kv_heads, d] → [L, heads, d].

        Up to ``_SMALL_CAUSAL`` tokens: two batched matmuls per kv head group (the query
        heads sharing a kv head stacked as rows) and a masked softmax — about 1.7x faster
        here than torch's CPU flash kernel at 256 tokens; longer prompts use that kernel
        (it never materialises the L x L scores), or, in a layer with a window or a cap,
        SDPA with an explicit mask (the PyTorch fallback of the C kernel)."""
        if q.shape[0] > _SMALL_CAUSAL:
            if spec.sliding_window is None and spec.softcap is None:
                # 4-D inputs: torch's CPU flash kernel (3-D ones fall back to the math path)
                return F.scaled_dot_product_attention(
                    q[None].transpose(1, 2),
                    k[None].transpose(1, 2),
                    v[None].transpose(1, 2),
                    is_causal=True,
                    scale=spec.scale,
                    enable_gqa=True,
                )[0].transpose(0, 1)
            length = q.shape[0]
            positions = torch.arange(length)
            allowed = _allowed(positions[None, :], positions[None, :], spec)[:, None]
            return _masked_attention(
                q[None].transpose(1, 2),
                k[None].transpose(1, 2),
                v[None].transpose(1, 2),
                allowed,
                spec,
            )[0].transpose(0, 1)
        return self._explicit(q, k.transpose(0, 1), v.transpose(0, 1), spec)

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec
    ) -> torch.Tensor:
        """Causal attention with explicit scores: q [L, heads, d] are the last L of the
        kv_len positions in k/v [kv_heads, kv_len, d] → [L, heads, d]. Two batched matmuls
        per kv head group (the query heads sharing a kv head stacked as rows)."""
        length, heads, d = q.shape
        kv_heads, kv_len = k.shape[0], k.shape[1]
        group = heads // kv_heads
        # [L, heads, d] -> [kv_heads, group * L, d]: rows of one kv head's query heads
        queries = q.transpose(0, 1).reshape(kv_heads, group * length, d)
        # rows kv_len - L .. kv_len - 1 of the causal mask: query i sees kv 0 .. offset + i
        mask = self._causal_mask(kv_len, q.dtype)[kv_len - length :]
        if spec.sliding_window is not None:
            q_pos = torch.arange(kv_len - length, kv_len)[:, None]
            outside = torch.arange(kv_len)[None, :] <= q_pos - spec.sliding_window
            mask = mask.masked_fill(outside, float("-inf"))
        mask = mask.repeat(group, 1)
        if spec.softcap is None:
            scores = torch.baddbmm(mask, queries, k.transpose(1, 2), alpha=spec.scale)
        else:
            scores = torch.bmm(queries, k.transpose(1, 2)) * spec.scale
            scores = torch.tanh(scores / spec.softcap) * spec.softcap + mask
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, v)  # [kv_heads, group * L, d]
        return out.view(heads, length, d).transpose(0, 1)

    @staticmethod
    def _gather_sequence(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One sequence's first ``kv_len`` positions: [kv_heads, kv_len, d]."""
        blocks = cache.index_select(0, pages)  # [P, kv_heads, page_size, d]
        kv_heads, d = blocks.shape[1], blocks.shape[3]
        return blocks.transpose(0, 1).reshape(kv_heads, -1, d)[:, :kv_len]

    def _causal_mask(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """[length, length] additive mask: 0 on and below the diagonal, -inf above."""
        cached = self._masks.get(dtype)
        if cached is None or cached.shape[0] < length:
            size = max(length, 256)
            cached = torch.full((size, size), float("-inf"), dtype=dtype).triu_(1)
            self._masks[dtype] = cached
        return cached[:length, :length]

    @staticmethod
    def _gather(cache: torch.Tensor, page_tables: torch.Tensor) -> torch.Tensor:
        """[num_pages, kv_heads, page_size, d] → [b, max_pages, kv_heads, page_size, d]."""
        b, max_pages = page_tables.shape
        return cache.index_select(0, page_tables.flatten()).view(b, max_pages, *cache.shape[1:])

    def _decode(
        self,
        g: _DecodeGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Returns [b, heads, d]. Works page by page: batched matmuls over (b, page, kv head)
        blocks of [group, d] x [d, page_size], then a softmax across all of a row's pages."""
        window = spec.sliding_window
        if self.native is not None and isinstance(k_cache, QuantizedPages):
            assert isinstance(v_cache, QuantizedPages)
            queries = q.contiguous() if g.whole_batch else q[g.token_index]
            return paged_decode_int8(
                self.native,
                queries,
                k_cache.codes,
                v_cache.codes,
                k_cache.scales,
                v_cache.scales,
                g.page_tables,
                g.seq_lens,
                spec.scale,
                window=window,
                softcap=spec.softcap,
            )
        if self.native is not None:
            # [b, heads, d], contiguous (q is a view into the fused qkv rows)
            queries = q.contiguous() if g.whole_batch else q[g.token_index]
            # the shared prefix is attended once only where every sequence sees all of it
            prefix = g.prefix if window is None or g.max_seq_len <= window else None
            return paged_decode(
                self.native,
                queries,
                k_cache,
                v_cache,
                g.page_tables,
                g.seq_lens,
                spec.scale,
                prefix,
                window=window,
                softcap=spec.softcap,
            )
        b = g.token_index.shape[0]
        kv_heads = k_cache.shape[1]
        # head h reads kv head h // group: [b, 1, kv_heads, group, d]
        queries = q[g.token_index].view(b, 1, kv_heads, -1, self.head_dim)
        keys = self._gather(k_cache, g.page_tables)  # [b, P, kv, ps, d]
        scores = torch.matmul(queries, keys.transpose(-1, -2)).float()  # [b, P, kv, group, ps]
        scores = scores * spec.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        if g.bias is not None:
            scores = scores + g.bias
        b, num_pages, _, group, page_size = scores.shape
        if window is not None:  # keys before each sequence's window
            kv_pos = torch.arange(num_pages * page_size).view(1, num_pages, 1, 1, page_size)
            lowest = (g.seq_lens.long() - window).view(b, 1, 1, 1, 1)
            scores = scores.masked_fill(kv_pos < lowest, float("-inf"))
        # softmax over all of a row's kv positions: make them one contiguous last dim
        flat = scores.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group, num_pages * page_size)
        weights = torch.softmax(flat, dim=-1).to(v_cache.dtype)
        weights = weights.view(b, kv_heads, group, num_pages, page_size).permute(0, 3, 1, 2, 4)
        values = self._gather(v_cache, g.page_tables)
        out = torch.matmul(weights, values).sum(dim=1)  # [b, kv, group, d]
        return out.view(b, self.num_heads, self.head_dim)

    def _prefill(
        self,
        g: _PrefillGroup,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """Returns [b, max_q, heads, d]."""

        def contiguous_kv(cache: torch.Tensor) -> torch.Tensor:  # -> [b, kv_heads, max_kv, d]
            pages = self._gather(cache, g.page_tables).transpose(1, 2)
            return pages.reshape(pages.shape[0], pages.shape[1], -1, self.head_dim)

        queries = q[g.token_index].transpose(1, 2)  # [b, heads, max_q, d]
        mask = g.mask
        if spec.sliding_window is not None:
            kv_pos = torch.arange(mask.shape[-1])
            mask = mask & _allowed(g.q_pos, kv_pos[None, :], spec)[:, None]
        out = _masked_attention(queries, contiguous_kv(k_cache), contiguous_kv(v_cache), mask, spec)
        return out.transpose(1, 2)


# float32 scores one block of a layer with sinks holds at most (256 MiB): queries go in
# blocks of as many rows as keep [heads, rows, keys] under it
_SINK_SCORES = 1 << 26


def _sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec, offset: int
) -> torch.Tensor:
    """Attention with sinks (gpt-oss): q [L, heads, d] are the last L positions of a
    sequence whose keys/values from position ``offset`` on are k/v [kv_heads, S, d] →
    [L, heads, d]. Each head's sink is one more logit in the softmax, with no value; scores
    and softmax in float32; the queries in blocks (``_SINK_SCORES``), each over the keys
    its window reaches."""
    assert spec.sinks is not None
    length, heads, d = q.shape
    kv_heads, keys_len = k.shape[0], k.shape[1]
    group = heads // kv_heads
    kv_len = offset + keys_len
    first_pos = kv_len - length
    block = max(1, min(length, _SINK_SCORES // max(1, heads * keys_len)))
    sink = spec.sinks.float().view(kv_heads, group, 1, 1)
    out = q.new_empty(length, heads, d)
    for start in range(0, length, block):
        end = min(length, start + block)
        rows = end - start
        lo = spec.lowest_key(first_pos + start) - offset  # first key any row here sees
        hi = first_pos + end - offset
        q_pos = torch.arange(first_pos + start, first_pos + end)[:, None]
        k_pos = torch.arange(offset + lo, offset + hi)[None, :]
        allowed = k_pos <= q_pos
        if spec.sliding_window is not None:
            allowed &= k_pos > q_pos - spec.sliding_window
        queries = q[start:end].transpose(0, 1).reshape(kv_heads, group * rows, d)
        scores = torch.bmm(queries, k[:, lo:hi].transpose(1, 2)).float() * spec.scale
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
        scores = scores.view(kv_heads, group, rows, hi - lo).masked_fill(~allowed, float("-inf"))
        scores = torch.cat([scores, sink.expand(kv_heads, group, rows, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1].to(v.dtype)
        o = torch.matmul(probs, v[:, None, lo:hi])  # [kv_heads, group, rows, d]
        out[start:end] = o.reshape(heads, rows, d).transpose(0, 1)
    return out


def _allowed(q_pos: torch.Tensor, kv_pos: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
    """[b, q, kv] bool: key position kv_pos[b, j] is visible to query q_pos[b, i] (causal,
    inside the window)."""
    qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
    allowed = kp <= qp
    if spec.sliding_window is not None:
        allowed &= kp > qp - spec.sliding_window
    return allowed


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """q [b, heads, L, d], k/v [b, kv_heads, S, d], allowed [b or 1, 1, L, S] bool →
    [b, heads, L, d]: SDPA, or explicit scores when the spec caps them. Every row must
    allow at least one key."""
    if spec.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=spec.scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * spec.scale
    scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
