"""Model classes by the ``architectures`` name of config.json."""

from __future__ import annotations

from radixserve.executor.model_config import SUPPORTED_ARCHITECTURES
from radixserve.executor.models.llama import LlamaForCausalLM

# One implementation covers the family; the differences (q/k/v bias, q/k norm, rope
# scaling, tied embeddings) are read from the config.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
