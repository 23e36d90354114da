"""Keeping the engine process serving: a watchdog for a hung engine, restart with backoff.

``EngineClient`` (``engine_client.py``) owns one engine process; the pieces here decide, from
what the process reports, whether it is making progress (``ProgressWatch``) and how long to
wait before starting it again (``RestartBackoff``). They hold no sockets and no process, so
their rules are tested without either.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.core.settings import setting, zero_is_none

# An idle engine process sends a heartbeat every 0.25 s: silence this long while it has
# nothing to do means its loop is stuck (a busy one may be silent up to the hang timeout).
IDLE_SILENCE_S = 5.0


@dataclass(frozen=True)
class SupervisorConfig:
    """How the frontend watches and restarts its engine process.

    ``hang_timeout_s``: with work in flight and no step finished for this long, the engine
    counts as hung (None or 0: never); it must exceed the longest step and the structured-
    output compile timeout. ``restart``: start a new engine process when one dies or hangs;
    ``max_restart_attempts``: consecutive failed starts before giving up; the wait before a
    restart doubles from ``backoff_s`` (to ``max_backoff_s``) while engines keep dying
    within ``stable_s`` of their start."""

    hang_timeout_s: float | None = setting(
        120.0,
        name="--engine-hang-timeout",
        parse=zero_is_none(float),
        metavar="SECONDS",
        help="with requests in flight and no engine step finished for this long, the engine "
        "counts as hung: /health is 503 and its requests fail (then it is restarted); 0: off",
    )
    restart: bool = setting(
        True,
        name="--engine-restart",
        help="start a new engine process when it dies or hangs (in-flight requests fail)",
    )
    max_restart_attempts: int = setting(
        3,
        name="--engine-restart-attempts",
        help="failed engine starts in a row before giving up",
    )
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_s: float = 30.0

    def __post_init__(self) -> None:
        if self.hang_timeout_s is not None and self.hang_timeout_s < 0:
            raise ValueError(f"hang timeout must be >= 0, got {self.hang_timeout_s}")
        if self.max_restart_attempts < 1:
            raise ValueError("max_restart_attempts must be >= 1")


class ProgressWatch:
    """When the engine last made progress, as seen by the frontend.

    Progress is a step finished (the step counter in its stats moved) or an output
    arrived. Invariant: ``stalled_for`` counts only time during which the engine had work
    — requests the frontend is waiting on, or running/waiting ones in its last stats — and
    never starts before that work began (``work_started``); with no work it is the silence
    since the last message of any kind."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.reset()

    def reset(self) -> None:
        """A new engine process: heard from now, with nothing to do yet."""
        now = self.clock()
        self.last_heard = now
        self.last_progress = now
        self._steps: int | None = None
        self.engine_busy = False  # running or waiting requests in the last stats

    def heard(self, steps: int | None, outputs: bool, busy: bool | None) -> None:
        """A message arrived: its stats' step count (None: none), whether it carried
        outputs, and whether the engine says it has requests (None: it did not say)."""
        now = self.clock()
        self.last_heard = now
        if outputs or (steps is not None and steps != self._steps):
            self.last_progress = now
        if steps is not None:
            self._steps = steps
        if busy is not None:
            self.engine_busy = busy

    def work_started(self) -> None:
        """The frontend sent work to an engine with none: the clock starts now."""
        self.last_progress = max(self.last_progress, self.clock())

    def stalled_for(self, frontend_waiting: bool) -> tuple[float, bool]:
        """(seconds without progress, whether the engine has work)."""
        now = self.clock()
        if frontend_waiting or self.engine_busy:
            return now - self.last_progress, True
        return now - self.last_heard, False

    def hang_reason(self, frontend_waiting: bool, hang_timeout_s: float | None) -> str | None:
        """Why the engine counts as hung now, or None."""
        stalled, busy = self.stalled_for(frontend_waiting)
        if busy:
            if hang_timeout_s and stalled > hang_timeout_s:
                return (
                    f"the engine made no progress for {stalled:.1f} s with requests in flight "
                    f"(engine hang timeout {hang_timeout_s:g} s)"
                )
        elif stalled > IDLE_SILENCE_S:
            return f"the idle engine has not been heard from for {stalled:.1f} s"
        return None


class RestartBackoff:
    """The wait before each restart. Invariant: 0 after an engine that ran at least
    ``stable_s``; otherwise ``backoff_s`` doubled for each quick death or failed start in
    a row, at most ``max_backoff_s``."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.quick_failures = 0

    def next_delay(self, uptime_s: float | None) -> float:
        """The wait before the next start; ``uptime_s``: how long the engine that just
        ended ran after it was ready (None: it never got ready)."""
        c = self.config
        if uptime_s is not None and uptime_s >= c.stable_s:
            self.quick_failures = 0
            return 0.0
        delay = min(c.max_backoff_s, c.backoff_s * 2**self.quick_failures)
        self.quick_failures += 1
        return delay


def describe_exit(returncode: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` for a Popen return code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class SupervisionCollector(Collector):
    """Prometheus view of an engine client's supervision counters (``client()`` returns
    an object with ``restarts``, ``hangs``, ``deaths`` and ``alive``)."""

    def __init__(self, client: Callable[[], Any]) -> None:
        self._client = client

    def collect(self) -> Iterator:
        c = self._client()
        yield CounterMetricFamily(
            "radixserve_engine_restarts", "Engine processes started again", c.restarts
        )
        yield CounterMetricFamily(
            "radixserve_engine_deaths", "Engine processes that exited unasked", c.deaths
        )
        yield CounterMetricFamily(
            "radixserve_engine_hangs", "Times the watchdog found the engine hung", c.hangs
        )
        yield GaugeMetricFamily("radixserve_engine_up", "1 while the engine serves", float(c.alive))
