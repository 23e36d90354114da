"""Fault injection for reliability tests: off unless ``RADIXSERVE_FAULTS`` is set.

The variable is read once, when an engine starts (a restarted engine process reads it
again, so a crash or hang fault recurs after a restart, as a real one might)::

    RADIXSERVE_FAULTS=step_exception:0.01,engine_crash_after:500,slow_step_ms:2000

Keys (comma-separated ``key:value``; each at most once):

* ``step_exception:P``     each step raises ``InjectedFault`` with probability P (the
  engine fails that step's requests and keeps running);
* ``engine_crash_after:N`` the step after the first N kills the engine process with
  SIGKILL (a hard crash: nothing is flushed, nothing is said);
* ``hang_after:N``         the step after the first N never returns (a hung device);
* ``slow_step_ms:MS``      a step first sleeps MS milliseconds ...
* ``slow_step_p:P``        ... with probability P (default 1: every step);
* ``seed:S``               seed of the random draws (default: fixed, 0).

Off (unset or empty), the engine's step path has no hook at all (``FaultInjector.from_env``
returns None and nothing is wrapped).
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_VAR = "RADIXSERVE_FAULTS"


class InjectedFault(RuntimeError):
    """The exception ``step_exception`` raises inside a step."""


@dataclass(frozen=True)
class FaultSpec:
    """What to inject. Invariant: probabilities in [0, 1], counts and times >= 0."""

    step_exception: float = 0.0
    engine_crash_after: int | None = None
    hang_after: int | None = None
    slow_step_ms: float = 0.0
    slow_step_p: float = 1.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return bool(
            self.step_exception
            or self.engine_crash_after is not None
            or self.hang_after is not None
            or self.slow_step_ms
        )


_FLOAT_KEYS = {"step_exception", "slow_step_ms", "slow_step_p"}
_INT_KEYS = {"engine_crash_after", "hang_after", "seed"}
_PROBABILITIES = {"step_exception", "slow_step_p"}


def parse_faults(text: str) -> FaultSpec:
    """``"key:value,key:value"`` as a ``FaultSpec``; ``ValueError`` naming what is wrong."""
    values: dict[str, float | int] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition(":")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise ValueError(f"{ENV_VAR}: expected key:value, got {item!r}")
        if key not in _FLOAT_KEYS | _INT_KEYS:
            known = ", ".join(sorted(_FLOAT_KEYS | _INT_KEYS))
            raise ValueError(f"{ENV_VAR}: unknown fault {key!r} (known: {known})")
        if key in values:
            raise ValueError(f"{ENV_VAR}: {key!r} is given twice")
        try:
            value: float | int = int(raw) if key in _INT_KEYS else float(raw)
        except ValueError:
            kind = "an integer" if key in _INT_KEYS else "a number"
            raise ValueError(f"{ENV_VAR}: {key} must be {kind}, got {raw!r}") from None
        if key in _PROBABILITIES and not 0.0 <= value <= 1.0:
            raise ValueError(f"{ENV_VAR}: {key} is a probability in [0, 1], got {raw!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{ENV_VAR}: {key} must be a finite number >= 0, got {raw!r}")
        values[key] = value
    return FaultSpec(**values)  # type: ignore[arg-type]


class FaultInjector:
    """Counts the steps an engine runs and injects ``spec``'s faults into them.

    Invariant: ``on_step`` is called once at the start of every step the device runs
    (from the device's thread), so ``steps`` is the number of steps begun."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.steps = 0
        self._rng = random.Random(spec.seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultInjector | None:
        """The injector ``RADIXSERVE_FAULTS`` asks for, or None (unset, empty: no faults)."""
        text = (os.environ if env is None else env).get(ENV_VAR, "")
        spec = parse_faults(text)
        if not spec.active:
            return None
        logger.warning("fault injection is ON: %s=%s", ENV_VAR, text)
        return cls(spec)

    def on_step(self) -> None:
        """Called as a step starts: crash, hang, sleep or raise, as the spec says."""
        spec = self.spec
        with self._lock:
            self.steps += 1
            step = self.steps
            slow = spec.slow_step_ms > 0 and self._rng.random() < spec.slow_step_p
            fail = spec.step_exception > 0 and self._rng.random() < spec.step_exception
        if spec.engine_crash_after is not None and step > spec.engine_crash_after:
            logger.error("injected fault: engine crash at step %d (SIGKILL)", step)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the signal is asynchronous; never return from this step
        if spec.hang_after is not None and step > spec.hang_after:
            logger.error("injected fault: step %d hangs", step)
            while True:
                time.sleep(3600)
        if slow:
            time.sleep(spec.slow_step_ms / 1000)
        if fail:
            raise InjectedFault(f"injected fault: step_exception at step {step}")
