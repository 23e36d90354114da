"""Messages between the frontend and the engine process (msgpack via msgspec; no pickle).

Typed end to end: a request is the engine's own ``EngineRequest`` (dataclasses msgspec
encodes field by field and rebuilds; ``SamplingParams`` re-runs its validation), the
engine's counters travel as the engine's own ``EngineStats``."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.core.request import EngineRequest
from radixserve.engine.outputs import EngineStats

__all__ = ["EngineStats"]  # (the wire form of the engine's counters)


class GenerateRequest(msgspec.Struct, tag="generate"):
    """A request for the engine, as the frontend built and checked it (``Engine.submit``)."""

    request: EngineRequest


class AbortRequest(msgspec.Struct, tag="abort"):
    request_id: str
    index: int | None = None  # one sample of the request; None: all of them


class RadixQuery(msgspec.Struct, tag="radix_query"):
    """Ask for a bounded summary of the radix tree (see ``core.radix_summary``)."""

    query_id: int
    max_nodes: int = 256
    max_depth: int = 8


class FlushCache(msgspec.Struct, tag="flush_cache"):
    """Debug: if idle, check the page accounting and empty the radix tree (answered by
    ``CacheFlushed``)."""

    query_id: int


class LoRAControl(msgspec.Struct, tag="lora"):
    """Load LoRA adapter ``name`` from ``path`` (a PEFT folder), or unload it (``path``
    None); answered by ``LoRAAnswer``."""

    query_id: int
    name: str
    path: str | None = None


class Delta(msgspec.Struct, array_like=True):
    """One step's news for one sample (see ``engine.outputs.SequenceDelta``). From the
    engine process ``text`` is empty: the frontend detokenizes (``engine_client``)."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # per new token: (token id, logprob, [(top id, top logprob), ...]) when asked for
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    queue_time_s: float | None = None  # arrival → first admission (None: not admitted)
    # with the first token, if asked: (id, logprob, top) of prompt tokens 1.. (as logprobs)
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # set by the frontend when a stop string ended the sample: that string
    stop_str: str | None = None
    # a pooling request's finished delta: the pooled final hidden state, not normalised,
    # as little-endian float32 bytes
    embedding: bytes | None = None


class Outputs(msgspec.Struct, tag="outputs"):
    """Everything one engine step produced, in one message."""

    deltas: list[Delta]
    stats: EngineStats | None = None


class Rejected(msgspec.Struct, tag="rejected"):
    """The engine refused a request before it started (bad input, overloaded)."""

    request_id: str
    message: str
    overloaded: bool = False


class RadixSummary(msgspec.Struct, tag="radix_summary"):
    """The answer to a ``RadixQuery``; ``nodes`` rows as ``core.radix_summary.NodeRow``;
    ``cost_ms``: what building it cost the engine loop."""

    query_id: int
    nodes: list[tuple[int, int, int, int, int, int, int, int, int, int, bytes, int]]
    namespaces: int
    total_nodes: int
    total_tokens: int
    evictable_pages: int
    protected_pages: int
    page_size: int
    truncated: bool
    cost_ms: float
    error: str | None = None


class CacheFlushed(msgspec.Struct, tag="cache_flushed"):
    """The answer to ``FlushCache``. ``idle`` False: the engine had requests, nothing was
    flushed. Otherwise ``kv_pages_free`` counts after the tree let go of everything: all
    ``kv_pages_total`` of them unless pages leaked; ``error``: a failed accounting check."""

    query_id: int
    idle: bool
    kv_pages_total: int
    kv_pages_free: int
    radix_nodes_before: int = 0
    error: str | None = None


class LoRAAnswer(msgspec.Struct, tag="lora_answer"):
    """The answer to ``LoRAControl``: ``error`` None when done; ``not_found``: the adapter
    to unload was not loaded."""

    query_id: int
    error: str | None = None
    not_found: bool = False


class Ready(msgspec.Struct, tag="ready"):
    """The engine has loaded its model: what the frontend needs to make its requests
    (the same ``engine.inputs.InputProcessor`` settings the engine uses)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    sampling_defaults: dict[str, Any] = {}
    # embeddings: the model's own pooling ("last" / "mean") if it is an embedding model;
    # the size of a pooled vector (0: no model, a simulated device); the sizes a Matryoshka
    # model may be truncated to ([]: any; None: not a Matryoshka model)
    model_pooling: str | None = None
    hidden_size: int = 0
    matryoshka_dimensions: list[int] | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    stats: EngineStats


ToEngine = GenerateRequest | AbortRequest | RadixQuery | FlushCache | LoRAControl
FromEngine = Outputs | Rejected | Ready | Heartbeat | RadixSummary | CacheFlushed | LoRAAnswer

encoder = msgspec.msgpack.Encoder()
# the frontend sends what one event-loop turn produced as one message: a list
to_engine_decoder = msgspec.msgpack.Decoder(list[ToEngine])
# one message of such a list on its own (when the list as a whole does not decode)
to_engine_items_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
to_engine_item_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
