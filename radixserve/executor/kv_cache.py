"""The KV cache tensors: allocated once, addressed by page id."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from radixserve.executor.native import load_elementwise

_ALIGN = 64  # bytes: as PyTorch's own CPU allocator (a cache line, an AVX-512 vector)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU from ``calloc`` (numpy's zeros), 64-byte aligned: the
    operating system's zero pages stand in until a page is first written, so a large KV
    cache costs no time to allocate and only the memory its tokens use (``torch.zeros``
    writes every byte: ~2 s and all of the memory for 1 GiB at start-up)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


# what a KV cache may store (``--kv-cache-dtype``): auto, the model's dtype; int8, codes with
# a float32 scale per token and head
KV_CACHE_DTYPES = ("auto", "int8")


def bytes_per_page(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> int:
    if kv_cache_dtype == "int8":  # a byte a value, and each token-head's float32 scale
        return 2 * num_layers * page_size * num_kv_heads * (head_dim + 4)
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


_INV_127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] as int8 codes [..., d] and float32 scales [...]: each row's largest
    magnitude maps to 127 (symmetric, round to nearest), so a value comes back within half a
    step, ``scale / 2``; an all-zero row has scale 0."""
    xf = x.float()
    # times float32's 1/127 (not a division): the C writer computes the same product
    scale = xf.abs().amax(dim=-1) * _INV_127
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round(xf * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


class QuantizedPages:
    """One layer's int8 keys (or values) as the PyTorch attention paths read a layer's
    cache: ``index_select(0, pages)`` gives those pages in ``dtype`` (codes times their
    token's scale), ``shape`` is the layer's [num_pages, kv_heads, page_size, head_dim].
    Invariant: ``codes`` and ``scales`` are views of the cache, never copies."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.codes, self.scales, self.dtype = codes, scales, dtype
        self.shape = codes.shape

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0, "pages are selected along the first dimension"
        codes = self.codes.index_select(0, index)
        scales = self.scales.index_select(0, index)
        return (codes.float() * scales[..., None]).to(self.dtype)


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is [num_pages, kv_heads, page_size, head_dim].

    Page-major, so gathering a batch's pages is one ``index_select`` on dim 0 copying whole
    contiguous pages, and each (page, head) block is a [page_size, head_dim] matrix ready
    for batched matmuls. Invariant: the tensors are allocated once and never reallocated; slot ``s`` is token
    ``s % page_size`` of page ``s // page_size``.
    """

    @classmethod
    def for_model(
        cls,
        model: Any,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> KVCache:
        """The cache of ``model``'s layers and this rank's kv heads, in its dtype (or int8)."""
        c = model.config
        return cls(
            c.num_hidden_layers,
            num_pages,
            page_size,
            c.num_key_value_heads,
            c.head_dim,
            model.dtype,
            device=device,
            kv_cache_dtype=kv_cache_dtype,
        )

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        # int8: k and v hold codes, k_scale and v_scale [layers, pages, kv_heads, page_size]
        # each token-head's scale (quantize_int8); the attention reads them dequantized
        self.quantized = kv_cache_dtype == "int8"
        self.dtype = dtype  # what attention computes in (and reads the cache as)
        store = torch.int8 if self.quantized else dtype
        self.k = zeroed(shape, store, device)
        self.v = zeroed(shape, store, device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.quantized:
            self.k_scale = zeroed(shape[:-1], torch.float32, device)
            self.v_scale = zeroed(shape[:-1], torch.float32, device)
        self.page_size = page_size
        self.num_pages = num_pages
        # per-layer views, made once (the write path runs 2 x layers times per step)
        self._k_layers = list(self.k.unbind(0))
        self._v_layers = list(self.v.unbind(0))
        self._head_shape = (num_kv_heads, head_dim)
        self._head_strides = (head_dim, 1)
        self._head_bytes = head_dim * self.k.element_size()
        lib = load_elementwise() if self.k.device.type == "cpu" else None
        self._kv_write = None if lib is None else lib.kv_write
        # int8: the C writer for the model's dtype (None: quantize_int8 in PyTorch)
        self._kv_write_int8 = None
        if lib is not None and self.quantized and dtype in (torch.bfloat16, torch.float32):
            suffix = "bf16" if dtype == torch.bfloat16 else "f32"
            self._kv_write_int8 = getattr(lib, f"kv_write_int8_{suffix}")
        # False: always the PyTorch path (tests compare the two)
        self.use_native = True

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedPages, QuantizedPages]:
        """Store token t's k/v [T, kv_heads, head_dim] at slot ``slots[t]`` (int64); returns
        the layer's caches (an int8 cache's as ``QuantizedPages``). k and v may be
        row-strided views (into a fused qkv row)."""
        k_layer, v_layer = self._k_layers[layer], self._v_layers[layer]
        if self.quantized:
            return self._write_int8(layer, slots, k, v)
        native = self._native_write(slots, k, v)
        if native is not None:
            size = k.element_size()
            native(
                k.data_ptr(),
                v.data_ptr(),
                k.stride(0) * size,
                v.stride(0) * size,
                k_layer.data_ptr(),
                v_layer.data_ptr(),
                slots.data_ptr(),
                k.shape[0],
                self._head_shape[0],
                self.page_size,
                self._head_bytes,
                torch.get_num_threads(),
            )
            return k_layer, v_layer
        pages, offsets = slots // self.page_size, slots % self.page_size
        k_layer[pages, :, offsets] = k
        v_layer[pages, :, offsets] = v
        return k_layer, v_layer

    def _write_int8(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[QuantizedPages, QuantizedPages]:
        assert self.k_scale is not None and self.v_scale is not None
        if self._native_int8_ok(slots, k, v):
            assert self._kv_write_int8 is not None
            self._kv_write_int8(
                k.data_ptr(),
                v.data_ptr(),
                k.stride(0),
                v.stride(0),
                self.k[layer].data_ptr(),
                self.v[layer].data_ptr(),
                self.k_scale[layer].data_ptr(),
                self.v_scale[layer].data_ptr(),
                slots.data_ptr(),
                k.shape[0],
                self._head_shape[0],
                self.page_size,
                self._head_shape[1],
                torch.get_num_threads(),
            )
            return (
                QuantizedPages(self.k[layer], self.k_scale[layer], self.dtype),
                QuantizedPages(self.v[layer], self.v_scale[layer], self.dtype),
            )
        pages, offsets = slots // self.page_size, slots % self.page_size
        out = []
        for codes, scales, x in (
            (self.k[layer], self.k_scale[layer], k),
            (self.v[layer], self.v_scale[layer], v),
        ):
            q, scale = quantize_int8(x)
            codes[pages, :, offsets] = q
            scales[pages, :, offsets] = scale
            out.append(QuantizedPages(codes, scales, self.dtype))
        return out[0], out[1]

    def _native_int8_ok(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the C int8 writer applies: CPU rows of the model's dtype, heads contiguous
        within a row, int64 slots."""
        if self._kv_write_int8 is None or not self.use_native:
            return False
        if slots.dtype != torch.int64 or not slots.is_contiguous() or not slots.is_cpu:
            return False
        return all(
            t.dtype == self.dtype
            and t.is_cpu
            and t.shape[1:] == self._head_shape
            and t.stride()[1:] == self._head_strides
            for t in (k, v)
        )

    def _native_write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The C scatter (``elementwise.c``'s ``kv_write``) when it applies: CPU tensors of
        the cache's dtype whose heads are contiguous within a token row, int64 slots."""
        if self._kv_write is None or not self.use_native:
            return None
        if slots.dtype != torch.int64 or not slots.is_contiguous() or not slots.is_cpu:
            return None
        dtype = self.k.dtype
        for t in (k, v):
            if (
                t.dtype != dtype
                or not t.is_cpu
                or t.shape[1:] != self._head_shape
                or t.stride()[1:] != self._head_strides
            ):
                return None
        return self._kv_write

    def page_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding part of a page, each [layers, pages, ...]: the keys, the
        values, and an int8 cache's key and value scales. Moving a page moves its slice of
        each (copy-on-write, the KV tiers)."""
        scales = (
            [] if self.k_scale is None or self.v_scale is None else [self.k_scale, self.v_scale]
        )
        return [self.k, self.v, *scales]

    @property
    def page_bytes(self) -> int:
        """The bytes of one page across every layer and every ``page_tensors`` tensor."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.page_tensors())

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src`` → ``dst`` in every layer (copy-on-write of shared pages)."""
        for t in self.page_tensors():
            t[:, dst] = t[:, src]
