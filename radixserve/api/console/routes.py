"""The web console: static pages (playground, dashboard, radix tree view) and the two JSON
routes they read, ``/v1/engine/stats`` and ``/v1/engine/radix``.

The pages are plain HTML/CSS/JS shipped in ``static/`` (no CDN, no build step) and
talk to the server's own OpenAI routes, same origin, with the same API key rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import numpy as np

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.serving.engine_streams import EngineDead

if TYPE_CHECKING:
    from radixserve.serving.frontend import Frontend

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


def _static(name: str) -> bytes:
    return resources.files("radixserve.api.console").joinpath("static", name).read_bytes()


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


def register_console(
    app: ASGIApp,
    frontend: Callable[[HTTPRequest], Frontend],
    may_read_prompts: Callable[[HTTPRequest], bool],
) -> None:
    """Add the console pages and its JSON routes to ``app``; ``frontend`` gives the model a
    request looks at (its ``?model=``, else the default one). The radix view's token ids
    and text (other users' prompts) are in its answer only when ``may_read_prompts``
    says so for the request (the admin key); otherwise it shows counts alone."""
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
    async def engine_stats(request: HTTPRequest) -> Response:
        client = frontend(request).client
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
                spec_proposed_tokens=s.spec_proposed_tokens,
                spec_accepted_tokens=s.spec_accepted_tokens,
                spec_acceptance_rate=(
                    s.spec_accepted_tokens / s.spec_proposed_tokens
                    if s.spec_proposed_tokens
                    else 0.0
                ),
                spec_mean_accepted_length=(
                    1 + s.spec_accepted_tokens / s.spec_verify_rows if s.spec_verify_rows else 0.0
                ),
            )
        tracker = frontend(request).client.tracker
        return json_response(
            {
                "object": "engine_stats",
                "model": frontend(request).model_name,
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
            s = await frontend(request).client.radix_summary(max_nodes, max_depth)
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code="engine_dead") from None
        if s.error is not None:
            raise APIError(400, s.error)
        decode = frontend(request).tokenizer.decode
        readable = may_read_prompts(request)
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
            tier,
        ) in s.nodes:
            preview = np.frombuffer(raw, dtype="<i4").tolist() if readable else []
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
                "tier": tier,  # where its KV pages are: 0 the pool, 1 the host tier
                "preview_ids": preview if readable else None,
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
