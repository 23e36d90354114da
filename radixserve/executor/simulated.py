"""A simulated device: a cost model instead of a model, synthetic tokens, a virtual clock
(or real time, through a ``TimedDevice``)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from radixserve.core.page_table import PageTable
from radixserve.core.step import ScheduledBatch
from radixserve.executor.device import PreparedStep, StepResult
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.future_tokens import FutureTokens


@dataclass(frozen=True)
class CostModel:
    """Seconds per step = ``step_s + token_s * batched tokens + kv_token_s * attended KV``.

    Defaults are of the order of SmolLM2-135M in bfloat16 on this repository's 2-core CPU.
    """

    step_s: float = 0.02
    token_s: float = 0.0008
    kv_token_s: float = 2e-6

    def step_seconds(self, num_tokens: int, num_kv_tokens: int) -> float:
        return self.step_s + self.token_s * num_tokens + self.kv_token_s * num_kv_tokens


class VirtualClock:
    """Monotonic simulated time; ``advance`` is the only way it moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, when: float) -> None:
        self.now = max(self.now, when)


@dataclass
class _SimulatedInputs:
    """A simulated step's inputs: its synthetic tokens and, with a page table, the flat
    arrays a real device would take (built for their host cost)."""

    tokens: np.ndarray  # [B] sampled token per row, -1 where none
    slots: np.ndarray
    forward_batch: ForwardBatch | None


class SimulatedRunner:
    """Stands in for ``ModelRunner``: charges the cost model's time and returns synthetic
    tokens. ``execute`` charges it on a virtual clock (or by sleeping); through a device,
    ``prepare`` gives the time to model (``PreparedStep.seconds``) and ``run`` the result.

    Invariant: the token sampled at position p of a request depends only on the request id
    and p, so recomputation after preemption reproduces the same output.
    """

    def __init__(
        self,
        cost: CostModel | None = None,
        vocab_size: int = 32000,
        clock: VirtualClock | None = None,
        page_table: PageTable | None = None,
        page_size: int = 16,
    ) -> None:
        self.cost = cost or CostModel()
        self.vocab_size = vocab_size
        self.clock = clock  # None: sleep for real
        self.page_table = page_table  # set: build each step's input arrays like a device
        self.page_size = page_size
        self.future = FutureTokens(page_table.table.shape[0] if page_table is not None else 1)
        self.num_steps = 0
        self.busy_s = 0.0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        step = self.prepare(batch)
        if self.clock is not None:
            self.clock.advance(step.seconds)
        elif step.seconds > 0:
            time.sleep(step.seconds)
        result = self.run(step)
        result.seconds = step.seconds
        return result

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        reqs = batch.requests
        seq_lens = _starts(batch) + batch.num_new_tokens
        seconds = self.cost.step_seconds(batch.num_tokens, int(seq_lens.sum()))
        self.num_steps += 1
        self.busy_s += seconds
        tokens = np.where(batch.sample, self.tokens_at(reqs, seq_lens), -1)
        placeholders = np.full(len(reqs), -1, dtype=np.int64)
        slots = np.zeros(0, dtype=np.int64)
        forward_batch = None
        if self.page_table is not None:
            slots = self.future.reserve(int(np.count_nonzero(batch.sample)))
            placeholders[batch.sample] = FutureTokens.placeholders(slots)
            forward_batch = ForwardBatch.build(batch, self.page_table, self.page_size)
        return PreparedStep(
            placeholders, seconds=seconds, inputs=_SimulatedInputs(tokens, slots, forward_batch)
        )

    def run(self, step: PreparedStep) -> StepResult:
        inputs: _SimulatedInputs = step.inputs
        if inputs.forward_batch is not None:
            # what a device does first: take earlier steps' tokens from the buffer
            ids = self.future.resolve(inputs.forward_batch.input_ids)
            assert ids.size == 0 or ids.min() >= 0, "an input token was never sampled"
            self.future.store(inputs.slots, inputs.tokens[inputs.tokens >= 0])
        return StepResult(inputs.tokens)

    def tokens_at(self, reqs: list, positions: np.ndarray) -> np.ndarray:
        salts = np.fromiter(
            (_stable_hash(r.request_id) for r in reqs), dtype=np.int64, count=len(reqs)
        )
        return (salts * 1_000_003 + positions * 7_919) % self.vocab_size


def _starts(batch: ScheduledBatch) -> np.ndarray:
    if batch.starts.size == len(batch.requests):
        return batch.starts
    return np.fromiter(
        (r.num_computed_tokens for r in batch.requests), dtype=np.int64, count=len(batch.requests)
    )


@functools.lru_cache(maxsize=1 << 16)
def _stable_hash(text: str) -> int:
    """A hash that does not change between processes (unlike ``hash``)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value
