"""The web console: static pages (playground, dashboard, radix tree view) and the two JSON
routes they read, ``/v1/engine/stats`` and ``/v1/engine/radix``.

The pages are plain HTML/CSS/JS shipped in ``console_static/`` (no CDN, no build step) and
talk to the server's own OpenAI routes, same origin, with the same API key rules.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import numpy as np

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.engine_client import EngineDead
from radixserve.api.protocol import Delta

if TYPE_CHECKING:
    from radixserve.api.server import OpenAIServer

_STATIC = {
    "index.html": b"text/html; charset=utf-8",
    "app.js": b"text/javascript; charset=utf-8",
    "style.css": b"text/css; charset=utf-8",
}
# the console's own files only: no inline script, no other origin
_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
_RADIX_MAX_NODES = 512  # the engine-side cost grows with it (benchmarks/console_radix.py)
_RADIX_MAX_DEPTH = 64


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


def _static(name: str) -> bytes:
    return resources.files("radixserve.api").joinpath("console_static", name).read_bytes()


def _int_param(query: dict[str, list[str]], name: str, default: int, top: int) -> int:
    raw = query.get(name)
    if not raw:
        return default
    try:
        value = int(raw[-1])
    except ValueError:
        raise APIError(400, f"{name} must be an integer", param=name) from None
    if not 1 <= value <= top:
        raise APIError(400, f"{name} must be in [1, {top}]", param=name)
    return value


def register_console(app: ASGIApp, server: OpenAIServer) -> None:
    """Add the console pages and its JSON routes to ``app``."""
    files = {name: _static(name) for name in _STATIC}  # read once: the package is immutable

    def page(name: str):
        headers = [
            (b"content-type", _STATIC[name]),
            (b"cache-control", b"no-cache"),
            (b"x-content-type-options", b"nosniff"),
            (b"content-security-policy", _CSP),
            (b"referrer-policy", b"no-referrer"),
        ]

        async def handler(_: HTTPRequest) -> Response:
            return Response(files[name], headers=list(headers))

        return handler

    app.route("GET", "/", in_schema=False)(page("index.html"))
    app.route("GET", "/console", in_schema=False)(page("index.html"))
    for name in _STATIC:
        app.route("GET", f"/console/{name}", in_schema=False)(page(name))

    @app.route("GET", "/v1/engine/stats")
    async def engine_stats(_: HTTPRequest) -> Response:
        client = server.client
        s = client.stats
        engine: dict[str, Any] = {"alive": client.alive}
        if s is not None:
            hit_rate = s.cache_hit_tokens / s.cache_queried_tokens if s.cache_queried_tokens else 0
            engine.update(
                running=s.running,
                waiting=s.waiting,
                kv_pages_total=s.kv_pages_total,
                kv_pages_free=s.kv_pages_free,
                kv_pages_evictable=s.kv_pages_evictable,
                kv_pages_protected=s.kv_pages_protected,
                kv_pages_used=s.kv_pages_total - s.kv_pages_free - s.kv_pages_evictable,
                cache_hit_tokens=s.cache_hit_tokens,
                cache_queried_tokens=s.cache_queried_tokens,
                prefix_cache_hit_rate=hit_rate,
                preemptions=s.preemptions,
                steps=s.steps,
                radix_nodes=s.radix_nodes,
            )
        tracker = server.console
        return json_response(
            {
                "object": "engine_stats",
                "model": server.model_name,
                "time": time.time(),
                "uptime_s": time.time() - tracker.started_at,
                "engine": engine,
                "frontend": tracker.snapshot(),
                "recent": list(reversed(tracker.recent)),
            }
        )

    @app.route("GET", "/v1/engine/radix")
    async def engine_radix(request: HTTPRequest) -> Response:
        query = parse_qs(request.query)
        max_nodes = _int_param(query, "max_nodes", 256, _RADIX_MAX_NODES)
        max_depth = _int_param(query, "max_depth", 8, _RADIX_MAX_DEPTH)
        try:
            s = await server.client.radix_summary(max_nodes, max_depth)
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code="engine_dead") from None
        if s.error is not None:
            raise APIError(400, s.error)
        decode = server.tokenizer.decode
        nodes = []
        for (
            node_id,
            parent,
            ns,
            depth,
            tokens,
            subtree,
            pages,
            locks,
            age,
            children,
            raw,
        ) in s.nodes:
            preview = np.frombuffer(raw, dtype="<i4").tolist()
            node = {
                "id": node_id,
                "parent": parent,
                "namespace": ns,
                "depth": depth,
                "tokens": tokens,
                "subtree_tokens": subtree,
                "pages": pages,
                "lock_count": locks,
                "age": age,
                "children": children,
                "preview_ids": preview,
                "preview_text": decode(preview) if preview else None,
            }
            nodes.append(node)
        return json_response(
            {
                "object": "radix_summary",
                "page_size": s.page_size,
                "namespaces": s.namespaces,
                "total_nodes": s.total_nodes,
                "total_tokens": s.total_tokens,
                "evictable_pages": s.evictable_pages,
                "protected_pages": s.protected_pages,
                "truncated": s.truncated,
                "engine_cost_ms": s.cost_ms,
                "nodes": nodes,
            }
        )
