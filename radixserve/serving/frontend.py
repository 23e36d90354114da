"""The engine as a service to transports: what the HTTP routes, gRPC and the console share.

One ``Frontend`` per server process. It owns the engine client (one engine process, or N
behind the data-parallel client), the model's tokenizer for this process (batched
encoding, incremental detokenization), the request normalisation (``engine.inputs``, set
up from what the engine reports when it is ready, so prompts and sampling defaults are the
engine's own), the grammar check (parsed here, compiled in the engine) and the metrics. Transports turn their wire format
into prompt ids + ``SamplingParams`` through it and stream the deltas back.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.errors import LoRAError, LoRANotFound
from radixserve.core.request import EngineRequest
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.inputs import InputProcessor
from radixserve.engine.model_source import resolve_model
from radixserve.engine.tokenizer import load_model_tokenizer
from radixserve.serving.client import EngineClient
from radixserve.serving.dp_client import DataParallelClient
from radixserve.serving.engine_client import EngineProcessClient
from radixserve.serving.grammar import GrammarChecker
from radixserve.serving.metrics import Metrics, VLLMNames
from radixserve.serving.protocol import Delta
from radixserve.serving.supervisor import SupervisionCollector, SupervisorConfig
from radixserve.serving.tenancy import DEFAULT_ROUTING, Routing
from radixserve.serving.tokenize_batcher import TokenizeBatcher


@dataclass(frozen=True)
class ServingConfig:
    """How the engine(s) behind a server are run (transport-independent settings)."""

    served_model_name: str | None = None
    data_parallel_size: int = 1  # engine processes behind this frontend
    dp_policy: str = "cache-aware"
    dp_balance: Any = None  # balancer.BalanceConfig (None: its defaults)
    supervision: SupervisorConfig = field(default_factory=SupervisorConfig)
    # the engine on a thread of this process instead of its own process (one engine only:
    # tests and embedding; engine_host.EngineThread)
    engine_in_process: bool = False
    # more environment for the engine processes (several models sharing the cores:
    # model_set.SHARED_CORES_ENV)
    engine_env: tuple[tuple[str, str], ...] = ()
    # /metrics also under vLLM's names, for llm-d's endpoint picker (metrics.VLLMNames)
    vllm_metrics: bool = False

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(
                f"--data-parallel-size must be at least 1, got {self.data_parallel_size}"
            )
        if self.engine_in_process and self.data_parallel_size != 1:
            raise ValueError("an in-process engine serves alone (data_parallel_size 1)")


def make_engine_client(
    engine_config: EngineConfig, tokenizer: Any, config: ServingConfig
) -> EngineClient:
    """One engine process, or ``data_parallel_size`` of them behind one client."""
    if config.data_parallel_size == 1:
        return EngineProcessClient(
            engine_config,
            tokenizer,
            supervision=config.supervision,
            env={**os.environ, **dict(config.engine_env)} if config.engine_env else None,
            in_process=config.engine_in_process,
        )
    return DataParallelClient(
        engine_config,
        tokenizer,
        config.data_parallel_size,
        config.dp_policy,
        config.dp_balance,
        supervision=config.supervision,
        env=dict(config.engine_env),
    )


class ModelInputs:
    """A model's side of a request before its engine: its tokenizer (batched encoding),
    its chat template and request normalisation (``inputs``), its grammar check. Invariant:
    ``inputs`` checks against the limits the model's engine serves with (given here, from
    the model's files: ``engine.model_profile``; a ``Frontend`` takes its engine's report).
    A server of several models checks a request for a model not loaded against one of
    these before it loads the model."""

    def __init__(
        self,
        engine_config: EngineConfig,
        tokenizer: Any,
        model_name: str,
        inputs: InputProcessor | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.tokenizer = tokenizer
        self.tokenize = TokenizeBatcher(tokenizer)
        self.model_name = model_name
        # parses each grammar (the engine compiles it), bounded by the engine's timeout
        self.grammar = GrammarChecker(engine_config.grammar_compile_timeout_s)
        self._inputs = inputs
        self._token_texts: dict[int, str] = {}

    @property
    def inputs(self) -> InputProcessor:
        assert self._inputs is not None
        return self._inputs

    @property
    def vocab_size(self) -> int:
        return self.inputs.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (encoded with the other texts of this loop turn)."""
        return await self.tokenize.encode(text, add_special_tokens)

    async def chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of a conversation through the chat template (``engine.inputs``); the
        template writes the special tokens, so none are added unless asked."""
        text = self.inputs.render_chat(
            messages, add_generation_prompt, continue_final_message, template_kwargs
        )
        return await self.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text (cached: logprobs name the same tokens again and again)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


class Frontend(ModelInputs):
    """The serving state of one server process.

    Invariants: ``inputs`` exists once the engine is ready and uses the engine's vocabulary
    size, context length and sampling defaults; ``run`` yields every delta of every sample
    of its prompts and ends when all have finished (or raises the client's error); leaving
    it early aborts what is still running in the engine.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        config: ServingConfig | None = None,
        tokenizer: Any = None,
    ) -> None:
        """``tokenizer``: the model's, when read already (a several-model server's check
        before the load): else it is read here."""
        self.config = config = config or ServingConfig()
        if tokenizer is None:
            source_name, tokenizer = load_model_tokenizer(engine_config.model)
        else:
            source_name = resolve_model(engine_config.model).name
        super().__init__(engine_config, tokenizer, config.served_model_name or source_name)
        self.client = make_engine_client(engine_config, self.tokenizer.backend_tokenizer, config)
        # the LoRA adapters served beside the base model: name -> folder
        self.loras: dict[str, str] = engine_config.lora_adapters
        self._loading: set[str] = set()  # adapters being loaded
        if self.model_name in self.loras:
            raise ValueError(
                f"a LoRA adapter cannot take the base model's name {self.model_name!r}"
            )
        vllm = None
        if config.vllm_metrics:  # (adapters may be loaded at any time: the LoRA gauge too)
            vllm = VLLMNames(self.model_name, engine_config.page_size, engine_config.max_loras)
        self.metrics = Metrics(lambda: self.client.stats, vllm)
        if isinstance(self.client, DataParallelClient):  # per-engine series
            self.metrics.registry.register(self.client.collector)
        self.metrics.registry.register(SupervisionCollector(lambda: self.client))
        self.created = int(time.time())

    async def start(self) -> None:
        await self.client.start()

    # -- LoRA adapters ------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as model ``name`` on every engine.
        ``LoRAError`` naming the problem (a name taken, a file that cannot be served):
        nothing changes then and nothing running is disturbed."""
        if not name or name == self.model_name or name in self.loras or name in self._loading:
            taken = "is the base model's" if name == self.model_name else "is already loaded"
            raise LoRAError(f"LoRA adapter name {name!r} {taken}" if name else "no name")
        self._loading.add(name)  # (a second load of the name meanwhile is refused)
        try:
            answer = await self.client.lora_control(name, path)
        finally:
            self._loading.discard(name)
        if answer.error is not None:
            raise LoRAError(answer.error)
        self.loras[name] = path

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests for it are refused; those running
        finish on it. ``LoRANotFound`` if it is not loaded."""
        if name not in self.loras:
            raise LoRANotFound(name)
        del self.loras[name]  # (refused from now on, even while the engines are told)
        answer = await self.client.lora_control(name, None)
        if answer.error is not None and not answer.not_found:
            raise LoRAError(answer.error)

    async def shutdown(self) -> None:
        await self.client.shutdown()

    # -- requests in --------------------------------------------------------------------
    @property
    def inputs(self) -> InputProcessor:
        """The engine's request normalisation, made when the engine first reported ready."""
        if self._inputs is None:
            ready = self.client.ready
            assert ready is not None, "the engine has not started"
            self._inputs = InputProcessor(
                self.tokenizer, ready.vocab_size, ready.max_model_len, ready.sampling_defaults
            )
        return self._inputs

    # -- outputs ------------------------------------------------------------------------
    def observe(self, delta: Delta, label: str = "default") -> None:
        """Per-request engine timings (once per prompt: its first sample)."""
        if delta.finished and delta.index == 0 and delta.queue_time_s is not None:
            self.metrics.queue_time.labels(label).observe(delta.queue_time_s)

    async def run(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        routing: Routing = DEFAULT_ROUTING,
        request_id: str | None = None,
        pooling: str | None = None,
    ) -> AsyncIterator[tuple[int, Delta]]:
        """Yield (prompt index, delta) for all prompts' ``params.n`` samples, as they come;
        with ``pooling`` (``params`` then ``POOLING_PARAMS``), each prompt's one pooling
        delta (``embedding``). Each prompt is one ``EngineRequest``, checked by the
        transport (``engine.inputs``) and sent as it is."""
        base = request_id or uuid.uuid4().hex
        label = routing.tag.label

        def request(i: int, ids: list[int]) -> EngineRequest:
            return routing.request(f"{base}-{i}", ids, params, pooling)

        if len(prompts) == 1:  # the common case: no fan-in queue, no extra tasks
            async for delta in self.client.generate(request(0, prompts[0])):
                self.observe(delta, label)
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for delta in self.client.generate(request(i, ids)):
                    await queue.put((i, delta))
            except BaseException as exc:
                await queue.put((i, exc))
                if isinstance(exc, asyncio.CancelledError):
                    raise

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompts)]
        remaining = len(prompts) * params.n
        try:
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                self.observe(item, label)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()


__all__ = ["EngineConfig", "Frontend", "ServingConfig", "make_engine_client"]
