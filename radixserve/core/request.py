"""A request and its state machine: NEW → PREFILL → DECODE → FINISHED/ABORTED, PREEMPTED between;
a constrained request waits in WAITING_FOR_GRAMMAR (before NEW) while its grammar compiles."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from radixserve.core.sampling_params import SamplingParams


class RequestState(enum.Enum):
    NEW = "new"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # outside the scheduler, holds nothing
    PREFILL = "prefill"
    DECODE = "decode"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


_ALLOWED: dict[RequestState, frozenset[RequestState]] = {
    RequestState.NEW: frozenset(
        {
            RequestState.WAITING_FOR_GRAMMAR,
            RequestState.PREFILL,
            RequestState.FINISHED,
            RequestState.ABORTED,
        }
    ),
    # compiled: queued as NEW; compile failed or timed out: FINISHED (error); or aborted
    RequestState.WAITING_FOR_GRAMMAR: frozenset(
        {RequestState.NEW, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.PREFILL: frozenset(
        {
            RequestState.DECODE,
            RequestState.PREEMPTED,
            RequestState.FINISHED,
            RequestState.ABORTED,
        }
    ),
    RequestState.DECODE: frozenset(
        {RequestState.PREEMPTED, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.PREEMPTED: frozenset(
        {RequestState.PREFILL, RequestState.FINISHED, RequestState.ABORTED}
    ),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
}

TERMINAL_STATES = frozenset({RequestState.FINISHED, RequestState.ABORTED})


# How a pooling request (an embedding: prompt only, no sampling) reduces the final hidden
# states of its prompt: the last token's, or the mean over every prompt token.
POOLING_KINDS = ("last", "mean")


class InvalidTransition(RuntimeError):
    pass


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class Tenant:
    """Who a request is served for, as the ``fair`` schedule policy sees it: ``name``
    (non-empty), its ``weight`` (> 0: a tenant of weight 2 is due twice the service of one
    of weight 1) and ``max_running`` (its running requests at most; None: no cap)."""

    name: str
    weight: float = 1.0
    max_running: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"tenant {self.name!r}: max_running must be >= 1")


DEFAULT_TENANT = Tenant("default")

# Who may share cached KV (``--prefix-cache-scope``): ``tenant`` (the default): a tenant's
# requests match only pages its own requests computed; ``global``: every tenant's do (one
# trusted team sharing system prompts). A ``cache_salt`` partitions within either.
PREFIX_CACHE_SCOPES = ("tenant", "global")


def cache_namespace(
    cache_salt: str | None, tenant: Tenant | None, scope: str, lora: str | None = None
) -> Hashable:
    """The radix-cache namespace of a request: requests share cached KV exactly when their
    namespaces are equal. Under scope ``tenant`` a named tenant's namespace is a tuple
    ``("tenant", name, cache_salt)``, which no client-chosen salt (a string) can equal, so
    no tenant reaches another's pages whatever it sends; tenant ``default`` (a server
    without tenants, or a ``--api-key`` key) keeps the bare salt, as before. Sub-tenants
    (``NAME/SUB``) are tenants of their own here. ``lora`` (the key of the LoRA adapter
    that computes the request's KV) makes a namespace of its own, ``("lora", key, base)``:
    a page one adapter computed never serves another adapter or the base model."""
    if scope not in PREFIX_CACHE_SCOPES:
        raise ValueError(f"prefix cache scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}")
    if scope == "global" or tenant is None or tenant.name == DEFAULT_TENANT.name:
        base: Hashable = cache_salt
    else:
        base = ("tenant", tenant.name, cache_salt)
    return base if lora is None else ("lora", lora, base)


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it, the one value at the engine's boundary: built
    and checked once where it enters (``Engine.add_request`` offline, the serving frontend
    for HTTP and gRPC), then trusted: it crosses the engine client, the wire (msgpack) and
    ``Engine.submit`` unchanged, and nothing below re-validates it.

    Invariants (its builder's): ``prompt_token_ids`` is non-empty, in the vocabulary and
    fits the context with ``params.max_tokens`` more; ``params`` was checked against the
    vocabulary; ``pooling`` is None or one of ``POOLING_KINDS``, and then ``params`` is
    ``POOLING_PARAMS``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefix-cache partition (``cache_namespace``)
    priority: int = 0  # lower runs first (policy "priority")
    tenant: Tenant | None = None  # who it is served for (None: "default")
    # a pooling request (an embedding): "last" or "mean"; nothing is sampled
    pooling: str | None = None
    # the LoRA adapter it runs on, by name (None: the base model)
    lora: str | None = None


# what a pooling request "samples": its prompt's last position, greedily, then it ends
POOLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class Request:
    """One sequence being generated.

    Invariants:
      * ``token_ids[:num_tokens]`` is the prompt followed by the output so far;
        ``num_prompt_tokens <= num_tokens <= num_prompt_tokens + max_tokens``.
      * ``num_cached_tokens <= num_computed_tokens <= num_tokens``: KV exists for the first
        ``num_computed_tokens`` tokens, of which the first ``num_cached_tokens`` came from the
        prefix cache.
      * the state only moves along the edges of ``_ALLOWED``; a terminal state is reached
        at most once (``finish``), and then ``finish_reason`` is set.
      * ``table_row`` is set exactly while the request owns KV pages (PREFILL or DECODE).
      * while a launched step is not processed, ``token_ids[num_tokens - 1]`` may be a
        placeholder (negative); every token before it is real.
      * ``pooling`` (one of ``POOLING_KINDS``) marks a pooling request: its
        ``max_tokens`` is 1 and the step that computes its last prompt token samples nothing
        for it (the slot after the prompt holds -1); the engine ends it there with the
        pooled hidden state instead of a token.
    """

    __slots__ = (
        "admit_seq",
        "arrival_time",
        "cache_namespace",
        "cache_node",
        "deadline",
        "error",
        "finish_reason",
        "first_scheduled_time",
        "grammar",
        "group_id",
        "last_step",
        "lora",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_pages",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens",
        "pooling",
        "priority",
        "probe_len",
        "probe_node",
        "probe_stamp",
        "prompt_charged",
        "queue_key",
        "request_id",
        "sampling_params",
        "state",
        "table_row",
        "tenant",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: np.ndarray | list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        group_id: str | None = None,
        cache_namespace: Hashable = None,
        priority: int = 0,
        deadline: float | None = None,
        tenant: Tenant | None = None,
        pooling: str | None = None,
        lora: object | None = None,
    ) -> None:
        prompt = np.asarray(prompt_token_ids, dtype=np.int32)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
        if pooling is not None:
            if pooling not in POOLING_KINDS:
                raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}")
            if sampling_params.max_tokens != 1 or sampling_params.n != 1:
                raise ValueError("a pooling request has max_tokens = 1 and n = 1")
        self.pooling = pooling
        self.lora = lora  # the executor's LoRA adapter it runs on (None: the base model)
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.sampling_params = sampling_params
        self.num_prompt_tokens = int(prompt.size)
        self.token_ids = np.empty(prompt.size + sampling_params.max_tokens, dtype=np.int32)
        self.token_ids[: prompt.size] = prompt
        self.num_tokens = int(prompt.size)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_pages = 0
        self.num_preemptions = 0
        self.table_row = -1
        # radix-cache namespace (``cache_namespace``): only equal ones share cached KV
        self.cache_namespace = cache_namespace
        self.cache_node: object | None = None  # radix node locked while using cached pages
        self.admit_seq = -1
        self.last_step = 0  # id of the latest launched step that contains it
        self.priority = priority  # lower runs first (policy "priority")
        self.deadline = deadline  # monotonic time after which it fails, in any state
        self.tenant = DEFAULT_TENANT if tenant is None else tenant  # policy "fair"
        self.prompt_charged = 0  # (fair) prompt positions below it are charged to the tenant
        self.queue_key: tuple[int, int] = (0, 0)  # position in the waiting queue
        # cached-prefix estimate kept by prefix-aware policies while waiting
        self.probe_len = 0
        self.probe_node: object | None = None
        self.probe_stamp = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # first admission (queue time ends)
        self.state = RequestState.NEW
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # constrained decoding: the executor's grammar matcher of this sample (None: free);
        # it has accepted every sampled token of this request, placeholders included
        self.grammar: object | None = None

    # -- tokens ---------------------------------------------------------------------------
    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        return self.token_ids[self.num_prompt_tokens : self.num_tokens]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> np.ndarray:
        return self.token_ids[: self.num_tokens]

    def append_token(self, token_id: int) -> None:
        if self.num_tokens >= self.token_ids.size:
            raise RuntimeError(f"request {self.request_id} exceeded max_tokens")
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1

    # -- state ----------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL_STATES

    def transition(self, new_state: RequestState) -> None:
        if new_state not in _ALLOWED[self.state]:
            raise InvalidTransition(
                f"request {self.request_id}: {self.state.value} -> {new_state.value} is not allowed"
            )
        self.state = new_state

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Move to the terminal state matching ``reason`` (ABORTED for ABORT, else FINISHED)."""
        terminal = RequestState.ABORTED if reason is FinishReason.ABORT else RequestState.FINISHED
        self.transition(terminal)
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
