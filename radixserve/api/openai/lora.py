"""LoRA adapters at run time (vLLM's routes, admin only): ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter``. A request chooses an adapter by its ``model``."""

from __future__ import annotations

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.errors import LoRAError, LoRANotFound
from radixserve.serving.engine_streams import EngineDead

LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    # (with several models, adapters load onto the first: models.toml gives the others theirs)

    @app.route("POST", "/v1/load_lora_adapter", in_schema=False)
    async def load(request: HTTPRequest) -> Response:
        body = server.parse(request, LoadLoRARequest)
        try:
            await server.frontend.load_lora(body.lora_name, body.lora_path)
        except LoRAError as exc:
            raise APIError(400, str(exc), param="lora_path") from None
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code=exc.code) from None
        return json_response(
            {"object": "lora_adapter", "id": body.lora_name, "root": body.lora_path}
        )

    @app.route("POST", "/v1/unload_lora_adapter", in_schema=False)
    async def unload(request: HTTPRequest) -> Response:
        body = server.parse(request, UnloadLoRARequest)
        try:
            await server.frontend.unload_lora(body.lora_name)
        except LoRANotFound:
            raise server.model_not_found(body.lora_name) from None
        except LoRAError as exc:
            raise APIError(400, str(exc)) from None
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable_error", code=exc.code) from None
        return json_response({"object": "lora_adapter", "id": body.lora_name, "deleted": True})
