"""The seam between a model family and the runners.

A causal LM is one class per family (``llama.py``, ``gemma3.py``, ``phi3.py``), built from
``executor/layers``; runners, the quantizer and the builder type against ``CausalLM`` and
never against a family.
"""

from __future__ import annotations

from typing import Protocol

import torch

from radixserve.executor.attention import AttentionBackend
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.layers.attention import AttentionSpec
from radixserve.executor.layers.parallel import TensorParallel
from radixserve.executor.lora import LoRAStep
from radixserve.executor.model_config import ModelConfig

__all__ = ["AttentionSpec", "CausalLM", "Weights"]


class CausalLM(Protocol):
    """What a runner needs of a model.

    * ``config`` is this rank's config (its heads and kv heads under tensor parallelism);
      ``dtype`` the activations' dtype; ``embed`` the (this rank's) embedding table, whose
      device is the model's; ``layers`` hold the decoder layers' ``Linear``s (what
      ``quantize_model`` replaces), ``lm_head`` the head.
    * ``forward(input_ids [T], positions [T], attention, meta)`` returns the hidden
      states after the final norm [T, hidden]; ``attention.forward(layer, q, k, v, meta)``
      is called once per layer, in layer order.
    * ``compute_logits(hidden [S, hidden], upcast)`` returns [S, vocab] (the full
      vocabulary on every rank).
    * ``attention_specs()`` gives each layer's ``AttentionSpec`` (window, scale, softcap):
      the backends are built with it.
    * ``use_layer_ops(ops)`` routes the row-wise ops through ``ops`` (Triton on CUDA);
      ``to_device(device)`` moves what the loader did not (rotary tables).
    * ``mlp_block_rows``: the CPU runner's MLP row blocking (None: whole chunks).
    * ``lora_step``: the LoRA adapters of the rows of the forward about to run (the runner
      sets it around each step; None: the base model for every row). ``forward`` adds
      each adapter's product to its rows of every projection it targets.
    """

    config: ModelConfig
    dtype: torch.dtype
    embed: torch.Tensor
    layers: list
    mlp_block_rows: int | None
    lora_step: LoRAStep | None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor: ...

    def attention_specs(self) -> list[AttentionSpec]: ...

    def use_layer_ops(self, ops: LayerOps) -> None: ...

    def to_device(self, device: torch.device) -> None: ...


class Weights:
    """A checkpoint's tensors by Hugging Face name, taken one by one as a model is built.

    Invariant: every tensor is taken at most once, cast to ``dtype`` and contiguous;
    ``finish`` raises when a name was never taken (a checkpoint the model does not
    understand fails loudly instead of running with weights missing)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = tensors
        self.dtype = dtype

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str) -> torch.Tensor:
        try:
            tensor = self.tensors.pop(name)
        except KeyError:
            raise ValueError(f"weight {name!r} is missing from the checkpoint") from None
        return tensor.to(self.dtype).contiguous()

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self.tensors else None

    def drop(self, substring: str) -> None:
        """Forget tensors the model computes itself (e.g. ``rotary_emb`` buffers)."""
        for name in [n for n in self.tensors if substring in n]:
            del self.tensors[name]

    def finish(self) -> None:
        if self.tensors:
            raise ValueError(f"unexpected weights in the checkpoint: {sorted(self.tensors)[:5]}")


def parallel_of(tp: TensorParallel | None) -> TensorParallel:
    """``tp``, or the one-rank context."""
    return tp if tp is not None else TensorParallel()
