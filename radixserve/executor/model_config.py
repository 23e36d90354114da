"""The architecture facts the executor needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape.

    Invariant: ``num_attention_heads`` is a multiple of ``num_key_value_heads`` and
    ``architecture`` is one of ``SUPPORTED_ARCHITECTURES``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def max_model_len(self) -> int:
        # Attention here is full (no sliding window): cap the context at the window so a
        # model trained with one is never run past what it saw.
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        architectures = cfg.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {architectures or '(none given)'}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            rope_params = dict(cfg.get("rope_parameters") or {})
            rope_scaling = cfg.get("rope_scaling") or None
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
            rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
            use_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM")
            sliding_window = cfg.get("sliding_window") if use_window else None
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; the others say so in config.json.
                attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias")),
                qk_norm=arch == "Qwen3ForCausalLM",
                sliding_window=int(sliding_window) if sliding_window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"config.json is missing or has a malformed field: {exc}") from exc
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of {kv_heads=}")
        if config.hidden_act_ok(cfg):
            return config
        raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")

    @staticmethod
    def hidden_act_ok(cfg: dict[str, Any]) -> bool:
        return cfg.get("hidden_act", "silu") == "silu"
