"""The OpenAI-compatible HTTP API: one ``OpenAIServer`` over the serving frontend, its
route families (``completions``, ``chat``, ``responses``, ``embeddings``, ``native``), the console, health, metrics and
the OpenAPI document."""

from __future__ import annotations

import logging
import re
import signal
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import orjson
from pydantic import BaseModel

from radixserve.api import auth
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
from radixserve.api.openai import chat, completions, embeddings, native, responses
from radixserve.api.openai.converter import parse_body
from radixserve.api.openai.response_store import ANY_TENANT, DEFAULT_MAX_RESPONSES, ResponseStore
from radixserve.api.tenants import load_keys_file, tenant_tag
from radixserve.core.version import __version__
from radixserve.serving.frontend import EngineConfig, Frontend, ServingConfig
from radixserve.serving.supervisor import SupervisorConfig
from radixserve.serving.tenancy import Routing, TenantTag

_PROTECTED_PREFIXES = ("/v1/", "/debug/")  # (/v1/messages takes x-api-key too)
_PROTECTED_PATHS = frozenset({"/generate", "/tokenize", "/detokenize"})
ADMIN_PREFIXES = ("/v1/engine/", "/debug/")
ADMIN_PATHS = frozenset({"/metrics"})
# what the server stores for tenants (GET/DELETE /v1/responses/{id}): an admin key may read
# and delete any tenant's
STORED_PREFIX = "/v1/responses/"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    tool_call_parser: str = "hermes"  # hermes | llama3_json
    grammar_compile_timeout_s: float = 10.0  # longer: the request is a 400
    data_parallel_size: int = 1  # engine processes behind this frontend (serving/dp_client)
    dp_policy: str = "cache-aware"
    dp_balance: Any = None  # serving.balancer.BalanceConfig (None: its defaults)
    supervision: SupervisorConfig = field(default_factory=SupervisorConfig)  # watchdog, restarts
    enable_debug_endpoints: bool = False  # /debug/* (see console/debug.py)
    # /v1/embeddings on a generative model (an embedding model is always served); pooling:
    # "last" | "mean" (None: the model's own, else last-token)
    enable_embeddings: bool = False
    embedding_pooling: str | None = None
    max_stored_responses: int = DEFAULT_MAX_RESPONSES  # the Responses API's store
    # per-request limits (a 400 naming the limit): prompts, prompts x n, prompt tokens in
    # all, completion tokens asked for in all (max_tokens x n x prompts)
    max_prompts_per_request: int = 64
    max_sequences_per_request: int = 256
    max_prompt_tokens_per_request: int = 1 << 18
    max_completion_tokens_per_request: int = 1 << 20
    body_timeout_s: float | None = 30.0  # a body must arrive this long after its headers
    # admin routes (console data, /v1/engine/*, /debug/*, /metrics): their own keys; without
    # any they are served only when the server listens on loopback
    admin_api_keys: tuple[str, ...] = ()
    loopback_only: bool = True
    # inference keys naming their tenants (api/tenants.py), re-read on SIGHUP
    api_keys_file: str | None = None

    def serving(self) -> ServingConfig:
        """The transport-independent part, for the serving frontend."""
        return ServingConfig(
            served_model_name=self.served_model_name,
            data_parallel_size=self.data_parallel_size,
            dp_policy=self.dp_policy,
            dp_balance=self.dp_balance,
            supervision=self.supervision,
            grammar_compile_timeout_s=self.grammar_compile_timeout_s,
        )


class OpenAIServer:
    """The OpenAI API of one server process over its ``Frontend``. Invariants: bad input is
    answered 400 before anything reaches the engine; every request sent to the engine is
    either answered or aborted (client gone); output JSON is written with orjson, SSE
    frames preformatted."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.config = config
        file_entries = () if config.api_keys_file is None else load_keys_file(config.api_keys_file)
        self.frontend = Frontend(engine_config, config.serving())
        self.keys = auth.ApiKeys(config.api_keys, file_entries)
        self.admin_keys = auth.ApiKeys(config.admin_api_keys)
        self.policy = auth.AccessPolicy(
            self.keys,
            self.admin_keys,
            config.loopback_only,
            protected=(_PROTECTED_PREFIXES, _PROTECTED_PATHS),
            admin=(ADMIN_PREFIXES, ADMIN_PATHS),
            admin_too=(STORED_PREFIX,),
        )
        self.responses = ResponseStore(config.max_stored_responses)  # /v1/responses

    def reload_keys(self) -> bool:
        """Read the keys file again (SIGHUP). A file that cannot be used leaves the keys as
        they were and logs why; returns whether the new keys are in use."""
        path = self.config.api_keys_file
        return path is not None and auth.reload_keys_file(self.keys, path)

    def parse(self, request: HTTPRequest, model: type[BaseModel]) -> Any:
        """The JSON body of ``request`` validated as ``model`` (400 naming the field, or
        naming ``X-Tenant``/``user`` for a bad sub-tenant)."""
        return self.parse_routed(request, model)[0]

    def parse_routed(self, request: HTTPRequest, model: type[BaseModel]) -> tuple[Any, Routing]:
        """``parse``, and the request's ``Routing``: its tenant (its key's, refined by
        ``X-Tenant`` or ``user`` when the key allows sub-tenants) and the body's
        ``cache_salt`` and ``priority`` where the model has them."""
        content_type = request.headers.get("content-type", "")
        if "application/json" not in content_type:
            raise APIError(400, "Content-Type must be application/json")
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"could not parse the JSON body: {exc}") from None
        body = parse_body(model, data)
        routing = Routing(
            self.tenant_tag(request.headers, getattr(body, "user", None)),
            getattr(body, "cache_salt", None),
            getattr(body, "priority", None) or 0,
        )
        return body, routing

    def tenant_tag(self, headers: dict[str, str], user: Any = None) -> TenantTag:
        """The tenant of a request with these headers (or gRPC metadata) and ``user``
        field; a 400 for a bad sub-tenant."""
        entry = self.keys.identify(headers.get("authorization"), headers.get("x-api-key"))
        tag = tenant_tag(entry, headers, user if isinstance(user, str) else None)
        if isinstance(tag, str):
            raise APIError(400, tag, param=None if "x-tenant" in headers else "user")
        return tag

    def reader(self, headers: dict[str, str]) -> str:
        """Whose stored objects a request without a body (``GET``/``DELETE`` of a stored
        response) may see: ``ANY_TENANT`` with an admin key, else its tenant's name (its
        key's, refined by ``X-Tenant`` where the key allows sub-tenants)."""
        if self.policy.is_admin(headers):
            return ANY_TENANT
        return self.tenant_tag(headers).tenant.name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.frontend.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )


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
    server = OpenAIServer(engine_config, config)
    frontend = server.frontend

    policy = server.policy

    def authorize(request: HTTPRequest) -> APIError | None:
        denied = policy.check(request.path, request.headers)
        return None if denied is None else APIError(denied.status, denied.message, denied.type)

    async def start() -> None:
        if config.api_keys_file is not None:
            _watch_sighup(server)
        await frontend.start()

    app = ASGIApp(
        config.max_body_bytes,
        authorize,
        start,
        frontend.shutdown,
        body_timeout_s=config.body_timeout_s,
    )
    register_console(app, frontend, lambda request: policy.may_read_prompts(request.headers))
    if config.enable_debug_endpoints:
        add_debug_routes(app, frontend)
    app.server = server  # type: ignore[attr-defined] # (the gRPC frontend shares it)

    @app.route("GET", "/health")
    async def health(_: HTTPRequest) -> Response:
        reason = frontend.client.unhealthy_reason()
        if reason is None:
            return Response(headers=[])
        return error_response(APIError(503, reason, "service_unavailable_error"))

    @app.route("GET", "/version")
    async def version(_: HTTPRequest) -> Response:
        return json_response({"version": __version__})

    @app.route("GET", "/metrics")
    async def metrics(_: HTTPRequest) -> Response:
        return Response(
            frontend.metrics.render(), headers=[(b"content-type", b"text/plain; version=0.0.4")]
        )

    @app.route("GET", "/openapi.json")
    async def openapi(_: HTTPRequest) -> Response:
        return json_response(openapi_document(app))

    def model_card() -> dict:
        return {
            "id": frontend.model_name,
            "object": "model",
            "created": frontend.created,
            "owned_by": "radixserve",
            "max_model_len": frontend.max_model_len,
        }

    @app.route("GET", "/v1/models")
    async def models(_: HTTPRequest) -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.route("GET", "/v1/models/{model}")
    async def model(request: HTTPRequest) -> Response:
        server.check_model(unquote(request.path_params["model"]))
        return json_response(model_card())

    native.add_routes(app, server)
    completions.add_routes(app, server)
    chat.add_routes(app, server)
    responses.add_routes(app, server)
    embeddings.add_routes(app, server)
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
