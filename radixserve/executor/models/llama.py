"""Llama-family decoder (Llama 2/3.x, Mistral, SmolLM, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.executor import decode_program
from radixserve.executor.attention import AttentionBackend
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.layers.attention import AttentionSpec
from radixserve.executor.layers.linear import Linear, fused
from radixserve.executor.layers.moe import ExpertMLP, SparseMoE
from radixserve.executor.layers.parallel import TensorParallel
from radixserve.executor.layers.rotary import RotaryEmbedding
from radixserve.executor.lora import LoRAStep
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.base import Weights, parallel_of
from radixserve.executor.routed_experts import routed_experts_for


@dataclass
class DecoderLayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v fused (+ bias)
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # [2 * intermediate, hidden]: gate, up fused; None: ``moe``
    down: Linear | None
    moe: SparseMoE | None = None  # the MLP of a sparse layer (experts)
    sinks: torch.Tensor | None = None  # gpt-oss: a sink logit per head (float32)


# Mixtral's names for its MoE weights, as Qwen-MoE's (the names the loaders and the
# quantizer use): w1 gate, w3 up, w2 down
_MIXTRAL_NAMES = (
    (".block_sparse_moe.gate.", ".mlp.gate."),
    (".block_sparse_moe.experts.", ".mlp.experts."),
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)


def canonical_moe_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with Mixtral's MoE names (``block_sparse_moe``, ``w1/w2/w3``) and
    gpt-oss's stacked experts as Qwen-MoE's (``mlp.gate``, ``mlp.experts.E.gate/up/
    down_proj``)."""
    if any(
        name.endswith((".mlp.experts.gate_up_proj_blocks", ".mlp.experts.down_proj_blocks"))
        for name in weights
    ):
        raise ValueError(
            "this gpt-oss checkpoint keeps its experts as MXFP4 blocks (quantization_config "
            "mxfp4), which the Hugging Face loader here does not read: run its GGUF file "
            "(MXFP4 experts run from their codes) or a bfloat16 export"
        )
    if any(".mlp.router." in name for name in weights):
        return _split_gpt_oss_experts(weights)
    if not any(".block_sparse_moe." in name for name in weights):
        return weights
    out = {}
    for name, tensor in weights.items():
        if ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        out[name] = tensor
    return out


def _split_gpt_oss_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's experts ([E, hidden, 2I] ``gate_up_proj`` with gate and up interleaved by
    column, [E, I, hidden] ``down_proj``, their biases) as one [I, hidden] / [hidden, I]
    weight and bias per expert and projection; the router ``mlp.router`` as ``mlp.gate``."""
    out = {}
    for name, tensor in weights.items():
        if ".mlp.router." in name:
            out[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            p = name.removesuffix("gate_up_proj")
            for e in range(tensor.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = tensor[e, :, 0::2].t()
                out[f"{p}{e}.up_proj.weight"] = tensor[e, :, 1::2].t()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            p = name.removesuffix("gate_up_proj_bias")
            for e in range(tensor.shape[0]):
                out[f"{p}{e}.gate_proj.bias"] = tensor[e, 0::2]
                out[f"{p}{e}.up_proj.bias"] = tensor[e, 1::2]
        elif name.endswith(".mlp.experts.down_proj"):
            p = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = tensor[e].t()
        elif name.endswith(".mlp.experts.down_proj_bias"):
            p = name.removesuffix("down_proj_bias")
            for e in range(tensor.shape[0]):
                out[f"{p}{e}.down_proj.bias"] = tensor[e]
        else:
            out[name] = tensor
    return out


class LlamaForCausalLM:
    """Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts kin (Qwen2-MoE, Qwen3-MoE,
    Mixtral, OLMoE; ``SparseMoE`` in the sparse layers) (a ``CausalLM``): the weights in
    Hugging Face semantics, fused where that saves kernel launches; with ``tp`` one rank's
    part of the model (the loader's ``ShardLayout`` cut the weights; ``config`` is the
    rank's local config).

    Invariant: ``forward`` computes the same function as the Hugging Face model of the same
    config on the same weights (on every rank under tensor parallelism); hidden states of
    all tokens come out, logits only for the rows asked for (``compute_logits``).
    """

    # the LoRA adapters of the step's rows (the runner sets it around each step; None: base)
    lora_step: LoRAStep | None = None

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        ops: LayerOps | None = None,
        tp: TensorParallel | None = None,
    ):
        self.config = config
        self.dtype = dtype
        self.ops = ops or LayerOps()
        self.tp = parallel_of(tp)
        c = config
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        source = Weights(canonical_moe_names(weights), dtype)
        take, take_optional = source.take, source.take_optional

        self.embed = take("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(self.embed.shape)}, config says "
                f"({c.vocab_size}, {c.hidden_size})"
            )
        self.layers: list[DecoderLayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if p + "self_attn.qkv_proj.weight" in source:  # stored fused (Phi-3)
                qkv = Linear(take(p + "self_attn.qkv_proj.weight"))
            else:
                qkv = fused(
                    [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")],
                    [take(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")]
                    if c.attention_bias
                    else None,
                )
            moe = None
            if c.moe is not None and c.moe.sparse_layers[i]:
                moe = self._sparse_moe(source, p, c.moe.intermediate_size)
                gate_up = down = None
            elif p + "mlp.gate_up_proj.weight" in source:  # stored fused (Phi-3)
                gate_up = Linear(take(p + "mlp.gate_up_proj.weight"))
                down = Linear(take(p + "mlp.down_proj.weight"))
            else:
                gate_up = fused([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                down = Linear(take(p + "mlp.down_proj.weight"))
            self.layers.append(
                DecoderLayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=qkv,
                    q_norm=take(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                    k_norm=take(p + "self_attn.k_norm.weight") if c.qk_norm else None,
                    o=Linear(
                        take(p + "self_attn.o_proj.weight"),
                        take(p + "self_attn.o_proj.bias") if c.o_bias else None,
                    ),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=gate_up,
                    down=down,
                    moe=moe,
                    sinks=source.take(p + "self_attn.sinks").float() if c.attention_sinks else None,
                )
            )
            if qkv.weight.shape != (self.q_size + 2 * self.kv_size, c.hidden_size):
                raise ValueError(f"layer {i}: q/k/v projections do not match the config")
            if gate_up is not None and gate_up.weight.shape != (
                2 * c.intermediate_size,
                c.hidden_size,
            ):
                raise ValueError(f"layer {i}: gate/up projections do not match the config")
        self.norm = take("model.norm.weight")
        lm_head = take_optional("lm_head.weight")
        tied = lm_head is None or c.tie_word_embeddings
        self.lm_head = Linear(self.embed if tied else lm_head, shared=tied)
        source.drop("rotary_emb")
        source.finish()
        # CPU: the MLP of a long chunk in row blocks (see _mlp); None: the whole chunk at once
        self.mlp_block_rows: int | None = None
        self.rotary = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype
        )
        # decode steps as one native call (executor/decode_program.py), built at
        # the first such step for its attention backend; None: not looked at yet
        self._program: decode_program.DecodeProgram | None = None
        self._program_for: object | None = None  # the backend it was built (or refused) for

    def _sparse_moe(self, source: Weights, p: str, inter: int) -> SparseMoE:
        """Layer ``p``'s experts (each gate/up fused), router and shared expert."""
        c = self.config
        assert c.moe is not None

        bias = c.moe.expert_bias

        def expert(q: str, size: int) -> ExpertMLP:
            gate_up = fused(
                [source.take(q + "gate_proj.weight"), source.take(q + "up_proj.weight")],
                [source.take(q + "gate_proj.bias"), source.take(q + "up_proj.bias")]
                if bias
                else None,
            )
            if gate_up.weight.shape != (2 * size, c.hidden_size):
                raise ValueError(f"{q}: gate/up projections do not match the config")
            down_bias = source.take(q + "down_proj.bias") if bias else None
            return ExpertMLP(gate_up, Linear(source.take(q + "down_proj.weight"), down_bias))

        experts = [expert(f"{p}mlp.experts.{e}.", inter) for e in range(c.moe.num_experts)]
        shared = shared_gate = None
        if c.moe.shared_intermediate_size:
            shared = expert(p + "mlp.shared_expert.", c.moe.shared_intermediate_size)
            shared_gate = source.take(p + "mlp.shared_expert_gate.weight").reshape(1, -1)
        return SparseMoE(
            c.moe,
            source.take(p + "mlp.gate.weight"),
            experts,
            self._silu_and_mul,
            shared,
            shared_gate,
            source.take(p + "mlp.gate.bias") if c.moe.router_bias else None,
        )

    def _silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' activation through the model's current ops (``use_layer_ops``)."""
        return self.ops.silu_and_mul(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        attn_meta: object,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]."""
        lora = self.lora_step
        program = decode_program.program_for(self, attention, attn_meta)
        if program is not None and program.accepts(input_ids, positions, attn_meta, lora):
            return program.run(input_ids, positions, attn_meta, lora)
        c = self.config
        eps = c.rms_norm_eps
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = self.rotary.tables(positions)
        ops = self.ops
        # ``residual`` is the running sum of the residual stream, updated in place; each
        # residual add is folded into the RMSNorm that follows it
        residual = self.embed_tokens(input_ids)
        sublayer_out: torch.Tensor | None = None
        for layer_idx, w in enumerate(self.layers):
            x = ops.add_rms_norm(sublayer_out, residual, w.input_norm, eps)
            qkv = w.qkv(x)
            if lora is not None:
                lora.add(qkv, x, layer_idx, "qkv")
            if c.qk_norm_whole:  # OLMoE: q and k normed over all their heads at once
                qkv = self._norm_whole_qk(qkv, w)
            if c.clip_qkv is not None:  # (after the norms, as OLMoE does)
                qkv = qkv.clamp(-c.clip_qkv, c.clip_qkv)
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, kv_heads, head_dim)
            if w.q_norm is None or c.qk_norm_whole:
                # q and k rotate together as one [T, heads + kv_heads, d] view.
                qk = qkv[:, : self.q_size + self.kv_size].view(
                    num_tokens, heads + kv_heads, head_dim
                )
                qk = ops.rotary(qk, cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = qkv[:, : self.q_size].view(num_tokens, heads, head_dim)
                k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                    num_tokens, kv_heads, head_dim
                )
                q = ops.rotary(ops.rms_norm_heads(q, w.q_norm, eps), cos, sin)
                k = ops.rotary(ops.rms_norm_heads(k, w.k_norm, eps), cos, sin)
            attn = attention.forward(layer_idx, q, k, v, attn_meta)
            # o and down are row-parallel: tp.reduce makes their partial sums whole
            o = w.o(attn)
            if lora is not None:
                lora.add(o, attn, layer_idx, "o")
            x = ops.add_rms_norm(self.tp.reduce(o), residual, w.post_norm, eps)
            sublayer_out = self.tp.reduce(self._mlp(w, x, layer_idx))
        return ops.add_rms_norm(sublayer_out, residual, self.norm, eps)

    def _norm_whole_qk(self, qkv: torch.Tensor, w: DecoderLayerWeights) -> torch.Tensor:
        eps, rows = self.config.rms_norm_eps, qkv.shape[0]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = self.ops.rms_norm_heads(qkv[:, :q_end].view(rows, 1, q_end), w.q_norm, eps)
        k = self.ops.rms_norm_heads(qkv[:, q_end:k_end].view(rows, 1, self.kv_size), w.k_norm, eps)
        return torch.cat([q.view(rows, q_end), k.view(rows, self.kv_size), qkv[:, k_end:]], dim=1)

    def attention_specs(self) -> list[AttentionSpec]:
        c = self.config
        scale = c.head_dim**-0.5
        return [
            AttentionSpec(scale, c.sliding_window if c.is_sliding(i) else None, sinks=w.sinks)
            for i, w in enumerate(self.layers)
        ]

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Run the row-wise ops with ``ops`` (the CUDA path's Triton kernels)."""
        self.ops = ops
        self._program = self._program_for = None

    def to_device(self, device: torch.device) -> None:
        """Move the rotary tables to ``device`` (the loader placed the weights)."""
        self.rotary.to(device)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden] embedding rows (a fresh tensor: the residual stream is updated in
        place); vocabulary-parallel under tensor parallelism."""
        return self.tp.embedding(input_ids, self.embed)

    def _mlp(self, w: DecoderLayerWeights, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """down(silu(gate) * up), over row blocks of ``mlp_block_rows`` when set: on CPU the
        [T, 2 * intermediate] activations of a long prompt chunk fall out of cache between
        the three ops, and GEMMs with fewer rows each run ~6% faster here (measured at
        T = 2048, SmolLM2's shapes)."""
        if w.moe is not None:
            # the native op's activation is LayerOps' native kernel: only under those ops
            native_ops = type(self.ops) is LayerOps and self.ops.native is not None
            native = routed_experts_for(w.moe) if native_ops else None
            if native is not None and native.accepts(x):
                return w.moe.add_shared(x, native.run(x))
            return w.moe(x)
        rows = x.shape[0]
        block = self.mlp_block_rows
        if block is None or rows <= block:
            return self._dense_mlp(w, x, layer, 0)
        out = x.new_empty(rows, x.shape[1])
        for start in range(0, rows, block):
            out[start : start + block] = self._dense_mlp(w, x[start : start + block], layer, start)
        return out

    def _dense_mlp(
        self, w: DecoderLayerWeights, x: torch.Tensor, layer: int, first_row: int
    ) -> torch.Tensor:
        """down(silu(gate) * up) of rows ``first_row ..`` of the step, with their adapters'."""
        assert w.gate_up is not None and w.down is not None
        lora = self.lora_step
        gate_up = w.gate_up(x)
        if lora is not None:
            lora.add(gate_up, x, layer, "gate_up", first_row)
        act = self.ops.silu_and_mul(gate_up)
        down = w.down(act)
        if lora is not None:
            lora.add(down, act, layer, "down", first_row)
        return down

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits [S, vocab] for the given hidden rows, in float32 if ``upcast``."""
        logits = self.tp.logits(self.lm_head, hidden)
        return logits.float() if upcast else logits
