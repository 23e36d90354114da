"""The state every route shares: ``OpenAIServer`` (the frontend, the keys and who may call
what, the Responses store) and how a request's body, tenant and routing are read. Route
modules (``completions``, ``chat``, ``responses``, ``embeddings``, ``native``, Anthropic's
``messages``, gRPC) import it; ``server.create_app`` wires them to one instance."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import orjson
from pydantic import BaseModel

from radixserve.api import auth
from radixserve.api.asgi import APIError, HTTPRequest
from radixserve.api.openai.config import ServerConfig
from radixserve.api.openai.converter import parse_body
from radixserve.api.openai.response_store import ANY_TENANT, ResponseStore
from radixserve.api.tenants import load_keys_file, tenant_tag
from radixserve.serving.frontend import EngineConfig, Frontend
from radixserve.serving.tenancy import Routing, TenantTag

log = logging.getLogger(__name__)

_PROTECTED_PREFIXES = ("/v1/", "/debug/")  # (/v1/messages takes x-api-key too)
_PROTECTED_PATHS = frozenset({"/generate", "/tokenize", "/detokenize"})
ADMIN_PREFIXES = ("/v1/engine/", "/debug/")
# (and vLLM's routes that load and unload LoRA adapters)
ADMIN_PATHS = frozenset({"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
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
        self.frontend = Frontend(engine_config, config.serving())
        self.config = config = _resolve_auto(config, self.frontend.tokenizer)
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
        tag = self.tenant_tag(request.headers, getattr(body, "user", None))
        routing = Routing(
            tag,
            getattr(body, "cache_salt", None) or None,  # ("" is no salt, as over gRPC)
            getattr(body, "priority", None) or 0,
            self.lora_of(getattr(body, "model", None), tag),
        )
        return body, routing

    def lora_of(self, name: str | None, tag: TenantTag) -> str | None:
        """The LoRA adapter model ``name`` is (None: the base model, or no name); a 404
        ``model_not_found`` for a name that is neither, or an adapter ``tag``'s key may not
        use (not told apart: a tenant learns nothing of adapters it may not use)."""
        if name is None or name == self.frontend.model_name:
            return None
        if name in self.frontend.loras and tag.may_use(name):
            return name
        raise self.model_not_found(name)

    @staticmethod
    def model_not_found(name: str) -> APIError:
        return APIError(
            404,
            f"The model `{name}` does not exist.",
            type_="NotFoundError",
            param="model",
            code="model_not_found",
        )

    @staticmethod
    def served_name(routing: Routing, base: str) -> str:
        """The ``model`` an answer names: the adapter it ran on, else the base model."""
        return routing.lora or base

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
        """A 404 ``model_not_found`` unless ``name`` is the base model or an adapter served
        (``parse_routed`` also checks the tenant may use it)."""
        if (
            name is not None
            and name != self.frontend.model_name
            and name not in self.frontend.loras
        ):
            raise self.model_not_found(name)
