"""The KV cache tensors: allocated once, addressed by page id."""

from __future__ import annotations

import math

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
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    raw = np.zeros(nbytes + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def bytes_per_page(
    num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


class KVCache:
    """Keys and values of every layer: ``k[layer]`` is [num_pages, kv_heads, page_size, head_dim].

    Page-major, so gathering a batch's pages is one ``index_select`` on dim 0 copying whole
    contiguous pages, and each (page, head) block is a [page_size, head_dim] matrix ready
    for batched matmuls. Invariant: the tensors are allocated once and never reallocated; slot ``s`` is token
    ``s % page_size`` of page ``s // page_size``.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
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
        # False: always the PyTorch path (tests compare the two)
        self.use_native = True

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store token t's k/v [T, kv_heads, head_dim] at slot ``slots[t]`` (int64); returns
        the layer's caches. k and v may be row-strided views (into a fused qkv row)."""
        k_layer, v_layer = self._k_layers[layer], self._v_layers[layer]
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

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages ``src`` → ``dst`` in every layer (copy-on-write of shared pages)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
