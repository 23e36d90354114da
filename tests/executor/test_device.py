"""Devices run launched steps in order; the timed simulated device takes the modelled time
without holding the CPU; placeholders resolve from the FutureTokens buffer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from radixserve.executor.device import (
    InlineDevice,
    PreparedStep,
    StepResult,
    ThreadDevice,
    TimedDevice,
)
from radixserve.executor.future_tokens import FutureTokens


def _step(value: int, seconds: float = 0.0) -> PreparedStep:
    return PreparedStep(np.array([-1]), seconds=seconds, inputs=value)


def test_timed_device_launches_at_once_and_results_wait_for_the_modelled_time():
    device = TimedDevice(lambda step: StepResult(np.array([step.inputs])))
    start = time.monotonic()
    first = device.launch(_step(1, 0.05))
    second = device.launch(_step(2, 0.05))  # queued behind the first
    assert time.monotonic() - start < 0.03  # launching does not wait
    cpu_start = time.process_time()
    assert first.result().tokens.tolist() == [1]
    assert time.monotonic() - start >= 0.05
    assert second.result().tokens.tolist() == [2]
    assert time.monotonic() - start >= 0.1  # one after the other, like a stream
    assert time.process_time() - cpu_start < 0.05  # waiting slept: the CPU was free
    assert device.busy_s == pytest.approx(0.1) and device.idle_s == 0.0
    time.sleep(0.03)
    device.launch(_step(3, 0.01)).result()
    assert device.idle_s >= 0.03  # nothing was queued while the host dawdled


def test_a_failing_step_raises_at_result_not_at_launch():
    def run(step: PreparedStep) -> StepResult:
        raise RuntimeError("boom")

    for device in (InlineDevice(run), TimedDevice(run), ThreadDevice(run)):
        handle = device.launch(_step(0))
        with pytest.raises(RuntimeError, match="boom"):
            handle.result()
        device.close()


def test_thread_device_runs_steps_in_launch_order_off_the_host_thread():
    seen: list[tuple[int, str]] = []
    release = threading.Event()

    def run(step: PreparedStep) -> StepResult:
        if step.inputs == 0:
            release.wait(5)
        seen.append((step.inputs, threading.current_thread().name))
        return StepResult(np.array([step.inputs]))

    device = ThreadDevice(run)
    handles = [device.launch(_step(i)) for i in range(4)]
    assert seen == []  # launch returned while step 0 still runs
    release.set()
    assert [h.result().tokens.tolist() for h in handles] == [[0], [1], [2], [3]]
    assert [i for i, _ in seen] == [0, 1, 2, 3]
    assert all(name.startswith("radixserve-device") for _, name in seen)
    device.close()


def test_future_tokens_resolve_placeholders_of_the_previous_step():
    future = FutureTokens(4)
    slots = future.reserve(3)
    ids = np.array([5, *FutureTokens.placeholders(slots)[[2, 0]], 9])
    future.store(slots, np.array([70, 71, 72]))
    next_slots = future.reserve(4)  # the other half: the step after does not overwrite them
    assert not set(next_slots.tolist()) & set(slots.tolist())
    assert future.resolve(ids).tolist() == [5, 72, 70, 9]
    plain = np.array([1, 2, 3])
    assert future.resolve(plain) is plain
    with pytest.raises(ValueError):
        future.reserve(5)


@pytest.mark.parametrize("kind", ["inline", "thread", "timed"])
def test_every_device_reports_the_time_each_step_took(kind):
    """``StepResult.seconds``: measured around the run (inline, thread), modelled (timed);
    what the fair policy steers its shared step cap by."""

    def run(step: PreparedStep) -> StepResult:
        if kind != "timed":
            time.sleep(step.inputs)
        return StepResult(np.array([0]))

    device = {"inline": InlineDevice, "thread": ThreadDevice, "timed": TimedDevice}[kind](run)
    try:
        got = [device.launch(_step(s, s)).result().seconds for s in (0.02, 0.08)]
        assert got[0] >= 0.02 and got[1] >= 0.08 and got[0] < got[1], got
        assert got[1] < 0.08 + 0.5, got  # (a loaded machine may oversleep a little)
    finally:
        device.close()
