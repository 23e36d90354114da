"""Mixture-of-experts MLPs: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per
token; each expert runs once per step over the rows routed to it.

The experts are ordinary layers (``Linear``, or the quantizer's and the GGUF loader's
``Int8GroupLinear`` / ``Int4Linear`` from the file's codes), one pair per expert, so an
expert executes at its own precision through the same kernels as a dense layer: at batch 1
a step reads only the chosen experts' weights, and at larger batches each expert's rows are
one GEMM (the grouped form of vLLM's and SGLang's fused-MoE kernels, one call per expert).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from radixserve.executor.layers.linear import LinearLike
from radixserve.executor.model_config import MoEConfig


@dataclass
class ExpertMLP:
    """One SwiGLU expert: ``down(act(gate) * up)`` with gate and up fused in ``gate_up``
    ([2 * intermediate, hidden]); the quantizer replaces both fields like a dense layer's."""

    gate_up: LinearLike
    down: LinearLike


class SparseMoE:
    """A mixture-of-experts MLP (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss).

    Invariant: ``__call__(x)`` equals transformers' sparse MoE block on the same weights:
    ``router`` [E, hidden] scores every expert (softmax in float32, the top ``top_k``,
    renormalised when ``config.norm_topk_prob``), each chosen expert's output is weighted by
    its score (cast to the activations' dtype first, except Mixtral's: the product in
    float32, then cast) and summed; a ``shared`` expert, when present,
    adds ``sigmoid(shared_gate x) * shared(x)`` for every token. gpt-oss's router has a
    bias and takes a softmax of the top k logits; its experts have biases and a clamped
    SwiGLU (``MoEConfig``). ``experts[e]`` is expert
    ``e``; experts no token chose are not touched (their weights are not read).
    """

    def __init__(
        self,
        config: MoEConfig,
        router: torch.Tensor,
        experts: list[ExpertMLP],
        act_and_mul: Callable[[torch.Tensor], torch.Tensor],
        shared: ExpertMLP | None = None,
        shared_gate: torch.Tensor | None = None,
        router_bias: torch.Tensor | None = None,
    ) -> None:
        if tuple(router.shape[:1]) != (config.num_experts,) or len(experts) != config.num_experts:
            raise ValueError(
                f"the router scores {router.shape[0]} experts and {len(experts)} are loaded; "
                f"the config says {config.num_experts}"
            )
        if (shared is None) != (config.shared_intermediate_size == 0):
            raise ValueError("a shared expert without its size in the config, or the reverse")
        self.config = config
        self.router = router
        self.router_bias = router_bias
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate
        self.act_and_mul = act_and_mul if config.activation == "silu" else self._swiglu_oai
        # the native form of ``routed`` (executor/routed_experts.py keeps it here)
        self.native: Any = None

    def parts(self) -> Iterator[tuple[str, ExpertMLP]]:
        """Every expert with the Hugging Face prefix of its weights (relative to the
        layer): what the quantizer and the GGUF installer reach into."""
        for e, expert in enumerate(self.experts):
            yield f"mlp.experts.{e}.", expert
        if self.shared is not None:
            yield "mlp.shared_expert.", self.shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in ``x``'s dtype (float32 with ``float32_weights``), expert
        ids [T, k]) for each token."""
        logits = F.linear(x, self.router, self.router_bias)
        if self.config.scoring == "topk_softmax":  # gpt-oss: the top k logits, softmaxed
            top, ids = torch.topk(logits, self.config.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.config.top_k, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.config.float32_weights else weights.to(x.dtype)), ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_shared(x, self.routed(x))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted outputs, summed per token (no shared expert)."""
        rows = x.shape[0]
        weights, ids = self.route(x)
        k = self.config.top_k
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        if rows == 1:
            # one token: its k experts in turn, no sort (the decode step at batch 1)
            for slot, e in enumerate(flat.tolist()):
                y = self._expert(self.experts[e], x)
                out.add_((y * weights[:, slot : slot + 1]).to(out.dtype))
        else:
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=self.config.num_experts).tolist()
            token_of = order // k
            weight_of = weights.reshape(-1)[order]
            start = 0
            for e, count in enumerate(counts):
                if not count:
                    continue
                tokens = token_of[start : start + count]
                y = self._expert(self.experts[e], x[tokens])
                out.index_add_(
                    0, tokens, (y * weight_of[start : start + count, None]).to(out.dtype)
                )
                start += count
        return out

    def add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the routed experts' sum for ``x``) plus the gated shared expert's output,
        in place, when the layer has one."""
        if self.shared is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_gate))
            out.add_(gate * self._expert(self.shared, x))
        return out

    def _swiglu_oai(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU over [gate | up] (de-interleaved at load)."""
        limit, alpha = self.config.swiglu_limit, self.config.swiglu_alpha
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _expert(self, expert: ExpertMLP, x: torch.Tensor) -> torch.Tensor:
        return expert.down(self.act_and_mul(expert.gate_up(x)))
