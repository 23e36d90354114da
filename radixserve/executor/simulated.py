"""A simulated device: a cost model instead of a model, synthetic tokens, a virtual clock."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from radixserve.core.step import ScheduledBatch
from radixserve.executor.model_runner import StepResult


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


class SimulatedRunner:
    """Stands in for ``ModelRunner``: charges the cost model's time (on a virtual clock, or
    really sleeping) and returns synthetic tokens.

    Invariant: the token sampled at position p of a request depends only on the request id
    and p, so recomputation after preemption reproduces the same output.
    """

    def __init__(
        self,
        cost: CostModel | None = None,
        vocab_size: int = 32000,
        clock: VirtualClock | None = None,
    ) -> None:
        self.cost = cost or CostModel()
        self.vocab_size = vocab_size
        self.clock = clock  # None: sleep for real
        self.num_steps = 0
        self.busy_s = 0.0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        reqs = batch.requests
        seq_lens = (
            np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
            + batch.num_new_tokens
        )
        seconds = self.cost.step_seconds(batch.num_tokens, int(seq_lens.sum()))
        self.num_steps += 1
        self.busy_s += seconds
        if self.clock is not None:
            self.clock.advance(seconds)
        elif seconds > 0:
            time.sleep(seconds)
        return StepResult(np.where(batch.sample, self.tokens_at(reqs, seq_lens), -1))

    def tokens_at(self, reqs: list, positions: np.ndarray) -> np.ndarray:
        salts = np.fromiter(
            (_stable_hash(r.request_id) for r in reqs), dtype=np.int64, count=len(reqs)
        )
        return (salts * 1_000_003 + positions * 7_919) % self.vocab_size


def _stable_hash(text: str) -> int:
    """A hash that does not change between processes (unlike ``hash``)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value
