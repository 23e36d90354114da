"""Frontend-side timings of recent requests, for the console's dashboard
(``/v1/engine/stats``): fed by ``EngineClient.generate`` for every request it runs."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from radixserve.serving.protocol import Delta


@dataclass
class _Tracked:
    """One prompt of a request while it runs."""

    request_id: str
    started: float  # monotonic
    wall: float  # unix time
    prompt_tokens: int
    remaining: int  # samples not finished
    cached_tokens: int = 0
    completion_tokens: int = 0
    first: float | None = None
    last: dict[int, float] = field(default_factory=dict)
    finish_reason: str | None = None


def _percentiles(samples: deque[float]) -> dict[str, float | int | None]:
    if not samples:
        return {"p50": None, "p90": None, "p99": None, "count": 0}
    s = sorted(samples)
    n = len(s)

    def at(q: float) -> float:
        return s[min(n - 1, int(q * n))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "count": n}


class RequestTracker:
    """Frontend-side timings for the dashboard: counters that only grow, windows of the
    latest TTFT / inter-token / end-to-end samples, and the last ``recent`` requests.

    Invariant: every tracked prompt is in ``_live`` from ``start`` until ``close``, then
    in ``recent`` (newest last) with a finish reason ("cancelled" if the client left
    before the engine finished it)."""

    def __init__(self, recent: int = 50, window: int = 512, itl_window: int = 4096) -> None:
        self._live: dict[str, _Tracked] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self.ttft: deque[float] = deque(maxlen=window)
        self.e2e: deque[float] = deque(maxlen=window)
        self.itl: deque[float] = deque(maxlen=itl_window)
        self.requests_started = 0
        self.requests_finished = 0
        self.prompt_tokens = 0  # of prompts whose first token came back
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.started_at = time.time()

    def start(self, request_id: str, prompt_tokens: int, n: int) -> None:
        now = time.monotonic()
        self._live[request_id] = _Tracked(request_id, now, time.time(), prompt_tokens, n)
        self.requests_started += 1

    def observe(self, delta: Delta) -> None:
        t = self._live.get(delta.request_id)
        if t is None:
            return
        if delta.token_ids:
            now = time.monotonic()
            if t.first is None:
                t.first = now
                self.ttft.append(now - t.started)
                self.prompt_tokens += t.prompt_tokens
                self.cached_prompt_tokens += delta.num_cached_tokens
            previous = t.last.get(delta.index)
            if previous is not None:
                self.itl.append(now - previous)
            t.last[delta.index] = now
            t.completion_tokens += len(delta.token_ids)
            self.generation_tokens += len(delta.token_ids)
        t.cached_tokens = max(t.cached_tokens, delta.num_cached_tokens)
        if delta.finished:
            t.remaining -= 1
            t.finish_reason = delta.finish_reason

    def close(self, request_id: str) -> None:
        t = self._live.pop(request_id, None)
        if t is None:
            return
        now = time.monotonic()
        e2e = now - t.started
        reason = t.finish_reason if t.remaining <= 0 else "cancelled"
        self.e2e.append(e2e)
        self.requests_finished += 1
        decode_s = max(t.last.values()) - t.first if t.first is not None else 0.0
        self.recent.append(
            {
                "id": t.request_id,
                "started": t.wall,
                "prompt_tokens": t.prompt_tokens,
                "cached_tokens": t.cached_tokens,
                "completion_tokens": t.completion_tokens,
                "ttft_s": None if t.first is None else t.first - t.started,
                "e2e_s": e2e,
                "decode_tokens_per_s": (t.completion_tokens - 1) / decode_s
                if decode_s > 0
                else None,
                "finish_reason": reason,
            }
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests_started": self.requests_started,
            "requests_finished": self.requests_finished,
            "requests_in_flight": len(self._live),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "ttft_s": _percentiles(self.ttft),
            "itl_s": _percentiles(self.itl),
            "e2e_s": _percentiles(self.e2e),
        }
