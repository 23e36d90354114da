"""The gRPC frontend: ``radixserve.v1.GenerateService`` and ``grpc.health.v1.Health``.

It runs in the HTTP server's process and event loop (``grpc.aio``) and shares its
``OpenAIServer``: the serving frontend (engine client, tokenization batching, output
processing, chat template, sampling defaults, metrics) and the OpenAI request converter. A
request is turned into the body of the matching HTTP route (``/v1/completions`` for text and
token ids, ``/v1/chat/completions`` for chat) and converted by the same code
(``api.openai.converter``), so both APIs accept, refuse and run requests alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixserve.api import auth
from radixserve.api.asgi import APIError
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from radixserve.api.openai import converter as cv
from radixserve.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.api.openai.state import OpenAIServer
from radixserve.core.sampling_params import SamplingParams
from radixserve.serving import reasoning as rp
from radixserve.serving.engine_streams import EngineDead, RequestRejected
from radixserve.serving.frontend import Frontend, ModelInputs
from radixserve.serving.metrics import RequestTimer
from radixserve.serving.model_set import Lease
from radixserve.serving.tenancy import DEFAULT_TAG, Routing, TenantTag

log = logging.getLogger(__name__)

SERVICE_NAME = "radixserve.v1.GenerateService"
HEALTH_POLL_S = 0.1

# SamplingParams fields that are `optional` in the proto: copied only when set, so the
# HTTP API's defaults apply otherwise
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "skip_special_tokens",
    "n",
)
_SAMPLING_NAMES = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name)

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    500: grpc.StatusCode.INTERNAL,
}


@dataclass(frozen=True)
class GrpcConfig:
    port: int
    host: str = "127.0.0.1"
    max_message_bytes: int = 8 * 2**20  # requests and responses alike
    shutdown_grace_s: float = 30.0


def _status(error: APIError) -> grpc.StatusCode:
    if error.status == 503:
        if error.code == "overloaded":
            return grpc.StatusCode.RESOURCE_EXHAUSTED
        return grpc.StatusCode.UNAVAILABLE
    return _STATUS.get(error.status, grpc.StatusCode.INTERNAL)


def _field(param: str | None, input_name: str) -> str:
    """The proto field path an HTTP ``param`` stands for."""
    if param is None:
        return input_name
    head = param.split(".")[0]
    if head == "prompt":
        return {"token_ids": "token_ids.ids"}.get(input_name, input_name)
    if head == "messages":
        return f"chat.{param}"
    if head in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        return f"chat.{param}"
    if head == "top_logprobs":
        return "sampling_params.logprobs"
    if head in _SAMPLING_NAMES or head.startswith("logit_bias"):
        return f"sampling_params.{param}"
    return param


def _details(error: APIError, input_name: str) -> str:
    """``field: message`` for an invalid argument (the field as the proto names it)."""
    if error.status != 400:
        return error.message
    message = error.message
    if error.param and message.startswith(f"{error.param}: "):
        message = message[len(error.param) + 2 :]
    return f"{_field(error.param, input_name)}: {message}"


def _sampling_body(sp: pb.SamplingParams, chat: bool) -> dict:
    """The sampling part of the HTTP body the request stands for."""
    body: dict[str, Any] = {name: getattr(sp, name) for name in _OPTIONAL if sp.HasField(name)}
    body["stop"] = list(sp.stop)
    body["stop_token_ids"] = list(sp.stop_token_ids)
    body["ignore_eos"] = sp.ignore_eos
    body["min_tokens"] = sp.min_tokens
    body["include_stop_str_in_output"] = sp.include_stop_str_in_output
    if sp.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.HasField("logprobs"):
        if chat:  # chat's shape: a flag and a count
            body["logprobs"], body["top_logprobs"] = True, sp.logprobs
        else:
            body["logprobs"] = sp.logprobs
    return body


def _chat_body(chat: pb.Chat) -> dict:
    body: dict[str, Any] = {
        "messages": [{"role": m.role, "content": m.content} for m in chat.messages],
        "continue_final_message": chat.continue_final_message,
    }
    if chat.HasField("add_generation_prompt"):
        body["add_generation_prompt"] = chat.add_generation_prompt
    if chat.HasField("chat_template_kwargs"):
        body["chat_template_kwargs"] = json_format.MessageToDict(chat.chat_template_kwargs)
    return body


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """``radixserve.v1.GenerateService`` on an ``OpenAIServer``. Invariants: a request is
    validated by the HTTP API's code before anything reaches the engine; every request sent
    to the engine is answered to its end or aborted there (the call cancelled, its deadline
    passed, or ``Abort``); ``running`` maps the request ids of calls in progress to their
    engine ids."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        # (tenant, the caller's request id) -> engine id: a tenant sees and aborts its own
        self.running: dict[tuple[str, str], str] = {}
        self.served_by: dict[str, Frontend] = {}  # engine id -> its model's frontend
        # engine request ids: unique in this process, and apart from the HTTP API's
        self._prefix = uuid.uuid4().hex[:12]
        self._count = itertools.count()

    async def _authorize(self, context: grpc.aio.ServicerContext) -> TenantTag:
        """``authorization: Bearer KEY`` metadata (``api.auth``, as for HTTP); the call's
        tenant from its key, refined by ``x-tenant`` metadata when the key allows."""
        keys = self.server.keys
        if not keys:
            return DEFAULT_TAG
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata() or ():
            if key in ("authorization", "x-tenant") and isinstance(value, str):
                metadata[key] = value
        if not keys.allows(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, auth.MISSING_KEY_MESSAGE)
        try:
            return self.server.tenant_tag(metadata)
        except APIError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            raise  # (abort raises)

    async def _fail(
        self, context: grpc.aio.ServicerContext, error: APIError, input_name: str = "input"
    ) -> None:
        await context.abort(_status(error), _details(error, input_name))

    @staticmethod
    def _ready(frontend: Frontend) -> None:
        client = frontend.client
        if client.ready is None or not client.alive:
            raise APIError(503, "the engine is not running", code="engine_dead")

    async def _prompt(
        self, request: pb.GenerateRequest, frontend: ModelInputs
    ) -> tuple[list[int], SamplingParams]:
        """Token ids and SamplingParams, converted as the HTTP routes convert theirs."""
        kind = request.WhichOneof("input")
        if kind is None:
            raise APIError(400, "give text, token_ids or chat", param="input")
        chat = kind == "chat"
        extra = _sampling_body(request.sampling_params, chat)
        extra["priority"] = request.priority
        if request.cache_salt:
            extra["cache_salt"] = request.cache_salt
        if chat:
            body = cv.parse_body(ChatCompletionRequest, {**_chat_body(request.chat), **extra})
            ids = await cv.chat_prompt(frontend, body)
            max_tokens = cv.chat_max_tokens(frontend, body, len(ids))
        else:
            prompt: str | list[int] = (
                request.text if kind == "text" else list(request.token_ids.ids)
            )
            body = cv.parse_body(CompletionRequest, {"prompt": prompt, **extra})
            if kind == "text":
                if not request.text:
                    raise APIError(400, "the prompt must not be empty", param="prompt")
                ids = await frontend.encode(request.text)
            else:
                ids = list(request.token_ids.ids)
            max_tokens = (
                cv.COMPLETION_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            )
        params = cv.sampling_params(frontend, body, max_tokens, self.server.config)
        return cv.check_prompt(frontend, ids, max_tokens), params

    @staticmethod
    def _think(
        d: Any,
        parser: str,
        thinkers: dict[int, rp.ReasoningStreamer],
        sample_ids: dict[int, list[int]],
        out: pb.GenerateResponse,
    ) -> Any:
        """Delta ``d`` with its thinking moved to ``out.reasoning_text`` (its text: the
        answer's part only)."""
        thinker = thinkers.setdefault(d.index, rp.ReasoningStreamer(parser))
        sample_ids.setdefault(d.index, []).extend(d.token_ids)
        reasoning, text = thinker.feed(d.text)
        if d.finished:
            more_reasoning, more_text = thinker.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        out.reasoning_text += reasoning
        d.text = text  # (this request's own delta)
        return d

    @staticmethod
    def _add(out: pb.GenerateResponse, d: Any, text: Callable[[int], str] | None) -> None:
        """Append delta ``d`` (of ``out``'s sample) to ``out`` (its logprobs too, named
        by ``text``, when asked)."""
        out.token_ids.extend(d.token_ids)
        out.text += d.text
        if text is not None and d.logprobs:
            out.logprobs.extend(
                pb.TokenLogprob(
                    token_id=t,
                    logprob=lp,
                    token=text(t),
                    top_logprobs=[
                        pb.TopLogprob(token_id=tt, logprob=tlp, token=text(tt)) for tt, tlp in top
                    ],
                )
                for t, lp, top in d.logprobs
            )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        tag = await self._authorize(context)
        input_name = request.WhichOneof("input") or "input"
        engine_id = f"grpc-{self._prefix}-{next(self._count)}"
        rid = request.request_id or engine_id
        key = (tag.tenant.name, rid)
        if key in self.running:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running"
            )
        self.running[key] = engine_id  # (taken before any await: no two calls share it)
        error: APIError | None = None
        lease: Lease | None = None
        try:
            try:  # (a dead engine is found by generate_batches: UNAVAILABLE)
                served, lora = self.server.model_of(request.model or None, tag)  # (NOT_FOUND)
                # (read against the model's files first: a bad request loads nothing)
                await self.server.check_unloaded(served, lambda f: self._prompt(request, f))
                lease = await self.server.lease(served)
                frontend = self.served_by[engine_id] = lease.frontend
                ids, params = await self._prompt(request, frontend)
            except APIError as exc:
                error = exc
                return
            timer = RequestTimer(frontend.metrics, tag.label)
            token_text = frontend.token_text if params.logprobs is not None else None
            completion: dict[int, int] = {}
            # chat input with a reasoning parser: the thinking apart, as Chat Completions
            parser = self.server.reasoning_parser(frontend) if input_name == "chat" else None
            thinkers: dict[int, rp.ReasoningStreamer] = {}
            sample_ids: dict[int, list[int]] = {}
            # one message per sample for everything that arrived while the last one was
            # being written: a stream that keeps up gets a message per engine step
            routing = Routing(tag, request.cache_salt or None, request.priority, lora, served)
            engine_request = routing.request(engine_id, ids, params)
            async for batch in frontend.client.generate_batches(engine_request):
                outs: dict[int, pb.GenerateResponse] = {}
                for d in batch:
                    frontend.observe(d, tag.label)
                    timer.delta(d.index, d)
                    out = outs.get(d.index)
                    if out is None:
                        out = outs[d.index] = pb.GenerateResponse(request_id=rid, index=d.index)
                    if parser is not None:
                        d = self._think(d, parser, thinkers, sample_ids, out)
                    self._add(out, d, token_text)
                    completion[d.index] = completion.get(d.index, 0) + len(d.token_ids)
                    if d.finished:
                        out.finish_reason = d.finish_reason or ""
                        out.error = d.error or ""
                        out.usage.prompt_tokens = len(ids)
                        out.usage.completion_tokens = completion[d.index]
                        out.usage.cached_tokens = d.num_cached_tokens
                        if parser is not None:
                            out.usage.reasoning_tokens = rp.reasoning_tokens(
                                frontend.tokenizer,
                                sample_ids.pop(d.index, []),
                                thinkers.pop(d.index).reply(),
                            )
                for out in outs.values():
                    yield out
            timer.finish(len(ids))
        except (RequestRejected, EngineDead) as exc:
            error = cv.engine_error(exc)
        finally:
            self.running.pop(key, None)
            self.served_by.pop(engine_id, None)
            if lease is not None:
                lease.release()
            if error is not None:
                await self._fail(context, error, input_name)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        tag = await self._authorize(context)
        engine_id = self.running.get((tag.tenant.name, request.request_id))
        frontend = self.served_by.get(engine_id) if engine_id is not None else None
        found = frontend is not None and frontend.client.abort(engine_id)
        return pb.AbortResponse(found=found)

    async def _leased(self, name: str, tag: TenantTag) -> Lease:
        """A hold on the model a request names (empty: the default one), loaded if it is not
        (NOT_FOUND for an unknown name, UNAVAILABLE while it cannot be loaded); released by
        the caller."""
        served, _ = self.server.model_of(name or None, tag)
        lease = await self.server.lease(served)
        try:
            self._ready(lease.frontend)
        except APIError:
            lease.release()
            raise
        return lease

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        tag = await self._authorize(context)
        kind = request.WhichOneof("input") or "input"
        lease: Lease | None = None
        try:
            lease = await self._leased(request.model, tag)
            frontend = lease.frontend
            if kind == "chat":
                body = cv.parse_body(ChatCompletionRequest, _chat_body(request.chat))
                ids = await cv.chat_prompt(frontend, body)
            elif kind == "text":
                special = (
                    request.add_special_tokens if request.HasField("add_special_tokens") else True
                )
                ids = await frontend.encode(request.text, special)
            else:
                raise APIError(400, "give text or chat", param="input")
        except APIError as error:
            await self._fail(context, error, kind)
            raise AssertionError("unreachable") from None
        finally:
            if lease is not None:
                lease.release()
        return pb.TokenizeResponse(
            token_ids=ids, count=len(ids), max_model_len=frontend.max_model_len
        )

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        tag = await self._authorize(context)
        lease: Lease | None = None
        try:
            lease = await self._leased(request.model, tag)
            frontend = lease.frontend
            bad = [t for t in request.token_ids if not 0 <= t < frontend.vocab_size]
            if bad:
                raise APIError(
                    400, f"token ids must be in [0, {frontend.vocab_size}); got {bad[:5]}"
                )
            text = frontend.tokenizer.decode(list(request.token_ids))
        except APIError as error:
            await self._fail(context, error, "token_ids")
            raise AssertionError("unreachable") from None
        finally:
            if lease is not None:
                lease.release()
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        tag = await self._authorize(context)
        lease: Lease | None = None
        try:
            lease = await self._leased(request.model, tag)
            frontend = lease.frontend
        except APIError as error:
            await self._fail(context, error, "model")
            raise AssertionError("unreachable") from None
        finally:
            if lease is not None:
                lease.release()
        return pb.ModelInfo(
            model_name=frontend.model_name,
            vocab_size=frontend.vocab_size,
            max_model_len=frontend.max_model_len,
        )


class GrpcFrontend:
    """The gRPC server of one ``OpenAIServer``: started after the engine is up, stopped
    (draining calls in progress) before it goes down. Invariant: while running, health
    says SERVING exactly when the engine client says the engine is alive (checked every
    ``HEALTH_POLL_S``)."""

    def __init__(self, server: OpenAIServer, config: GrpcConfig) -> None:
        self.server = server
        self.config = config
        limit = config.max_message_bytes
        self.grpc = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),
            ]
        )
        self.servicer = GenerateServicer(server)
        pb_grpc.add_GenerateServiceServicer_to_server(self.servicer, self.grpc)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"{config.host}:{config.port}"
        try:
            self.port = self.grpc.add_insecure_port(address)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind the gRPC port {address} (in use?)")
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        await self._set_health()
        await self.grpc.start()
        self._watch = asyncio.create_task(self._watch_engine())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.health.enter_graceful_shutdown()
        await self.grpc.stop(self.config.shutdown_grace_s)

    async def _set_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if all(f.client.alive for _, f in self.server.models.frontends())
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch_engine(self) -> None:
        while True:
            await self._set_health()
            await asyncio.sleep(HEALTH_POLL_S)


def add_grpc(app: Any, config: GrpcConfig) -> None:
    """Serve gRPC beside ``app`` (from ``server.create_app``): started in the app's event
    loop once the engine is up, stopped before the engine at shutdown."""
    start, stop = app.on_startup, app.on_shutdown
    frontend: GrpcFrontend | None = None

    async def on_startup() -> None:
        nonlocal frontend
        frontend = GrpcFrontend(app.server, config)  # binds the port before the engine starts
        await start()
        await frontend.start()
        log.info("gRPC API on %s:%d", config.host, frontend.port)

    async def on_shutdown() -> None:
        if frontend is not None:
            await frontend.stop()
        await stop()

    app.on_startup, app.on_shutdown = on_startup, on_shutdown
