"""Several models behind one server, by hand (admin only): ``POST /v1/models/load``,
``/v1/models/unload`` and ``/v1/models/pin``, each with ``{"model": NAME}`` (``pin`` also
takes ``"pinned": false`` to let a model go again). Requests load models on their own;
these routes warm one up, free its memory now, or keep it loaded."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool

from radixserve.api.asgi import APIError, ASGIApp, HTTPRequest, Response, json_response
from radixserve.api.openai.state import OpenAIServer
from radixserve.serving.model_set import ModelBusy, ModelNotFound


class ModelAdminRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    pinned: StrictBool = True  # (pin only)


def add_routes(app: ASGIApp, server: OpenAIServer) -> None:
    models = server.models

    def named(request: HTTPRequest) -> tuple[ModelAdminRequest, str]:
        body = server.parse(request, ModelAdminRequest)
        try:
            return body, models.resolve(body.model)
        except ModelNotFound:
            raise server.model_not_found(body.model) from None

    def state(name: str) -> Response:
        found = next(s for s in models.status() if s["id"] == name)
        return json_response({"object": "model", **found})

    @app.route("POST", "/v1/models/load", in_schema=False)
    async def load(request: HTTPRequest) -> Response:
        _, name = named(request)
        (await server.lease(name)).release()
        return state(name)

    @app.route("POST", "/v1/models/unload", in_schema=False)
    async def unload(request: HTTPRequest) -> Response:
        _, name = named(request)
        try:
            await models.unload(name)
        except ModelBusy as exc:
            raise APIError(409, str(exc), code="model_busy") from None
        return state(name)

    @app.route("POST", "/v1/models/pin", in_schema=False)
    async def pin(request: HTTPRequest) -> Response:
        body, name = named(request)
        models.pin(name, body.pinned)
        return state(name)
