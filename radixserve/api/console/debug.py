"""Debug endpoints, registered only with ``--enable-debug-endpoints`` (and behind the API
key when one is set): what a soak test needs to check the server from outside.

* ``POST /debug/flush_cache``: if the engine is idle, check its KV page accounting, empty
  the radix tree, and report ``kv_pages_free`` of ``kv_pages_total``; ``pages_leaked`` is
  their difference (0 unless pages leaked). Busy: ``idle`` false, nothing is touched.
* ``GET /debug/engine``: the engine process's pid and the server's, the supervision state
  (running, restarting, hung, dead), why, and the restart/death/hang counts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.serving.engine_streams import EngineDead


def add_debug_routes(app: ASGIApp, frontend: Callable[[HTTPRequest], Any]) -> None:
    """Register the debug routes on ``app``; ``frontend`` gives the serving ``Frontend`` a
    request looks at (its ``?model=``, else the default model)."""

    @app.route("POST", "/debug/flush_cache", in_schema=False)
    async def flush_cache(request: HTTPRequest) -> Response:
        try:
            answer = await frontend(request).client.flush_cache()
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code=exc.code) from None
        return json_response(
            {
                "idle": answer.idle,
                "kv_pages_total": answer.kv_pages_total,
                "kv_pages_free": answer.kv_pages_free,
                "pages_leaked": answer.kv_pages_total - answer.kv_pages_free
                if answer.idle
                else None,
                "radix_nodes_before": answer.radix_nodes_before,
                "error": answer.error,
            }
        )

    @app.route("GET", "/debug/engine", in_schema=False)
    async def engine(request: HTTPRequest) -> Response:
        client = frontend(request).client
        process = client.process
        return json_response(
            {
                "server_pid": os.getpid(),
                "engine_pid": process.pid if process is not None else None,
                "state": client.state,
                "reason": client.unhealthy_reason(),
                "restarts": client.restarts,
                "deaths": client.deaths,
                "hangs": client.hangs,
            }
        )
