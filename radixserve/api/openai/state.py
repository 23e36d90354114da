"""The state every route shares: ``OpenAIServer`` (the frontend, the keys and who may call
what, the Responses store) and how a request's body, tenant and routing are read. Route
modules (``completions``, ``chat``, ``responses``, ``embeddings``, ``native``, Anthropic's
``messages``, gRPC) import it; ``server.create_app`` wires them to one instance."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from pydantic import BaseModel

from radixserve.api import auth
from radixserve.api.asgi import APIError, HTTPRequest
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.converter import parse_body
from radixserve.api.openai.response_store import ANY_TENANT, ResponseStore
from radixserve.api.tenants import load_keys_file, tenant_tag
from radixserve.serving.frontend import EngineConfig, Frontend, ModelInputs
from radixserve.serving.model_set import (
    Lease,
    ModelNotFound,
    ModelSet,
    ModelSpec,
    ModelUnavailable,
    model_specs,
    parse_keep_alive,
    tokenizer_of,
)
from radixserve.serving.tenancy import Routing, TenantTag

log = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1/", "/debug/")  # (/v1/messages takes x-api-key too)
_PROTECTED_PATHS = frozenset({"/generate", "/tokenize", "/detokenize"})
ADMIN_PREFIXES = ("/v1/engine/", "/debug/")
# (and vLLM's routes that load and unload LoRA adapters)
ADMIN_PATHS = frozenset(
    {
        "/metrics",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        # several models: load, unload and pin one by hand (api/openai/model_admin.py)
        "/v1/models/load",
        "/v1/models/unload",
        "/v1/models/pin",
    }
)
# what the server stores for tenants (GET/DELETE /v1/responses/{id}): an admin key may read
# and delete any tenant's
STORED_PREFIX = "/v1/responses/"


def _resolve_auto(config: ServerConfig, tokenizer: Any) -> ServerConfig:
    """``auto`` parsers chosen from the model's chat template (logged); the config the
    routes read holds the result."""
    from radixserve.api.openai.tool_parser import detect_tool_parser
    from radixserve.serving import reasoning

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one speaks for the model
        template = template.get("default") or next(iter(template.values()), None)
    changes: dict[str, Any] = {}
    if config.reasoning_parser == reasoning.AUTO:
        changes["reasoning_parser"] = reasoning.detect(template)
        log.info("--reasoning-parser auto: %s", changes["reasoning_parser"] or "off")
    if config.tool_call_parser == "auto":
        changes["tool_call_parser"] = detect_tool_parser(template) or "hermes"
        log.info("--tool-call-parser auto: %s", changes["tool_call_parser"])
    return dataclasses.replace(config, **changes) if changes else config


class OpenAIServer:
    """The OpenAI API of one server process over its ``Frontend``. Invariants: bad input is
    answered 400 before anything reaches the engine; every request sent to the engine is
    either answered or aborted (client gone); output JSON is written with orjson, SSE
    frames preformatted."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        file_entries = () if config.api_keys_file is None else load_keys_file(config.api_keys_file)
        serving = config.serving()
        self._only: Frontend | None = None  # a single model's (there before it starts)
        if config.many_models:
            specs = model_specs(engine_config, config.model_entries, config.models_dir)
            budget = engine_config.memory_budget_gb
            self.models = ModelSet(
                specs,
                serving,
                None if budget is None else int(budget * 2**30),
                config.idle_unload_s,
                config.max_load_wait_s,
            )
            # ``config`` reads the default model's template for ``auto`` parsers; each model's
            # own are resolved from its template when it first serves (``parsers``)
            auto = "auto" in (config.tool_call_parser, config.reasoning_parser)
            tokenizer = tokenizer_of(specs[0]) if auto else None
        else:  # one model, loaded at start and kept
            frontend = Frontend(engine_config, serving)
            spec = ModelSpec(frontend.model_name, engine_config, pinned=True)
            self.models = ModelSet([spec], serving, make_frontend=lambda *_: frontend)
            tokenizer = frontend.tokenizer
            self._only = frontend
        self._parser_flags = config  # ``auto`` unresolved: resolved per model (``parsers``)
        self._parsers: dict[str, tuple[str, str | None]] = {}
        self.config = config = _resolve_auto(config, tokenizer)
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

    def parsers(self, frontend: Frontend) -> tuple[str, str | None]:
        """``(tool-call parser, reasoning parser or None)`` for ``frontend``'s model: the
        flags', or, where a flag is ``auto``, those its own chat template names (detected
        once per model: a Qwen3 and a Llama behind one server each get theirs)."""
        name = frontend.model_name
        got = self._parsers.get(name)
        if got is None:
            if self._only is not None or "auto" not in (
                self._parser_flags.tool_call_parser,
                self._parser_flags.reasoning_parser,
            ):
                resolved = self.config
            else:
                resolved = _resolve_auto(self._parser_flags, frontend.tokenizer)
            got = self._parsers[name] = (resolved.tool_call_parser, resolved.reasoning_parser)
        return got

    def tool_call_parser(self, frontend: Frontend) -> str:
        return self.parsers(frontend)[0]

    def reasoning_parser(self, frontend: Frontend) -> str | None:
        return self.parsers(frontend)[1]

    def reload_keys(self) -> bool:
        """Read the keys file again (SIGHUP). A file that cannot be used leaves the keys as
        they were and logs why; returns whether the new keys are in use."""
        path = self.config.api_keys_file
        return path is not None and auth.reload_keys_file(self.keys, path)

    def parse(self, request: HTTPRequest, model: type[BaseModel]) -> Any:
        """The JSON body of ``request`` validated as ``model`` (400 naming the field)."""
        content_type = request.headers.get("content-type", "")
        if "application/json" not in content_type:
            raise APIError(400, "Content-Type must be application/json")
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"could not parse the JSON body: {exc}") from None
        return parse_body(model, data)

    async def parse_routed(
        self,
        request: HTTPRequest,
        model: type[BaseModel],
        check: Callable[[ModelInputs, Any], Awaitable[Any]] | None = None,
    ) -> tuple[Any, Routing]:
        """``parse``, and the request's ``Routing``: its tenant (its key's, refined by
        ``X-Tenant`` or ``user`` when the key allows sub-tenants), its served model and
        LoRA adapter (``model``: 404 for a name not served), the body's ``cache_salt``
        and ``priority`` where the model has them. The model is loaded if it is not, and
        held until the answer is sent (``HTTPRequest.on_done``). ``check``: the route's
        own reading of the body (its 400s), run first against the model's files when the
        model is not loaded, so a bad request loads nothing and evicts no one."""
        body, tag, served, lora = self._named(request, model)
        if check is not None:
            await self.check_unloaded(served, lambda preview: check(preview, body))
        lease = await self.lease(served, getattr(body, "keep_alive", None))
        request.on_done.append(lease.release)
        routing = Routing(
            tag,
            getattr(body, "cache_salt", None) or None,  # ("" is no salt, as over gRPC)
            getattr(body, "priority", None) or 0,
            lora,
            served,
        )
        return body, routing

    def _named(
        self, request: HTTPRequest, model: type[BaseModel]
    ) -> tuple[Any, TenantTag, str, str | None]:
        """The body of ``request`` as ``model``, its tenant, and the served model and LoRA
        adapter it names (``model_of``)."""
        body = self.parse(request, model)
        tag = self.tenant_tag(request.headers, getattr(body, "user", None))
        return (body, tag, *self.model_of(getattr(body, "model", None), tag))

    async def check_unloaded(
        self, served: str, check: Callable[[ModelInputs], Awaitable[Any]]
    ) -> None:
        """Run ``check`` (a request's reading of its body: its errors) against model
        ``served``'s files if the model is not loaded, before a lease loads it (nothing
        to do for a loaded model, or one whose files cannot be read so)."""
        if self._only is None and self.models.loaded(served) is None:
            preview = await self.models.preview(served)
            if preview is not None:
                await check(preview)

    async def parse_inputs(
        self, request: HTTPRequest, model: type[BaseModel]
    ) -> tuple[Any, ModelInputs, str]:
        """``parse``, the tokenizer side of the model the body names and the name an
        answer gives (the adapter's, else the model's), for the routes that need no
        engine (tokenizing, counting, rendering): a loaded model's frontend, else its
        ``ModelInputs`` from its files, so they never load a model (one whose files cannot
        be read so is loaded and held as ``parse_routed`` does)."""
        body, _, served, lora = self._named(request, model)
        keep_alive = getattr(body, "keep_alive", None)
        self.keep_alive(keep_alive)  # (a bad one is a 400 here too)
        name = lora or served
        frontend = self.models.loaded(served)
        if frontend is not None:
            return body, frontend, name
        preview = await self.models.preview(served)
        if preview is not None:
            return body, preview, name
        lease = await self.lease(served, keep_alive)
        request.on_done.append(lease.release)
        return body, lease.frontend, name

    def model_of(self, name: str | None, tag: TenantTag) -> tuple[str, str | None]:
        """(served model, LoRA adapter or None) that a request's ``model`` names (None: the
        first model); a 404 ``model_not_found`` for a name that is neither a model, an
        alias nor an adapter ``tag``'s key may use (not told apart: a tenant learns
        nothing of adapters it may not use)."""
        try:
            return self.models.resolve(name), None
        except ModelNotFound:
            pass
        assert name is not None
        if tag.may_use(name):
            for served, adapters in self.adapters().items():
                if name in adapters:
                    return served, name
        raise self.model_not_found(name)

    def adapters(self) -> dict[str, dict[str, str]]:
        """Each served model's LoRA adapters (name -> folder): a loaded model's as they are
        now, an unloaded one's as its settings give them."""
        out: dict[str, dict[str, str]] = {}
        for name, entry in self.models.entries.items():
            if entry.frontend is not None:
                out[name] = entry.frontend.loras
            else:
                out[name] = entry.spec.config.lora_adapters
        return out

    @staticmethod
    def keep_alive(value: Any) -> float | None:
        """A request's ``keep_alive`` in seconds (``parse_keep_alive``); 400 if bad."""
        try:
            return parse_keep_alive(value)
        except ValueError as exc:
            raise APIError(400, str(exc), param="keep_alive") from None

    async def lease(self, name: str, keep_alive: Any = None) -> Lease:
        """A hold on served model ``name``, loaded first if it is not: 400 for a bad
        ``keep_alive``; 503 (with Retry-After) when it could not be loaded in time, 500
        naming the reason when loading it failed."""
        keep = self.keep_alive(keep_alive)
        try:
            return await self.models.acquire(name, keep)
        except ModelUnavailable as exc:
            if exc.retry_after_s is None:
                raise APIError(
                    500, str(exc), "model_load_error", code="model_load_failed"
                ) from None
            raise APIError(
                503,
                str(exc),
                "service_unavailable_error",
                code="model_loading",
                retry_after_s=exc.retry_after_s,
            ) from None

    @property
    def frontend(self) -> Frontend:
        """The first model's frontend (a single-model server's only one; with several
        models, loaded or not: ``frontend_of`` serves requests)."""
        frontend = self._only or self.models.loaded(self.models.default)
        if frontend is None:
            raise APIError(
                503, f"model {self.models.default!r} is not loaded", "service_unavailable_error"
            )
        return frontend

    def loaded_frontend(self, name: str | None) -> Frontend:
        """The frontend of loaded model ``name`` (None: the default model), for the routes
        that look at a model without running a request on it (the console's, the debug
        ones): a 404 for an unknown name, a 503 for a model not loaded (never loads it)."""
        if name is None:
            return self.frontend
        try:
            served = self.models.resolve(name)
        except ModelNotFound:
            raise self.model_not_found(name) from None
        frontend = self.models.loaded(served)
        if frontend is None:
            raise APIError(503, f"model {served!r} is not loaded", "service_unavailable_error")
        return frontend

    def frontend_of(self, routing: Routing) -> Frontend:
        """The frontend of the model a routed request holds (``parse_routed``)."""
        frontend = self.models.loaded(routing.model or self.models.default)
        if frontend is None:  # (parse_routed's lease keeps it loaded: never here)
            raise RuntimeError(f"model {routing.model!r} is not loaded")
        return frontend

    @staticmethod
    def model_not_found(name: str) -> APIError:
        return APIError(
            404,
            f"The model `{name}` does not exist.",
            type_="NotFoundError",
            param="model",
            code="model_not_found",
        )

    def served_name(self, routing: Routing) -> str:
        """The ``model`` an answer names: the adapter it ran on, else its model."""
        return routing.lora or routing.model or self.models.default

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
