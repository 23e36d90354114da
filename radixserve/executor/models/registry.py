"""Model classes by the ``architectures`` name of config.json."""

from __future__ import annotations

from typing import Protocol

import torch

from radixserve.executor.layers.parallel import TensorParallel
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.base import CausalLM
from radixserve.executor.models.gemma3 import Gemma3ForCausalLM
from radixserve.executor.models.llama import LlamaForCausalLM
from radixserve.executor.models.phi3 import Phi3ForCausalLM


class ModelClass(Protocol):
    """A family's constructor: its weights by Hugging Face name, taken as it is built."""

    def __call__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        tp: TensorParallel | None = None,
    ) -> CausalLM: ...


def _registry() -> dict[str, ModelClass]:
    # one file per family; Llama's covers Mistral, Qwen2, Qwen3 and the MoE families (q/k/v
    # bias, q/k norm, experts, rope scaling, tied embeddings and sliding windows are read
    # from the config)
    registry: dict[str, ModelClass] = {
        arch: LlamaForCausalLM
        for arch in (
            "LlamaForCausalLM",
            "MistralForCausalLM",
            "Qwen2ForCausalLM",
            "Qwen3ForCausalLM",
            "Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM",
            "MixtralForCausalLM",
            "OlmoeForCausalLM",
            "GptOssForCausalLM",
        )
    }
    registry["Gemma3ForCausalLM"] = Gemma3ForCausalLM
    registry["Phi3ForCausalLM"] = Phi3ForCausalLM
    return registry


MODEL_REGISTRY = _registry()


def model_class(architecture: str) -> ModelClass:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """The model of ``config.architecture`` over ``weights`` (one rank's under ``tp``)."""
    return model_class(config.architecture)(config, weights, dtype, tp=tp)
