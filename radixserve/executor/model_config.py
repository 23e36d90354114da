"""The architecture facts the executor needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
)
# the mixture-of-experts families: their config keys for the expert count and size
_MOE = {
    "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "MixtralForCausalLM": ("num_local_experts", "intermediate_size"),
    "OlmoeForCausalLM": ("num_experts", "intermediate_size"),
    "GptOssForCausalLM": ("num_local_experts", "intermediate_size"),
}

# model_type of config.json -> architecture, for configs without ``architectures`` (the
# text part of a Gemma 3 checkpoint is ``gemma3_text``)
_MODEL_TYPES = {"gemma3_text": "Gemma3ForCausalLM"}
_SLIDING = "sliding_attention"
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config: ``num_experts`` experts of
    ``intermediate_size`` (a SwiGLU MLP each), ``top_k`` of them per token, chosen by a
    router over the hidden state; layer ``i`` is sparse when ``sparse_layers[i]`` (else a
    dense MLP of the model's ``intermediate_size``).

    Invariant: ``0 < top_k <= num_experts``; ``sparse_layers`` has one entry per layer.
    ``scoring`` is ``"softmax"`` (softmax over every expert's logit, then the top k;
    renormalised to sum 1 when ``norm_topk_prob``: Qwen2/3-MoE, Mixtral, OLMoE) or
    ``"topk_softmax"`` (the top k logits, then a softmax over them: gpt-oss); a
    ``shared_intermediate_size`` > 0 adds an always-on shared expert gated by
    sigmoid(``shared_expert_gate`` x) (Qwen2-MoE). ``activation`` is ``"silu"``
    (``silu(gate) * up``) or ``"swiglu_oai"`` (gpt-oss: gate clamped above at
    ``swiglu_limit``, up to +-``swiglu_limit``, ``(up + 1) * gate * sigmoid(swiglu_alpha *
    gate)``); ``router_bias`` / ``expert_bias``: the router and the experts' projections
    carry biases (gpt-oss).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]
    scoring: str = "softmax"
    shared_intermediate_size: int = 0
    float32_weights: bool = False  # Mixtral: weights the experts' outputs in float32
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_bias: bool = False
    expert_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "topk_softmax"):
            raise ValueError(f"router scoring {self.scoring!r} is not supported")
        if self.activation not in ("silu", "swiglu_oai"):
            raise ValueError(f"expert activation {self.activation!r} is not supported")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape and the per-family facts its model file reads.

    Invariant: ``num_attention_heads`` is a multiple of ``num_key_value_heads``,
    ``architecture`` is one of ``SUPPORTED_ARCHITECTURES``, and ``layer_types`` is empty (every
    layer attends globally) or has one entry per layer, ``"sliding_attention"`` for a layer
    that attends the last ``sliding_window`` positions (``sliding_window`` then set).
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
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rotary base
    query_pre_attn_scalar: float | None = None  # Gemma: attention scale = this ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoEConfig | None = None  # experts in (some) layers' MLPs; None: dense
    qk_norm_whole: bool = False  # OLMoE: q/k norms over the whole projection, not per head
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv
    o_bias: bool = False  # gpt-oss: the attention's output projection has a bias
    attention_sinks: bool = False  # gpt-oss: a learned sink logit per head in the softmax

    @property
    def max_model_len(self) -> int:
        # sliding-window layers are honoured by every attention backend: the context is the
        # model's full length, not the window
        return self.max_position_embeddings

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == _SLIDING

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        architectures = list(cfg.get("architectures") or [])
        if cfg.get("model_type") in _MODEL_TYPES:
            architectures.append(_MODEL_TYPES[cfg["model_type"]])
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
            local_params: dict[str, Any] = {}
            if "full_attention" in rope_params:  # per layer type (Gemma 3 in transformers 5)
                local_params = dict(rope_params.get(_SLIDING) or {})
                rope_params = dict(rope_params["full_attention"] or {})
            rope_scaling = cfg.get("rope_scaling") or None
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                if "original_max_position_embeddings" in cfg:  # Phi-3's longrope
                    rope_scaling.setdefault(
                        "original_max_position_embeddings", cfg["original_max_position_embeddings"]
                    )
            default_theta = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
            rope_theta = float(
                cfg.get("rope_theta") or rope_params.get("rope_theta") or default_theta
            )
            num_layers = int(cfg["num_hidden_layers"])
            sliding_window, layer_types = _sliding_layers(arch, cfg, num_layers)
            rope_local_theta = None
            if arch == "Gemma3ForCausalLM":
                rope_local_theta = float(
                    cfg.get("rope_local_base_freq") or local_params.get("rope_theta") or 10000.0
                )
            hidden_act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
            partial = (rope_scaling or {}).get("partial_rotary_factor") or cfg.get(
                "partial_rotary_factor"
            )
            if partial is not None and float(partial) != 1.0:
                raise ValueError(
                    f"partial_rotary_factor {partial} is not supported (rotary over the whole head)"
                )
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            config = cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(
                    cfg.get("tie_word_embeddings", arch == "Gemma3ForCausalLM")
                ),
                # Qwen2 always has q/k/v biases; the others say so in config.json.
                attention_bias=arch == "Qwen2ForCausalLM"
                or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))
                or (arch == "GptOssForCausalLM" and bool(cfg.get("attention_bias", True)))
                or bool(cfg.get("attention_bias")),
                qk_norm=arch
                in (
                    "Qwen3ForCausalLM",
                    "Gemma3ForCausalLM",
                    "Qwen3MoeForCausalLM",
                    "OlmoeForCausalLM",
                ),
                qk_norm_whole=arch == "OlmoeForCausalLM",
                clip_qkv=_float_or_none(cfg.get("clip_qkv")),
                moe=_moe_config(arch, cfg, num_layers),
                o_bias=arch == "GptOssForCausalLM" and bool(cfg.get("attention_bias", True)),
                attention_sinks=arch == "GptOssForCausalLM",
                sliding_window=int(sliding_window) if sliding_window else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                hidden_act=str(hidden_act),
                layer_types=layer_types,
                rope_local_theta=rope_local_theta,
                query_pre_attn_scalar=_float_or_none(
                    cfg.get("query_pre_attn_scalar", 256 if arch == "Gemma3ForCausalLM" else None)
                ),
                attn_logit_softcapping=_float_or_none(cfg.get("attn_logit_softcapping")),
                final_logit_softcapping=_float_or_none(cfg.get("final_logit_softcapping")),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"config.json is missing or has a malformed field: {exc}") from exc
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of {kv_heads=}")
        if config.hidden_act not in _ACTIVATIONS.get(arch, ("silu",)):
            raise ValueError(
                f"hidden_act {config.hidden_act!r} is not supported for {arch} "
                f"(supported: {', '.join(_ACTIVATIONS.get(arch, ('silu',)))})"
            )
        return config


_ACTIVATIONS = {"Gemma3ForCausalLM": ("gelu_pytorch_tanh", "gelu_tanh")}


def _moe_config(arch: str, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The experts of an MoE family's config, as transformers places them: Qwen2/3-MoE
    sparse on every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``; Mixtral
    and OLMoE on every layer. Mixtral always renormalises the top-k weights."""
    if arch not in _MOE:
        return None
    count_key, size_key = _MOE[arch]
    # transformers 5 writes Qwen3-MoE's count as num_local_experts; the published configs
    # say num_experts
    experts = int(cfg.get(count_key) or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        raise ValueError(f"{arch}: config has no experts ({count_key}={cfg.get(count_key)})")
    sparse = [True] * num_layers
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    norm = True if arch == "MixtralForCausalLM" else bool(cfg.get("norm_topk_prob", False))
    gpt_oss = arch == "GptOssForCausalLM"
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg.get("num_experts_per_tok") or 2),
        intermediate_size=int(cfg[size_key]),
        norm_topk_prob=norm,
        sparse_layers=tuple(sparse),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if arch == "Qwen2MoeForCausalLM"
        else 0,
        float32_weights=arch == "MixtralForCausalLM",
        scoring="topk_softmax" if gpt_oss else "softmax",
        activation="swiglu_oai" if gpt_oss else "silu",
        swiglu_alpha=float(cfg.get("swiglu_alpha") or 1.702),
        swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
        router_bias=gpt_oss,
        expert_bias=gpt_oss,
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _sliding_layers(
    arch: str, cfg: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types) as transformers decides them for ``arch``: Mistral slides on
    every layer when it has a window; Qwen2/Qwen3 when ``use_sliding_window``, from layer
    ``max_window_layers`` on (Qwen3-MoE: every layer; Qwen2-MoE: the even-indexed layers
    below ``max_window_layers``); Gemma 3 on every layer but each ``sliding_window_pattern``-th
    (6); an explicit ``layer_types`` list wins. ``()``: every layer global."""
    window = cfg.get("sliding_window")
    if arch in _QWEN and not cfg.get("use_sliding_window"):
        window = None
    if arch == "Phi3ForCausalLM" and window is not None:
        window = None if int(window) >= int(cfg.get("max_position_embeddings", 4096)) else window
    if not window:
        return None, ()
    window = int(window)
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        types = tuple(str(t) for t in types)
    elif arch == "GptOssForCausalLM":  # transformers: even-indexed layers slide
        types = tuple(_SLIDING if (i + 1) % 2 else "full_attention" for i in range(num_layers))
    elif arch == "Qwen3MoeForCausalLM":  # every layer
        types = (_SLIDING,) * num_layers
    elif arch == "Qwen2MoeForCausalLM":  # transformers: odd-numbered layers below the bound
        first = int(cfg.get("max_window_layers", num_layers))
        types = tuple(
            _SLIDING if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)
        )
    elif arch in _QWEN:
        first = int(cfg.get("max_window_layers", num_layers))
        types = tuple(_SLIDING if i >= first else "full_attention" for i in range(num_layers))
    elif arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        types = tuple(
            _SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        )
    else:
        types = (_SLIDING,) * num_layers
    if _SLIDING not in types:
        return None, ()
    return window, types
