"""Gemma 3 (text): ``Gemma3ForCausalLM`` and the text part of ``gemma3_text`` configs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.executor import decode_program
from radixserve.executor.attention import AttentionBackend
from radixserve.executor.layer_ops import LayerOps
from radixserve.executor.layers.activations import GATED_ACTIVATIONS, gelu_tanh_and_mul
from radixserve.executor.layers.attention import AttentionSpec
from radixserve.executor.layers.linear import Linear, fused
from radixserve.executor.layers.norms import fold_one_plus
from radixserve.executor.layers.parallel import TensorParallel
from radixserve.executor.layers.rotary import RotaryEmbedding
from radixserve.executor.lora import LoRAStep
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.base import Weights, parallel_of


@dataclass
class Gemma3LayerWeights:
    """One decoder layer; every norm weight already holds Gemma's ``1 + w``."""

    input_norm: torch.Tensor
    qkv: Linear  # q, k, v fused
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Linear
    post_attn_norm: torch.Tensor  # on the attention output, before the residual add
    pre_ffn_norm: torch.Tensor
    gate_up: Linear  # gate, up fused
    down: Linear
    post_ffn_norm: torch.Tensor  # on the MLP output, before the residual add


class Gemma3ForCausalLM:
    """Gemma 3's decoder (a ``CausalLM``): embeddings scaled by sqrt(hidden), four RMSNorms
    per layer (around attention and around the MLP, each applied to the sublayer's output
    before the residual add), per-head q/k RMSNorm, GeGLU (tanh GELU), attention scaled
    by ``query_pre_attn_scalar ** -0.5``, sliding-window layers (``layer_types``) rotating
    with the local base and global layers with the global base (and its scaling), and the
    LM head tied to the embeddings. Gemma's ``(1 + w)`` norm weights are folded at load.

    Invariant: ``forward`` computes the same function as transformers'
    ``Gemma3ForCausalLM`` of the same config on the same weights (on every rank under
    tensor parallelism); the KV cache and attention backends see an ordinary decoder whose
    layers carry their own ``AttentionSpec``.
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
    ) -> None:
        c = config
        self.config = config
        self.dtype = dtype
        self.ops = ops or LayerOps()
        self.tp = parallel_of(tp)
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        try:
            self.act = GATED_ACTIVATIONS[c.hidden_act]
        except KeyError:
            raise ValueError(f"Gemma 3 with hidden_act {c.hidden_act!r}") from None
        if self.act is gelu_tanh_and_mul:
            self.act = self.ops.gelu_tanh_and_mul  # the fused kernel where built
        source = Weights(weights, dtype)
        take = source.take

        def norm(name: str) -> torch.Tensor:
            return fold_one_plus(take(name))

        self.embed = take("model.embed_tokens.weight")
        if tuple(self.embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"embed_tokens has shape {tuple(self.embed.shape)}, config says "
                f"({c.vocab_size}, {c.hidden_size})"
            )
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype
        self.embed_scale = torch.tensor(c.hidden_size**0.5, dtype=dtype)
        self.layers: list[Gemma3LayerWeights] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = fused([take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
            if qkv.weight.shape != (self.q_size + 2 * self.kv_size, c.hidden_size):
                raise ValueError(f"layer {i}: q/k/v projections do not match the config")
            self.layers.append(
                Gemma3LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=qkv,
                    q_norm=norm(p + "self_attn.q_norm.weight"),
                    k_norm=norm(p + "self_attn.k_norm.weight"),
                    o=Linear(take(p + "self_attn.o_proj.weight")),
                    post_attn_norm=norm(p + "post_attention_layernorm.weight"),
                    pre_ffn_norm=norm(p + "pre_feedforward_layernorm.weight"),
                    gate_up=fused(
                        [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                    ),
                    down=Linear(take(p + "mlp.down_proj.weight")),
                    post_ffn_norm=norm(p + "post_feedforward_layernorm.weight"),
                )
            )
        self.norm = norm("model.norm.weight")
        lm_head = source.take_optional("lm_head.weight")
        tied = lm_head is None or c.tie_word_embeddings
        self.lm_head = Linear(self.embed if tied else lm_head, shared=tied)
        source.drop("rotary_emb")
        source.finish()
        self.mlp_block_rows: int | None = None
        self.rotary_global = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, dtype
        )
        self.rotary_local = RotaryEmbedding(
            c.head_dim,
            c.max_position_embeddings,
            c.rope_local_theta or 10000.0,
            None,
            dtype,
        )
        # decode steps as one native call and the scaled embedding before it
        # (executor/decode_program.py); None: not built (or refused) for _program_for
        self._program: decode_program.DecodeProgram | None = None
        self._program_for: object | None = None

    def attention_specs(self) -> list[AttentionSpec]:
        c = self.config
        scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        return [
            AttentionSpec(
                scale, c.sliding_window if c.is_sliding(i) else None, c.attn_logit_softcapping
            )
            for i in range(c.num_hidden_layers)
        ]

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
        tables = {
            False: self.rotary_global.tables(positions),
            True: self.rotary_local.tables(positions),
        }
        ops = self.ops
        residual = self.embed_tokens(input_ids)
        sublayer_out: torch.Tensor | None = None
        for layer_idx, w in enumerate(self.layers):
            cos, sin = tables[c.is_sliding(layer_idx)]
            x = ops.add_rms_norm(sublayer_out, residual, w.input_norm, eps)
            qkv = w.qkv(x)
            if lora is not None:
                lora.add(qkv, x, layer_idx, "qkv")
            q = qkv[:, : self.q_size].view(num_tokens, heads, head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                num_tokens, kv_heads, head_dim
            )
            v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, kv_heads, head_dim)
            q = ops.rotary(ops.rms_norm_heads(q, w.q_norm, eps), cos, sin)
            k = ops.rotary(ops.rms_norm_heads(k, w.k_norm, eps), cos, sin)
            attn = attention.forward(layer_idx, q, k, v, attn_meta)
            o = w.o(attn)
            if lora is not None:
                lora.add(o, attn, layer_idx, "o")
            attn_out = self.tp.reduce(o)  # row-parallel
            x = ops.add_rms_norm(
                ops.add_rms_norm(None, attn_out, w.post_attn_norm, eps),
                residual,
                w.pre_ffn_norm,
                eps,
            )
            mlp_out = self.tp.reduce(self._mlp(w, x, layer_idx))  # row-parallel
            sublayer_out = ops.add_rms_norm(None, mlp_out, w.post_ffn_norm, eps)
        return ops.add_rms_norm(sublayer_out, residual, self.norm, eps)

    def _mlp(self, w: Gemma3LayerWeights, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """down(gelu_tanh(gate) * up), over row blocks of ``mlp_block_rows`` when set."""
        rows, block = x.shape[0], self.mlp_block_rows
        if block is None or rows <= block:
            return self._block_mlp(w, x, layer, 0)
        out = x.new_empty(rows, x.shape[1])
        for start in range(0, rows, block):
            out[start : start + block] = self._block_mlp(w, x[start : start + block], layer, start)
        return out

    def _block_mlp(
        self, w: Gemma3LayerWeights, x: torch.Tensor, layer: int, first_row: int
    ) -> torch.Tensor:
        """The MLP of rows ``first_row ..`` of the step, with their adapters'."""
        lora = self.lora_step
        gate_up = w.gate_up(x)
        if lora is not None:
            lora.add(gate_up, x, layer, "gate_up", first_row)
        act = self.act(gate_up)
        down = w.down(act)
        if lora is not None:
            lora.add(down, act, layer, "down", first_row)
        return down

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled embedding rows, a fresh [T, hidden] tensor (vocabulary-parallel under TP)."""
        out = self.tp.embedding(input_ids, self.embed)
        return out.mul_(self.embed_scale.to(out.device))

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Logits [S, vocab] for the given hidden rows (soft-capped when the config says
        so), in float32 if ``upcast``."""
        logits = self.tp.logits(self.lm_head, hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if upcast else logits

    def use_layer_ops(self, ops: LayerOps) -> None:
        self.ops = ops
        self._program = self._program_for = None

    def to_device(self, device: torch.device) -> None:
        self.rotary_global.to(device)
        self.rotary_local.to(device)
        self.embed_scale = self.embed_scale.to(device)
