"""What a model's requests are checked against, read from its files without its weights:
a server holding several models checks a request for one not loaded before loading it
(``serving.model_set``), against the same limits its engine will report when ready."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.engine.config import EngineConfig
from radixserve.engine.inputs import sampling_defaults
from radixserve.engine.model_source import resolve_model


@dataclass(frozen=True)
class ModelProfile:
    """A model's request limits as its engine computes them (``engine.builder``): the
    vocabulary, the context length (the flag's, never past the model's) and the sampling
    defaults of its generation config. Invariant: equal to the engine's ``ready`` report
    for the same ``EngineConfig``."""

    vocab_size: int
    max_model_len: int
    sampling_defaults: dict[str, Any]


def context_length(config: EngineConfig, model_max: int) -> int:
    """The context a model is served with: ``--max-model-len``, never past the model's."""
    return min(config.max_model_len or model_max, model_max)


def model_profile(config: EngineConfig) -> ModelProfile:
    """``config``'s model's profile, from its config.json (or GGUF metadata and tensor
    list) and generation_config.json: the weights are not read. ``ValueError`` for a
    model that cannot be read, or one run on a simulated device (its own limits)."""
    from radixserve.executor.loader.gguf_loader import gguf_model_config
    from radixserve.executor.loader.safetensors_loader import read_hf_config, read_json
    from radixserve.executor.model_config import ModelConfig

    if config.simulated_device:
        raise ValueError("a simulated device has no model files to read")
    source = resolve_model(config.model)
    generation: dict[str, Any] = {}
    if source.kind == "gguf":
        try:
            hf_config = gguf_model_config(source.path)
        except (OSError, KeyError) as exc:
            raise ValueError(
                f"{source.path}: not a GGUF file the server can read ({exc})"
            ) from None
    else:
        hf_config = read_hf_config(source.path)
        path = source.path / "generation_config.json"
        generation = read_json(path) if path.is_file() else {}
    mc = ModelConfig.from_hf_dict(hf_config)
    return ModelProfile(
        mc.vocab_size,
        context_length(config, mc.max_model_len),
        sampling_defaults(generation, config.generation_config),
    )
