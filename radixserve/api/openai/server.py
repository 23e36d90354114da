"""The OpenAI-compatible HTTP app: ``create_app`` wires one ``OpenAIServer`` (``state``)
to its route families (``completions``, ``chat``, ``responses``, ``embeddings``,
``native``, Anthropic's ``messages``), the console, health, metrics and the OpenAPI
document."""

from __future__ import annotations

import logging
import re
import signal
from typing import Any
from urllib.parse import parse_qs, unquote

from radixserve.api.anthropic import messages
from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    Response,
    error_response,
    json_response,
)
from radixserve.api.console.debug import add_debug_routes
from radixserve.api.console.routes import register_console
from radixserve.api.openai import (
    chat,
    completions,
    embeddings,
    lora,
    model_admin,
    native,
    render,
    rerank,
    responses,
)
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.version import __version__
from radixserve.serving.frontend import EngineConfig, Frontend
from radixserve.serving.metrics import render_by_model
from radixserve.serving.tenancy import TenantTag

__all__ = ["OpenAIServer", "ServerConfig", "create_app", "openapi_document"]


log = logging.getLogger("radixserve.api")


def _watch_sighup(server: OpenAIServer) -> None:
    """SIGHUP re-reads the keys file (main thread's loop only: an app run elsewhere, as in
    tests, reloads through ``OpenAIServer.reload_keys``)."""
    import asyncio

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.reload_keys)
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        log.warning("SIGHUP not watched (%s): the keys file is read once", exc)


def create_app(engine_config: EngineConfig, config: ServerConfig | None = None) -> ASGIApp:
    config = config or ServerConfig()
    rerank.rerank_template(config.rerank_template)  # a missing template file fails here
    server = OpenAIServer(engine_config, config)
    models = server.models

    policy = server.policy

    def authorize(request: HTTPRequest) -> APIError | None:
        denied = policy.check(request.path, request.headers)
        return None if denied is None else APIError(denied.status, denied.message, denied.type)

    async def start() -> None:
        if config.api_keys_file is not None:
            _watch_sighup(server)
        await models.start()

    app = ASGIApp(
        config.max_body_bytes,
        authorize,
        start,
        models.shutdown,
        body_timeout_s=config.body_timeout_s,
    )

    def viewed(request: HTTPRequest) -> Frontend:
        """The model a console or debug route looks at: its ``?model=`` (a loaded one), else
        the default model."""
        return server.loaded_frontend(parse_qs(request.query).get("model", [None])[0])

    register_console(app, viewed, lambda request: policy.may_read_prompts(request.headers))
    if config.enable_debug_endpoints:
        add_debug_routes(app, viewed)
    app.server = server  # type: ignore[attr-defined] # (the gRPC frontend shares it)

    @app.route("GET", "/health")
    async def health(_: HTTPRequest) -> Response:
        # every loaded model's engines (a several-model server with none loaded is healthy)
        reasons = [
            f"{name}: {reason}" if models.many else reason
            for name, frontend in models.frontends()
            if (reason := frontend.client.unhealthy_reason()) is not None
        ]
        if not reasons:
            return Response(headers=[])
        return error_response(APIError(503, "; ".join(reasons), "service_unavailable_error"))

    @app.route("GET", "/live")
    async def live(_: HTTPRequest) -> Response:
        # 503 only when a model's engines are gone for good (no restart coming): a process
        # manager should restart the server then; loading or restarting is not that
        reasons = [
            f"{name}: {reason}" if models.many else reason
            for name, frontend in models.frontends()
            if (reason := frontend.client.dead_reason()) is not None
        ]
        if not reasons:
            return Response(headers=[])
        return error_response(APIError(503, "; ".join(reasons), "service_unavailable_error"))

    @app.route("GET", "/version")
    async def version(_: HTTPRequest) -> Response:
        return json_response({"version": __version__})

    @app.route("GET", "/metrics")
    async def metrics(_: HTTPRequest) -> Response:
        loaded = [(name, frontend.metrics) for name, frontend in models.frontends()]
        text = render_by_model(loaded) if models.many else server.frontend.metrics.render()
        return Response(text, headers=[(b"content-type", b"text/plain; version=0.0.4")])

    @app.route("GET", "/openapi.json")
    async def openapi(_: HTTPRequest) -> Response:
        return json_response(openapi_document(app))

    def model_cards(tag: TenantTag, operator: bool) -> list[dict]:
        """Each served model's card (``status``: loaded, loading or unloaded; how it runs
        for the ``operator`` only) and each of its LoRA adapters ``tag``'s key may use
        (vLLM's ``root`` and ``parent``)."""
        cards = []
        adapters = server.adapters()
        for state in models.status(operator):
            name = state.pop("id")
            frontend = models.loaded(name)
            card = {"id": name, "object": "model", "owned_by": "radixserve", **state}
            if frontend is not None:
                card.update(created=frontend.created, max_model_len=frontend.max_model_len)
            cards.append(card)
            for adapter, root in adapters[name].items():
                if tag.may_use(adapter):
                    cards.append(
                        {
                            "id": adapter,
                            "object": "model",
                            "owned_by": "radixserve",
                            "root": root,
                            "parent": name,
                        }
                    )
        return cards

    @app.route("GET", "/v1/models")
    async def list_models(request: HTTPRequest) -> Response:
        operator = server.policy.may_read_prompts(request.headers)
        cards = model_cards(server.tenant_tag(request.headers), operator)
        return json_response({"object": "list", "data": cards})

    @app.route("GET", "/v1/models/{model}")
    async def model(request: HTTPRequest) -> Response:
        name = unquote(request.path_params["model"])
        operator = server.policy.may_read_prompts(request.headers)
        for card in model_cards(server.tenant_tag(request.headers), operator):
            if card["id"] == name or name in card.get("aliases", ()):
                return json_response(card)
        raise server.model_not_found(name)

    if config.many_models:  # (a single model stays loaded: nothing to do by hand)
        model_admin.add_routes(app, server)
    lora.add_routes(app, server)
    native.add_routes(app, server)
    completions.add_routes(app, server)
    chat.add_routes(app, server)
    render.add_routes(app, server)  # vLLM's /v1/completions/render, /v1/chat/completions/render
    responses.add_routes(app, server)
    embeddings.add_routes(app, server)
    rerank.add_routes(app, server)  # /v1/rerank, /v2/rerank, /v1/score
    messages.add_routes(app, server)  # Anthropic's Messages API
    return app


def openapi_document(app: ASGIApp) -> dict:
    """OpenAPI 3.1 for the routes as registered: paths, methods, request body schemas."""
    components: dict[str, dict] = {}
    paths: dict[str, dict] = {}
    error = {"description": "an OpenAI-shaped error: {error: {message, type, param, code}}"}
    for path, methods in sorted(app.routes.items()):
        for method, route in methods.items():
            if not route.in_schema:
                continue
            name = path.strip("/").replace("/", "_").replace("{", "").replace("}", "")
            op: dict[str, Any] = {
                "operationId": f"{method.lower()}_{name or 'root'}",
                "responses": {"200": {"description": "OK"}, "4XX": error, "503": error},
            }
            params = re.findall(r"\{([a-z_]+)\}", path)
            if params:
                op["parameters"] = [
                    {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                    for p in params
                ]
            if route.body_schema is not None:
                schema = dict(route.body_schema)
                components.update(schema.pop("$defs", {}))
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": schema}},
                }
            paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixserve", "version": __version__},
        "paths": paths,
        "components": {"schemas": components},
    }
