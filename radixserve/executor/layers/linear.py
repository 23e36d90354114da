"""Linear layers as the models use them.

* ``Linear``: y = x W^T (+ b), oneDNN-prepacked for bfloat16 on CPU (``executor/linear.py``).
* the quantized hook: ``quantize_model`` (``executor/quant.py``) replaces every ``Linear``
  a decoder layer holds by ``Int8Linear`` / ``Int4Linear``, which are called the same way.
* column-parallel: a ``Linear`` whose weight is this rank's rows of the full one (q/k/v,
  gate/up), cut by the loader's ``ShardLayout``: its output is this rank's slice.
* row-parallel: a ``Linear`` over this rank's input columns (o, down): its output is a
  partial sum, made whole by ``TensorParallel.reduce`` (``layers/parallel.py``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixserve.executor.linear import Linear

__all__ = ["Linear", "LinearLike", "fused"]


class LinearLike(Protocol):
    """What a model calls: ``Linear`` and its quantized replacements alike."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def fused(weights: list[torch.Tensor], biases: list[torch.Tensor] | None = None) -> Linear:
    """One ``Linear`` over several stacked along the output dim (q/k/v, gate/up): one GEMM.
    Placeholders on the meta device (a GGUF file's layers built from their codes, put in
    later) stack to one placeholder without ``torch.cat`` (which on meta tensors imports
    torch's compiler stack, seconds)."""
    bias = None if biases is None else torch.cat(biases)
    if all(w.device.type == "meta" for w in weights):
        rows = sum(int(w.shape[0]) for w in weights)
        return Linear(torch.empty(rows, *weights[0].shape[1:], device="meta"), bias)
    return Linear(torch.cat(weights, dim=0), bias)
