"""Rank 0's model runner in a tensor-parallel group, for either runner (CPU or CUDA).

The TP part is a mixin over the runner's seam: ``_compute`` (all model work of a step, hence
every collective) and ``_sample`` (rank 0 alone). ``TPModelRunner`` is it over the CPU
``ModelRunner``; ``executor/cuda/tp_runner.py`` puts it over ``CudaModelRunner``.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.core.page_table import PageTable
from radixserve.executor.device import PreparedStep, StepResult
from radixserve.executor.distributed import DeviceLost, TensorParallelGroup, encode_step
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.model_runner import ModelRunner, _ModelInputs
from radixserve.executor.models.base import CausalLM
from radixserve.executor.sampler import Sampler


class TensorParallelRunner:
    """Mixin for a ``ModelRunner`` (or subclass) on rank 0 of a tensor-parallel group.

    Invariant: before running a step's model work, ``run`` sends the step to every rank;
    all collectives of the step happen inside ``_compute`` on every rank in the same order
    (the worker mirrors it with ``ModelRunner.follow_step``, built from the same two
    methods). A failure there is ``DeviceLost`` (the group is out of step); sampling, local
    to rank 0, fails only its batch.
    """

    tp: TensorParallelGroup

    def _start_tp(self, tp: TensorParallelGroup) -> None:
        """Agree on the KV cache (pages, including any scratch page) with every rank."""
        self.tp = tp
        runner: Any = self
        tp.start(runner.model, runner.kv_cache.num_pages, runner.kv_cache.page_size)

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepResult:
        runner: Any = self
        inputs: _ModelInputs = step.inputs
        fb = inputs.forward_batch
        self.tp.check()
        plans = [(p.first_row, int(p.targets.numel())) for p in inputs.prompt_logprobs]
        try:
            resolved = runner.future.resolve(fb.input_ids)
            self.tp.send(*encode_step(fb, resolved, inputs.copies, plans))
            logits, prompt_logprobs, pooled = runner._compute(inputs)
        except DeviceLost as exc:
            self.tp.fail_after(exc)
            raise self.tp.lost from None  # type: ignore[misc]
        except Exception as exc:  # the other ranks may be inside a collective: out of step
            self.tp.fail(f"rank 0 failed inside a step ({type(exc).__name__}: {exc})")
            raise self.tp.lost from exc  # type: ignore[misc]
        tokens, logprobs = runner._sample(inputs, logits)
        return StepResult(tokens, logprobs, prompt_logprobs, pooled=pooled)


class TPModelRunner(TensorParallelRunner, ModelRunner):
    """The CPU ``ModelRunner`` on rank 0 of a tensor-parallel group (gloo)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        page_table: PageTable,
        sampler: Sampler,
        tp: TensorParallelGroup,
    ) -> None:
        ModelRunner.__init__(self, model, kv_cache, page_table, sampler)
        self._start_tp(tp)
