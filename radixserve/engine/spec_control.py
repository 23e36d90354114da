"""When to speculate: an online cost controller per decode batch size (docs/speculative.md).

A speculative step costs more than a plain decode step (the proposer, the draft's decode
steps, the verify chunk's extra rows) and emits more tokens (the accepted proposals). Which
side wins depends on the batch size, the proposer's acceptance on the current requests and
the machine, so the controller measures it: per batch-size bucket it keeps the seconds, the
tokens and the verified rows of the last few steps, plain and speculative apart, and
speculates when the speculative side's tokens per second are higher. A side's rate is its
tokens over its seconds, summed over those steps, leaving out bursts: a step whose seconds
per row are more than ``_BURST`` times the side's median seconds per row (a step that met
a new shape, kernel selection or buffers growing, or a burst of other load on a shared
machine, can take ten times as long, and one such step must not decide). A ratio of sums,
because tokens per speculative step are bimodal (1 when the first proposal is rejected,
k + 1 when all are kept) and throughput is their mean (a median of per-step rates calls a
proposer that is right 40 % of the time a loss when it is a 2x gain); and because with
the adaptive proposal length (executor/spec/length.py) a speculative step's seconds vary
with its rows, long steps emitting more tokens, so a median of seconds over a mean of
tokens would pair the tokens of long steps with the time of short ones. The burst test is
per row for the same reason: at batch 1 a 2-row verify and a 13-row one differ by about 2x
in seconds per row (a step's fixed cost spread over fewer rows), well within ``_BURST``.

Nothing here touches a model or a token: the decision only chooses which of two exact
paths a step takes (the verify rule keeps outputs identical, or identical in distribution),
so a wrong decision costs time, never correctness.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Upper edges of the batch-size buckets: 1, 2, 3, 4, 5-6, 7-8, 9-12, 13-16, 17-24, ...
# a step slower per row than this many times its side's median is a burst, left out
_BURST = 3.0

_EDGES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_of(batch: int) -> int:
    """The upper edge of the bucket holding ``batch`` decoding requests (>= 1)."""
    if batch < 1:
        raise ValueError(f"a batch holds at least one request, got {batch}")
    for edge in _EDGES:
        if batch <= edge:
            return edge
    top = _EDGES[-1]
    while top < batch:
        top *= 2
    return top


def bucket_label(edge: int) -> str:
    """``'5-6'`` for the bucket with upper edge 6 (``'1'`` for 1)."""
    i = _EDGES.index(edge) if edge in _EDGES else -1
    low = 1 if i == 0 else (_EDGES[i - 1] + 1 if i > 0 else edge // 2 + 1)
    return str(edge) if low == edge else f"{low}-{edge}"


class _Side:
    """Recent steps of one kind (plain or speculative) in one bucket.

    Invariant: ``steps`` holds (seconds, tokens, rows) of the last ``window`` steps
    recorded (each > 0); ``samples`` counts every step ever recorded."""

    def __init__(self, window: int) -> None:
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=window)
        self.samples = 0

    def add(self, seconds: float, tokens: int, rows: int) -> None:
        self.steps.append((seconds, tokens, rows))
        self.samples += 1

    @property
    def rate(self) -> float:
        """Tokens over seconds, summed over the window's steps but its bursts (seconds per
        row above ``_BURST`` times the median); 0 before any sample."""
        if not self.steps:
            return 0.0
        per_row = statistics.median(s / r for s, _, r in self.steps)
        kept = [(s, t) for s, t, r in self.steps if s <= _BURST * per_row * r]
        # never empty: the step at (or below) the median is kept
        return sum(t for _, t in kept) / sum(s for s, _ in kept)


@dataclass
class _Bucket:
    """The controller's state for one batch-size bucket.

    Invariant: ``speculate`` is the side chosen for the bucket's ordinary steps; every
    ``interval`` decisions (counted down by ``countdown``) one step takes the other side,
    so both averages stay current and the choice can change."""

    speculate: bool
    countdown: int
    interval: int
    plain: _Side
    spec: _Side


class SpecController:
    """Decides per step whether to speculate, from measured tokens per second.

    Invariants:
      * per batch-size bucket (``bucket_of``), a step speculates iff the bucket's chosen
        side is speculative, except one exploration step every ``interval`` decisions, which
        takes the other side; the interval starts at ``explore_min``, stays there until
        both sides have ``min_samples``, then doubles with each exploration (up to
        ``explore_max``), and falls back to ``explore_min`` when the choice changes;
      * once both sides have a sample, an exploration of a side measured ``c`` times slower
        than the chosen one costs about ``c - 1`` steps' time, so the interval is also at
        least ``(c - 1) / explore_budget`` (up to ``explore_cap``, by default 512 or
        ``explore_max`` if larger): explorations cost at most
        about ``explore_budget`` of the time (a draft model's exploration at a large batch,
        its catch-up included, measured 4-5 plain steps);
      * before both sides of a bucket have ``min_samples`` recorded steps, the choice is the
        cold-start default: speculate iff the batch holds at most ``cold_max_batch``
        requests (the crossover measured on the reference machine);
      * afterwards the choice changes only when the other side's tokens per second (tokens
        over seconds of its last ``window`` steps, bursts left out) beat the chosen side's
        by more than
        ``hysteresis`` (a relative margin), so noise near the crossover does not flip it
        every step;
      * only ``record`` changes the measurements; ``decide`` only counts down.
    """

    def __init__(
        self,
        cold_max_batch: int,
        *,
        window: int = 8,
        explore_min: int = 8,
        explore_max: int = 64,
        min_samples: int = 3,
        hysteresis: float = 0.03,
        explore_budget: float = 0.02,
        explore_cap: int | None = None,
    ) -> None:
        if cold_max_batch < 0:
            raise ValueError(f"cold_max_batch must be >= 0, got {cold_max_batch}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= explore_min <= explore_max:
            raise ValueError(f"need 1 <= explore_min <= explore_max, got {explore_min}")
        if min_samples < 1 or hysteresis < 0:
            raise ValueError("min_samples must be >= 1 and hysteresis >= 0")
        if explore_cap is None:
            explore_cap = max(512, explore_max)
        if explore_budget <= 0 or explore_cap < explore_max:
            raise ValueError("explore_budget must be > 0 and explore_cap >= explore_max")
        self.cold_max_batch = cold_max_batch
        self.window = window
        self.explore_min = explore_min
        self.explore_max = explore_max
        self.min_samples = min_samples
        self.hysteresis = hysteresis
        self.explore_budget = explore_budget
        self.explore_cap = explore_cap
        self.buckets: dict[int, _Bucket] = {}
        self.decisions = {True: 0, False: 0}  # steps told to speculate / not
        self.explorations = 0

    def _bucket(self, batch: int) -> _Bucket:
        edge = bucket_of(batch)
        b = self.buckets.get(edge)
        if b is None:
            # the cold default: speculate iff the whole bucket is at or below the crossover
            b = _Bucket(
                edge <= self.cold_max_batch,
                self.explore_min,
                self.explore_min,
                _Side(self.window),
                _Side(self.window),
            )
            self.buckets[edge] = b
        return b

    def decide(self, batch: int) -> bool:
        """Whether a step with ``batch`` decoding requests speculates."""
        b = self._bucket(batch)
        b.countdown -= 1
        if b.countdown <= 0:
            measured = min(b.spec.samples, b.plain.samples)
            if measured >= self.min_samples:
                b.interval = min(2 * b.interval, self.explore_max)
            if measured >= 1:  # what an exploration costs is known from its first sample
                b.interval = max(b.interval, self._priced(b))
            b.countdown = b.interval
            self.explorations += 1
            choice = not b.speculate
        else:
            choice = b.speculate
        self.decisions[choice] += 1
        return choice

    def _priced(self, b: _Bucket) -> int:
        """The interval at which exploring the other side costs ``explore_budget`` of the
        time, from how much slower it measured (1 when it is not slower)."""
        chosen, other = (b.spec, b.plain) if b.speculate else (b.plain, b.spec)
        if other.rate <= 0.0:
            return self.explore_cap
        slower = chosen.rate / other.rate - 1.0
        return min(self.explore_cap, max(1, math.ceil(slower / self.explore_budget)))

    def record(
        self, batch: int, speculated: bool, seconds: float, tokens: int, rows: int | None = None
    ) -> None:
        """A pure decode step of ``batch`` requests took ``seconds``, verified ``rows``
        tokens (plain: one per request, the default; speculative: proposals + 1 per
        request) and emitted ``tokens`` (plain: one per request; speculative: accepted
        proposals + 1 per request)."""
        rows = batch if rows is None else rows
        if seconds <= 0.0 or tokens <= 0 or rows <= 0:
            return
        b = self._bucket(batch)
        (b.spec if speculated else b.plain).add(seconds, tokens, rows)
        if speculated != b.speculate and min(b.spec.samples, b.plain.samples) >= 1:
            # an exploration just measured: the next one no sooner than its price says
            b.interval = max(b.interval, self._priced(b))
            b.countdown = max(b.countdown, b.interval)
        if min(b.spec.samples, b.plain.samples) < self.min_samples:
            return
        chosen, other = (b.spec, b.plain) if b.speculate else (b.plain, b.spec)
        if other.rate > chosen.rate * (1.0 + self.hysteresis):
            b.speculate = not b.speculate
            b.interval = b.countdown = self.explore_min
            logger.info(
                "speculation %s at batch %s: %.1f tok/s speculating, %.1f tok/s plain",
                "on" if b.speculate else "off",
                bucket_label(bucket_of(batch)),
                b.spec.rate,
                b.plain.rate,
            )

    def table(self) -> list[dict[str, object]]:
        """The buckets' state, smallest batch first (for logs and benchmarks)."""
        return [
            {
                "batch": bucket_label(edge),
                "speculate": b.speculate,
                "spec_tok_s": round(b.spec.rate, 1),
                "plain_tok_s": round(b.plain.rate, 1),
                "spec_samples": b.spec.samples,
                "plain_samples": b.plain.samples,
            }
            for edge, b in sorted(self.buckets.items())
        ]
