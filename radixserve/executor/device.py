"""Where launched steps run: inline, on a worker thread, or on a timed simulated device.

A device takes a ``PreparedStep`` (inputs built on the host) and returns a ``StepHandle`` at
once; the handle's ``result()`` waits for the step. Steps run in launch order, one at a time,
like kernels on one CUDA stream, so a step may read what an earlier one wrote (KV pages,
sampled tokens in the ``FutureTokens`` buffer) without any other synchronisation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.executor.sampler import TokenLogprobs


@dataclass
class StepResult:
    """``tokens[i]``: the token sampled for ``batch.requests[i]`` (-1 if none this step);
    ``logprobs``: by request id, for sampled requests that asked for logprobs;
    ``prompt_logprobs``: by request id, (p, entries) where entry j is for prompt token
    p + 1 + j, for requests that asked for prompt logprobs and computed prompt tokens."""

    tokens: np.ndarray
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # speculative rows (batch row -> every token emitted: accepted proposals, then the
    # target's own; ``tokens[i]`` is the first) and their logprobs, by request id
    spec_tokens: dict[int, np.ndarray] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # pooling requests, by request id: (first prompt position of the chunk, its tokens, a
    # float32 vector): the sum of the chunk's final hidden states (mean pooling), or the
    # last prompt token's (last pooling, only from the chunk that ends the prompt)
    pooled: dict[str, tuple[int, int, np.ndarray]] = field(default_factory=dict)
    # the time the step took on its device, set by the Device that ran it (modelled time on
    # a simulated device; 0: not measured)
    seconds: float = 0.0


@dataclass
class PreparedStep:
    """A step's inputs, built on the host, ready to launch.

    Invariant: ``placeholders[i]`` (< 0) stands for the token row i samples, wherever
    ``batch.sample[i]``; a later step's input ids may hold it, and the device replaces it
    with the sampled token before that step runs. ``seconds``: modelled device time
    (simulated devices; 0 for a real model). ``inputs``: what the runner's ``run`` needs.
    """

    placeholders: np.ndarray
    seconds: float = 0.0
    inputs: Any = None


class StepHandle:
    """A launched step. Invariant: ``result()`` returns only once the step is complete on
    its device (its future resolved, or its modelled ready time passed), and re-raises the
    step's exception if it failed; it may be called again with the same answer."""

    def __init__(self, future: Future[StepResult] | None = None, ready_at: float = 0.0) -> None:
        self._future = future
        self._ready_at = ready_at
        self._result: StepResult | None = None
        self._error: BaseException | None = None

    @classmethod
    def done(cls, run: Callable[[], StepResult], ready_at: float = 0.0) -> StepHandle:
        handle = cls(ready_at=ready_at)
        try:
            handle._result = run()
        except Exception as exc:  # raised to the caller of result(), as a device would
            handle._error = exc
        return handle

    def result(self) -> StepResult:
        if self._future is not None:
            return self._future.result()
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # releases the CPU, like waiting on a device event
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def _timed(run: Callable[[PreparedStep], StepResult], step: PreparedStep) -> StepResult:
    """``run(step)`` with the time it took in ``seconds``."""
    start = time.perf_counter()
    result = run(step)
    result.seconds = time.perf_counter() - start
    return result


def _modelled(run: Callable[[PreparedStep], StepResult], step: PreparedStep) -> StepResult:
    """``run(step)`` with the step's modelled time in ``seconds`` (a simulated device)."""
    result = run(step)
    result.seconds = step.seconds
    return result


class Device:
    """Runs steps in launch order, one at a time. ``busy_s``: device time spent on steps;
    ``idle_s``: time, from the first launch on, during which nothing was queued."""

    def __init__(self, run: Callable[[PreparedStep], StepResult]) -> None:
        self.run = run
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.num_launched = 0

    @property
    def is_async(self) -> bool:
        """Whether ``launch`` returns before the step is done."""
        return False

    def launch(self, step: PreparedStep) -> StepHandle:
        raise NotImplementedError

    def reset_stats(self) -> None:
        self.busy_s = self.idle_s = 0.0
        self.num_launched = 0

    def close(self) -> None:
        """Release the device's resources (worker threads)."""


class InlineDevice(Device):
    """Runs each step inside ``launch`` (the serial CPU path): the step is complete when
    ``launch`` returns, and the device is idle for all the host does between launches."""

    def __init__(self, run: Callable[[PreparedStep], StepResult]) -> None:
        super().__init__(run)
        self._last_end: float | None = None

    def launch(self, step: PreparedStep) -> StepHandle:
        start = time.monotonic()
        if self._last_end is not None:
            self.idle_s += start - self._last_end
        self.num_launched += 1
        handle = StepHandle.done(lambda: _timed(self.run, step))
        self._last_end = time.monotonic()
        self.busy_s += self._last_end - start
        return handle

    def reset_stats(self) -> None:
        super().reset_stats()
        self._last_end = None


class ThreadDevice(Device):
    """Runs steps on one worker thread, in launch order: the host prepares the next step
    while this one computes (the CPU model as an asynchronous device, for tests of the
    overlapped loop; torch releases the GIL in its kernels)."""

    def __init__(self, run: Callable[[PreparedStep], StepResult]) -> None:
        super().__init__(run)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-device")
        self._lock = threading.Lock()
        self._queued = 0
        self._idle_since: float | None = None

    @property
    def is_async(self) -> bool:
        return True

    def launch(self, step: PreparedStep) -> StepHandle:
        with self._lock:
            if self._queued == 0 and self._idle_since is not None:
                self.idle_s += time.monotonic() - self._idle_since
            self._queued += 1
            self.num_launched += 1
        return StepHandle(self._pool.submit(self._run, step))

    def _run(self, step: PreparedStep) -> StepResult:
        start = time.monotonic()
        try:
            return _timed(self.run, step)
        finally:
            end = time.monotonic()
            with self._lock:
                self.busy_s += end - start
                self._queued -= 1
                if self._queued == 0:
                    self._idle_since = end

    def reset_stats(self) -> None:
        with self._lock:
            super().reset_stats()
            self._idle_since = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class TimedDevice(Device):
    """A simulated device that takes real time: a step's results (synthetic, computed at
    launch) are ready ``step.seconds`` after the device finishes the steps queued before it.
    ``launch`` returns at once; ``result()`` sleeps until then, leaving the CPU to the host.

    Invariant: ``busy_until`` is when the last launched step completes; busy periods never
    overlap, so ``busy_s + idle_s`` is the wall time from the first launch to ``busy_until``.
    """

    def __init__(self, run: Callable[[PreparedStep], StepResult]) -> None:
        super().__init__(run)
        self.busy_until: float | None = None

    @property
    def is_async(self) -> bool:
        return True

    def launch(self, step: PreparedStep) -> StepHandle:
        now = time.monotonic()
        if self.busy_until is not None and now > self.busy_until:
            self.idle_s += now - self.busy_until
        start = now if self.busy_until is None else max(now, self.busy_until)
        self.busy_until = start + step.seconds
        self.busy_s += step.seconds
        self.num_launched += 1
        return StepHandle.done(lambda: _modelled(self.run, step), ready_at=self.busy_until)

    def reset_stats(self) -> None:
        super().reset_stats()
        self.busy_until = None
