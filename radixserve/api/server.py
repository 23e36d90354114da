"""The OpenAI-compatible HTTP frontend: routes, validation, tokenization, SSE."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from radixserve.api.asgi import (
    APIError,
    ASGIApp,
    HTTPRequest,
    Response,
    StreamResponse,
    error_response,
    json_response,
)
from radixserve.api.console import register_console
from radixserve.api.debug_routes import add_debug_routes
from radixserve.api.engine_client import EngineClient, EngineDead, RequestRejected
from radixserve.api.metrics import Metrics, RequestTimer
from radixserve.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    body_schema,
)
from radixserve.api.protocol import Delta
from radixserve.api.router.dp_client import DataParallelClient
from radixserve.api.structured import (
    GrammarChecker,
    ToolStreamer,
    apply_structured,
    parse_tool_calls,
    reject_unknown_fields,
    template_message,
    tool_context,
)
from radixserve.api.supervisor import SupervisionCollector, SupervisorConfig
from radixserve.api.tokenize_batcher import TokenizeBatcher
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.model_source import resolve_model
from radixserve.engine.tokenizer import load_hf_tokenizer, tokenizer_from_gguf
from radixserve.executor.loader.gguf_loader import read_metadata

_FIELD_RE = re.compile(r"^([a-z_]+)")
_DONE = b"data: [DONE]\n\n"


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
    data_parallel_size: int = 1  # engine processes behind this frontend (api/router)
    dp_policy: str = "cache-aware"
    dp_balance: Any = None  # router.policy.BalanceConfig (None: its defaults)
    supervision: SupervisorConfig = field(default_factory=SupervisorConfig)  # watchdog, restarts
    enable_debug_endpoints: bool = False  # /debug/* (see debug_routes.py)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def make_engine_client(
    engine_config: EngineConfig, tokenizer: Any, config: ServerConfig
) -> EngineClient | DataParallelClient:
    """One engine process, or ``data_parallel_size`` of them behind one client."""
    if config.data_parallel_size == 1:
        return EngineClient(engine_config, tokenizer, supervision=config.supervision)
    return DataParallelClient(
        engine_config,
        tokenizer,
        config.data_parallel_size,
        config.dp_policy,
        config.dp_balance,
        supervision=config.supervision,
    )


def load_frontend_tokenizer(config: EngineConfig):
    source = resolve_model(config.model)
    if source.kind == "gguf":
        return source.name, tokenizer_from_gguf(read_metadata(source.path))
    return source.name, load_hf_tokenizer(source.path)


class OpenAIServer:
    """Routes of one server. Invariants: bad input is answered 400 before anything reaches
    the engine; every request sent to the engine is either answered or aborted (client
    gone); output JSON is written with orjson, SSE frames preformatted."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.config = config
        source_name, self.tokenizer = load_frontend_tokenizer(engine_config)
        self.client = make_engine_client(engine_config, self.tokenizer.backend_tokenizer, config)
        self.tokenize = TokenizeBatcher(self.tokenizer)
        self.model_name = config.served_model_name or source_name
        self.metrics = Metrics(lambda: self.client.stats)
        if isinstance(self.client, DataParallelClient):  # per-engine series
            self.metrics.registry.register(self.client.collector)
        self.metrics.registry.register(SupervisionCollector(lambda: self.client))
        self._token_texts: dict[int, str] = {}
        self.grammar = GrammarChecker(self.tokenizer, config.grammar_compile_timeout_s)
        self.created = int(time.time())

    # -- request parsing ------------------------------------------------------------------
    def parse(self, request: HTTPRequest, model: type[BaseModel]) -> Any:
        content_type = request.headers.get("content-type", "")
        if "application/json" not in content_type:
            raise APIError(400, "Content-Type must be application/json")
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"could not parse the JSON body: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            body = model.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(x) for x in err.get("loc", ())) or None
            raise APIError(400, f"{param}: {err.get('msg')}", param=param) from None
        reject_unknown_fields(body)
        return body

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                type_="NotFoundError",
                param="model",
                code="model_not_found",
            )

    def sampling(self, body: Any, max_tokens: int | None) -> tuple[dict, int]:
        """Validated SamplingParams fields (as a dict for the engine) and n."""
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed with stream=true", param="stream_options"
            )
        if not 1 <= body.n <= self.config.max_n:
            raise APIError(400, f"n must be in [1, {self.config.max_n}], got {body.n}", param="n")
        num_logprobs = self.num_logprobs(body)
        if body.temperature is not None and body.temperature > 2:
            raise APIError(400, "temperature must be in [0, 2]", param="temperature")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > self.config.max_stop:
            raise APIError(400, f"at most {self.config.max_stop} stop sequences", param="stop")
        fields = {
            "n": body.n,
            "max_tokens": max_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "seed": body.seed,
            "stop": stop,
            "stop_token_ids": body.stop_token_ids or [],
            "ignore_eos": body.ignore_eos,
            "min_tokens": body.min_tokens,
            "skip_special_tokens": body.skip_special_tokens,
            "include_stop_str_in_output": body.include_stop_str_in_output,
            "logprobs": num_logprobs,
        }
        if body.logit_bias:
            try:
                fields["logit_bias"] = {int(k): v for k, v in body.logit_bias.items()}
            except ValueError:
                raise APIError(
                    400, "logit_bias keys must be token ids", param="logit_bias"
                ) from None
        try:
            params = SamplingParams(**fields)
            params.check_vocab(self.vocab_size)
        except ValueError as exc:
            m = _FIELD_RE.match(str(exc))
            raise APIError(400, str(exc), param=m.group(1) if m else None) from None
        return fields, body.n

    def num_logprobs(self, body: Any) -> int | None:
        """How many top logprobs to return per token (None: no logprobs), as OpenAI's
        completions (``logprobs: int``) and chat (``logprobs: bool`` + ``top_logprobs``)
        ask for them."""
        limit = self.config.max_logprobs
        if isinstance(body, ChatCompletionRequest):
            if body.logprobs not in (None, False, True):
                raise APIError(400, "logprobs must be a boolean", param="logprobs")
            if body.top_logprobs is not None:
                if not body.logprobs:
                    raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
                if not 0 <= body.top_logprobs <= limit:
                    raise APIError(
                        400, f"top_logprobs must be in [0, {limit}]", param="top_logprobs"
                    )
            return (body.top_logprobs or 0) if body.logprobs else None
        if body.logprobs is None:
            return None
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise APIError(400, "logprobs must be an integer", param="logprobs")
        if not 0 <= body.logprobs <= limit:
            raise APIError(400, f"logprobs must be in [0, {limit}]", param="logprobs")
        return body.logprobs

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion_logprobs(self, lps: list, offset: int) -> dict:
        """OpenAI's completions shape; ``text_offset`` counts from ``offset``."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprob, top_pairs in lps:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append({self.token_text(t): lp for t, lp in top_pairs})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def prompt_logprobs(self, prompt: list[int], lps: list | None) -> dict:
        """Completions-shaped logprobs of the prompt itself (echo): the first token has
        none, as in OpenAI's API; ``lps`` covers tokens 1.. (None: not computed)."""
        rest = self.completion_logprobs(lps or [], len(self.token_text(prompt[0])))
        first = self.token_text(prompt[0])
        return {
            "tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]],
        }

    @staticmethod
    def join_logprobs(a: dict, b: dict) -> dict:
        return {key: a[key] + b[key] for key in a}

    def chat_logprobs(self, lps: list) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in top]}
                for t, lp, top in lps
            ]
        }

    @property
    def vocab_size(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.vocab_size

    @property
    def max_model_len(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.max_model_len

    def check_prompt(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise APIError(400, "the prompt must not be empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400, f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param="prompt"
            )
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    # -- running requests -----------------------------------------------------------------
    def _observe(self, delta: Delta) -> None:
        """Per-request engine timings (once per prompt: its first sample)."""
        if delta.finished and delta.index == 0 and delta.queue_time_s is not None:
            self.metrics.queue_time.observe(delta.queue_time_s)

    async def run(
        self,
        prompts: list[list[int]],
        fields: dict,
        n: int,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[tuple[int, Delta]]:
        """Yield (prompt index, delta) for all prompts' samples, as they come."""
        base = uuid.uuid4().hex
        if len(prompts) == 1:  # the common case: no fan-in queue, no extra tasks
            async for delta in self.client.generate(
                f"{base}-0", prompts[0], fields, n, cache_salt, priority
            ):
                self._observe(delta)
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self.client.generate(
                    f"{base}-{i}", ids, fields, n, cache_salt, priority
                ):
                    await queue.put((i, delta))
            except BaseException as exc:
                await queue.put((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(prompts) * n
        try:
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                self._observe(item)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, RequestRejected):
        if exc.overloaded:
            return APIError(503, str(exc), type_="overloaded_error", code="overloaded")
        m = _FIELD_RE.match(str(exc))
        return APIError(400, str(exc), param=m.group(1) if m else None)
    if isinstance(exc, EngineDead):
        return APIError(503, str(exc), type_="service_unavailable_error", code=exc.code)
    return APIError(500, f"internal error: {exc}", type_="internal_error")


_PROTECTED_PREFIXES = ("/v1/", "/debug/")
_PROTECTED_PATHS = frozenset({"/generate", "/tokenize", "/detokenize"})


def create_app(engine_config: EngineConfig, config: ServerConfig | None = None) -> ASGIApp:
    config = config or ServerConfig()
    server = OpenAIServer(engine_config, config)
    keys = [key.encode() for key in config.api_keys]

    def authorize(request: HTTPRequest) -> APIError | None:
        path = request.path
        if not keys or not (path.startswith(_PROTECTED_PREFIXES) or path in _PROTECTED_PATHS):
            return None
        header = request.headers.get("authorization", "")
        token = (header[7:] if header.lower().startswith("bearer ") else "").encode()
        ok = False
        for key in keys:  # constant time per key, every key checked
            ok |= hmac.compare_digest(token, key)
        return None if ok else APIError(401, "invalid or missing API key", "authentication_error")

    app = ASGIApp(config.max_body_bytes, authorize, server.client.start, server.client.shutdown)
    register_console(app, server)
    if config.enable_debug_endpoints:
        add_debug_routes(app, server)
    app.server = server  # type: ignore[attr-defined] # (the gRPC frontend shares it)

    def engine_route(path: str, model: type[BaseModel]):
        """A POST route that runs the engine: aborted if the client goes away."""
        return app.route("POST", path, watch_disconnect=True, body_schema=body_schema(model))

    @app.route("GET", "/health")
    async def health(_: HTTPRequest) -> Response:
        reason = server.client.unhealthy_reason()
        if reason is None:
            return Response(headers=[])
        return error_response(APIError(503, reason, "service_unavailable_error"))

    @app.route("GET", "/version")
    async def version(_: HTTPRequest) -> Response:
        from radixserve import __version__

        return json_response({"version": __version__})

    @app.route("GET", "/metrics")
    async def metrics(_: HTTPRequest) -> Response:
        return Response(
            server.metrics.render(), headers=[(b"content-type", b"text/plain; version=0.0.4")]
        )

    @app.route("GET", "/openapi.json")
    async def openapi(_: HTTPRequest) -> Response:
        return json_response(openapi_document(app))

    @app.route("GET", "/v1/models")
    async def models(_: HTTPRequest) -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": server.created,
                        "owned_by": "radixserve",
                        "max_model_len": server.max_model_len,
                    }
                ],
            }
        )

    @app.route("POST", "/tokenize", body_schema=body_schema(TokenizeRequest))
    async def tokenize(request: HTTPRequest) -> Response:
        body = server.parse(request, TokenizeRequest)
        if body.messages is not None:
            messages = [
                template_message(m, i, _message(m, i)["content"])
                for i, m in enumerate(body.messages)
            ]
            ids = await _render_chat(server, messages, True, False, {})
        elif body.prompt is not None:
            ids = await server.tokenize.encode(body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "give prompt or messages", param="prompt")
        return json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": server.max_model_len}
        )

    @app.route("POST", "/detokenize", body_schema=body_schema(DetokenizeRequest))
    async def detokenize(request: HTTPRequest) -> Response:
        body = server.parse(request, DetokenizeRequest)
        bad = [t for t in body.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {server.vocab_size})", param="tokens")
        return json_response({"prompt": server.tokenizer.decode(body.tokens)})

    @engine_route("/v1/completions", CompletionRequest)
    async def completions(request: HTTPRequest) -> Response | StreamResponse:
        body: CompletionRequest = server.parse(request, CompletionRequest)
        server.check_model(body.model)
        texts, prompts = await _completion_prompts(server, body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        fields, n = server.sampling(body, max_tokens)
        for ids in prompts:
            server.check_prompt(ids, max_tokens)
        await apply_structured(server.grammar, body, fields, server.vocab_size)
        if body.echo:  # echo token-id prompts as their text; logprobs cover the prompt too
            texts = [
                t if t is not None else server.tokenizer.decode(ids)
                for t, ids in zip(texts, prompts, strict=True)
            ]
            if fields["logprobs"] is not None:
                fields["prompt_logprobs"] = fields["logprobs"]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamResponse(_stream_completion(server, rid, texts, prompts, fields, n, body))
        return await _complete(server, rid, texts, prompts, fields, n, body, chat=False)

    @engine_route("/v1/chat/completions", ChatCompletionRequest)
    async def chat_completions(request: HTTPRequest) -> Response | StreamResponse:
        body: ChatCompletionRequest = server.parse(request, ChatCompletionRequest)
        server.check_model(body.model)
        tools = body._tool_context = tool_context(body, server.config.tool_call_parser)
        messages = [
            template_message(m, i, _message(m, i)["content"]) for i, m in enumerate(body.messages)
        ]
        template_kwargs = dict(body.chat_template_kwargs or {})
        if tools.active:  # the template shows the model the tools it may call
            template_kwargs["tools"] = tools.tools
        ids = await _render_chat(
            server,
            messages,
            body.add_generation_prompt and not body.continue_final_message,
            body.continue_final_message,
            template_kwargs,
        )
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = requested if requested is not None else max(1, server.max_model_len - len(ids))
        fields, n = server.sampling(body, max_tokens)
        server.check_prompt(ids, max_tokens)
        await apply_structured(server.grammar, body, fields, server.vocab_size, tools)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return StreamResponse(_stream_chat(server, rid, ids, fields, n, body))
        return await _complete(server, rid, [None], [ids], fields, n, body, chat=True)

    @engine_route("/generate", GenerateRequest)
    async def generate(request: HTTPRequest) -> Response | StreamResponse:
        body: GenerateRequest = server.parse(request, GenerateRequest)
        if body.input_ids is not None:
            ids = body.input_ids
        elif body.text is not None:
            ids = await server.tokenize.encode(body.text)
        else:
            raise APIError(400, "give text or input_ids", param="text")
        sp = body.sampling_params or {}
        try:
            params = SamplingParams(**{k: v for k, v in sp.items() if k != "n"})
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), param="sampling_params") from None
        server.check_prompt(ids, params.max_tokens)
        if params.structured_output is not None:
            await server.grammar.check(
                params.structured_output, server.vocab_size, "sampling_params"
            )
        fields = {**sp, "n": 1}
        gen = server.run([ids], fields, 1, body.cache_salt, body.priority)
        if body.stream:

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for _, d in gen:
                        yield _sse(
                            {
                                "text": d.text,
                                "token_ids": d.token_ids,
                                "finished": d.finished,
                                "finish_reason": d.finish_reason,
                            }
                        )
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    yield _sse(_engine_error(exc).body())
                yield _DONE

            return StreamResponse(events())
        try:
            items = [x async for x in gen]
        except (RequestRejected, EngineDead) as exc:
            raise _engine_error(exc) from None
        text = "".join(d.text for _, d in items)
        out_ids = [t for _, d in items for t in d.token_ids]
        last = items[-1][1]
        return json_response(
            {
                "text": text,
                "output_ids": out_ids,
                "meta_info": {
                    "finish_reason": last.finish_reason,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out_ids),
                    "cached_tokens": last.num_cached_tokens,
                },
            }
        )

    return app


def openapi_document(app: ASGIApp) -> dict:
    """OpenAPI 3.1 for the routes as registered: paths, methods, request body schemas."""
    from radixserve import __version__

    components: dict[str, dict] = {}
    paths: dict[str, dict] = {}
    error = {"description": "an OpenAI-shaped error: {error: {message, type, param, code}}"}
    for path, methods in sorted(app.routes.items()):
        for method, route in methods.items():
            if not route.in_schema:
                continue
            op: dict[str, Any] = {
                "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_') or 'root'}",
                "responses": {"200": {"description": "OK"}, "4XX": error, "503": error},
            }
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


# -- helpers ----------------------------------------------------------------------------
async def _completion_prompts(
    server: OpenAIServer, prompt: Any
) -> tuple[list[str | None], list[list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "the prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [None], [list(prompt)]
    if all(isinstance(x, str) for x in prompt):
        if any(x == "" for x in prompt):
            raise APIError(400, "the prompt must not be empty", param="prompt")
        encoded = await server.tokenize.encode_many(list(prompt))  # one batched call
        return list(prompt), [list(ids) for ids in encoded]
    if all(isinstance(x, list) for x in prompt):
        return [None] * len(prompt), [list(x) for x in prompt]
    raise APIError(
        400, "prompt must be a string, strings, token ids or lists of them", param="prompt"
    )


def _message(m: Any, i: int) -> dict:
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    400, "only text content parts are supported", param=f"messages.{i}.content"
                )
            parts.append(part["text"])
        content = "".join(parts)
    return {"role": m.role, "content": content or ""}


async def _render_chat(
    server: OpenAIServer,
    messages: list[dict],
    add_generation_prompt: bool,
    continue_final: bool,
    kwargs: dict,
) -> list[int]:
    tok = server.tokenizer
    if not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    try:
        text = tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            **kwargs,
        )
    except Exception as exc:  # template errors are the caller's input
        raise APIError(400, f"could not apply the chat template: {exc}", param="messages") from None
    return await server.tokenize.encode(text, add_special_tokens=False)


def _usage(prompts: list[list[int]], completion_tokens: int, cached: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def _complete(server, rid, texts, prompts, fields, n, body, chat: bool) -> Response:
    started = time.monotonic()
    try:
        items = [x async for x in server.run(prompts, fields, n, body.cache_salt, body.priority)]
    except (RequestRejected, EngineDead) as exc:
        raise _engine_error(exc) from None
    outs: dict[int, dict] = {}
    cached: dict[int, int] = {}
    prompt_lps: dict[int, list] = {}  # by prompt: from the sample that computed the prompt
    first = None
    for i, d in items:
        if d.prompt_logprobs:
            prompt_lps[i] = d.prompt_logprobs
        idx = i * n + d.index
        o = outs.setdefault(
            idx, {"text": "", "tokens": 0, "reason": None, "error": None, "logprobs": []}
        )
        o["text"] += d.text
        o["tokens"] += len(d.token_ids)
        o["logprobs"].extend(d.logprobs or ())
        if d.token_ids and first is None:
            first = time.monotonic()
        if d.finished:
            o["reason"], o["error"] = d.finish_reason, d.error
            cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
    errors = [o["error"] for o in outs.values() if o["reason"] == "error"]
    if errors:
        raise APIError(500, errors[0] or "generation failed", type_="internal_error")
    total = sum(o["tokens"] for o in outs.values())
    for o in outs.values():
        server.metrics.request_success.labels(o["reason"] or "unknown").inc()
    server.metrics.e2e.observe(time.monotonic() - started)
    if first is not None:
        server.metrics.ttft.observe(first - started)
    server.metrics.generation_tokens.inc(total)
    server.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
    choices = []
    for idx in sorted(outs):
        o = outs[idx]
        wants = fields.get("logprobs") is not None
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": o["text"]}
            tools = body._tool_context
            if tools is not None and tools.active:
                content, calls = parse_tool_calls(o["text"], tools)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    o["reason"] = "tool_calls"
            choices.append(
                {
                    "index": idx,
                    "message": message,
                    "logprobs": server.chat_logprobs(o["logprobs"]) if wants else None,
                    "finish_reason": o["reason"],
                }
            )
        else:
            prefix = (texts[idx // n] or "") if getattr(body, "echo", False) else ""
            logprobs = server.completion_logprobs(o["logprobs"], len(prefix)) if wants else None
            if logprobs is not None and prefix:
                logprobs = server.join_logprobs(
                    server.prompt_logprobs(prompts[idx // n], prompt_lps.get(idx // n)), logprobs
                )
            choices.append(
                {
                    "index": idx,
                    "text": prefix + o["text"],
                    "logprobs": logprobs,
                    "finish_reason": o["reason"],
                }
            )
    return json_response(
        {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices,
            "usage": _usage(prompts, total, sum(cached.values())),
        }
    )


async def _stream_events(server, prompts, fields, n, body, on_delta, on_finish, head, usage_obj):
    """Shared SSE loop: head frames, per-delta frames, then usage and [DONE]."""
    timer = RequestTimer(server.metrics)
    cached: dict[int, int] = {}
    try:
        for frame in head():
            yield frame
        async for i, d in server.run(prompts, fields, n, body.cache_salt, body.priority):
            idx = i * n + d.index
            timer.delta(idx, d)
            if d.text or d.logprobs:
                frame = on_delta(idx, d)
                if frame:  # empty: held back (a tool call being generated)
                    yield frame
            if d.finished:
                cached[i] = max(cached.get(i, 0), d.num_cached_tokens)
                if d.finish_reason == "error":
                    yield _sse(
                        APIError(500, d.error or "generation failed", "internal_error").body()
                    )
                yield on_finish(idx, d.finish_reason)
        timer.finish(sum(len(p) for p in prompts))
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(prompts, timer.tokens, sum(cached.values()))
            yield _sse({**usage_obj, "choices": [], "usage": usage})
    except (RequestRejected, EngineDead) as exc:
        yield _sse(_engine_error(exc).body())
    yield _DONE


def _stream_completion(server, rid, texts, prompts, fields, n, body):
    created = int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}

    # with logprobs, a prompt's echo waits for its first delta (which brings the prompt's
    # logprobs); without, it goes out at once
    echo_with_logprobs = body.echo and fields.get("prompt_logprobs") is not None
    echoed: set[int] = set()

    def echo_frames(i: int, logprobs: dict | None) -> Iterator[bytes]:
        for j in range(n):
            choice = {"index": i * n + j, "text": texts[i], "logprobs": logprobs}
            yield _sse({**base, "choices": [{**choice, "finish_reason": None}]})

    def head():
        if body.echo and not echo_with_logprobs:
            for i in range(len(texts)):
                yield from echo_frames(i, None)

    # generated tokens' text offsets continue after the echoed prompt
    offsets: dict[int, int] = {}

    def on_delta(idx, d):
        i = idx // n
        frames = b""
        if echo_with_logprobs and i not in echoed:
            echoed.add(i)
            frames = b"".join(echo_frames(i, server.prompt_logprobs(prompts[i], d.prompt_logprobs)))
        logprobs = None
        if d.logprobs:
            start = offsets.get(idx, len(texts[i] or "") if body.echo else 0)
            logprobs = server.completion_logprobs(d.logprobs, start)
            offsets[idx] = start + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": idx, "text": d.text, "logprobs": logprobs, "finish_reason": None}
        return frames + _sse({**base, "choices": [choice]})

    def on_finish(idx, reason):
        return _sse(
            {
                **base,
                "choices": [{"index": idx, "text": "", "logprobs": None, "finish_reason": reason}],
            }
        )

    return _stream_events(server, prompts, fields, n, body, on_delta, on_finish, head, base)


def _stream_chat(server, rid, ids, fields, n, body):
    created = int(time.time())
    base = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": server.model_name,
    }

    def head():
        for j in range(n):
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": j,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )

    tools = body._tool_context
    streamers: dict[int, ToolStreamer] = {}

    def on_delta(idx, d):
        logprobs = server.chat_logprobs(d.logprobs) if d.logprobs else None
        text = d.text
        if tools is not None and tools.active:  # tool calls are held back until complete
            text = streamers.setdefault(idx, ToolStreamer(tools)).feed(text)
            if not text and not logprobs:
                return b""
        choice = {
            "index": idx,
            "delta": {"content": text},
            "logprobs": logprobs,
            "finish_reason": None,
        }
        return _sse({**base, "choices": [choice]})

    def on_finish(idx, reason):
        frames = b""
        streamer = streamers.pop(idx, None)
        if streamer is not None:
            rest, calls = streamer.finish()
            if rest:
                frames += _sse(
                    {
                        **base,
                        "choices": [
                            {
                                "index": idx,
                                "delta": {"content": rest},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            if calls:
                reason = "tool_calls"
                delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                frames += _sse(
                    {
                        **base,
                        "choices": [
                            {"index": idx, "delta": delta, "logprobs": None, "finish_reason": None}
                        ],
                    }
                )
        return frames + _sse(
            {
                **base,
                "choices": [{"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason}],
            }
        )

    return _stream_events(server, [ids], fields, n, body, on_delta, on_finish, head, base)
