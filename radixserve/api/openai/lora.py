"""LoRA adapters at run time (vLLM's routes, admin only): ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter``. A request chooses an adapter by its ``model``.

With several models, the body's ``model`` (an extension of vLLM's body; absent: the default
model) names the base model an adapter is loaded onto; an unload finds the model that holds
the adapter. An adapter loaded here lives as long as its model stays loaded (pin the model
to keep it; ``models.toml``'s ``lora-modules`` load it with the model every time)."""

from __future__ import annotations

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.errors import LoRAError, LoRANotFound
from radixserve.serving.engine_streams import EngineDead
from radixserve.serving.model_set import ModelNotFound

LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    def base_model(name: str | None) -> str:
        try:
            return server.models.resolve(name)
        except ModelNotFound:
            raise server.model_not_found(str(name)) from None

    @app.route("POST", "/v1/load_lora_adapter", in_schema=False)
    async def load(request: HTTPRequest) -> Response:
        body = server.parse(request, LoadLoRARequest)
        lease = await server.lease(base_model(body.model))
        try:
            await lease.frontend.load_lora(body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code=exc.code) from None
        finally:
            lease.release()
        return json_response(
            {
                "object": "lora_adapter",
                "id": body.lora_name,
                "root": body.lora_path,
                "parent": lease.frontend.model_name,
            }
        )

    @app.route("POST", "/v1/unload_lora_adapter", in_schema=False)
    async def unload(request: HTTPRequest) -> Response:
        body = server.parse(request, UnloadLoRARequest)
        if body.model is not None:
            served = base_model(body.model)
        else:  # the loaded model holding it, else the default model (which answers 404)
            holders = [
                name
                for name, frontend in server.models.frontends()
                if body.lora_name in frontend.loras
            ]
            served = holders[0] if holders else server.models.default
        lease = await server.lease(served)
        try:
            await lease.frontend.unload_lora(body.lora_name)
        except LoRANotFound:
            raise server.model_not_found(body.lora_name) from None
        except LoRAError as exc:
            raise APIError(400, str(exc)) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code=exc.code) from None
        finally:
            lease.release()
        return json_response({"object": "lora_adapter", "id": body.lora_name, "deleted": True})
