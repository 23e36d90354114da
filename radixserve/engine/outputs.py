"""What the engine reports to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np


@dataclass
class SequenceDelta:
    """One step's news for one of a request's ``n`` samples.

    Invariant: for each (request_id, index), exactly one delta has ``finished`` set, and it
    is the last one; the deltas' ``text`` joined equals the sample's final text.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs per new token, if asked
    # seconds from arrival to first admission (None: never admitted)
    queue_time_s: float | None = None
    # with the first output token, if asked: TokenLogprobs of prompt tokens 1.. (token 0
    # has none); only the sample that computed the prompt carries them
    prompt_logprobs: list[Any] | None = None
    # a pooling request's finished delta: the pooled final hidden state (float32 numpy
    # array, not normalised); None for generation
    embedding: Any = None
    stop_str: str | None = None  # the stop string that ended the sample, if one did


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs per token, if asked


@dataclass
class RequestOutput:
    """The result of one prompt: ``outputs`` holds its n samples, by index."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # if asked: None for the first prompt token, then its TokenLogprobs for each other
    prompt_logprobs: list[Any] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class EngineStats(msgspec.Struct):
    """The engine's counters after a step (``Engine.stats``); the serving layer sends it
    as is (msgpack), so it is a ``msgspec.Struct``. Page counts satisfy
    ``kv_pages_free + held = kv_pages_total``; ``kv_pages_evictable`` pages are held by the
    radix tree alone and free on demand."""

    running: int
    waiting: int
    kv_pages_total: int
    kv_pages_free: int
    cache_hit_tokens: int
    cache_queried_tokens: int
    preemptions: int
    steps: int
    kv_pages_evictable: int = 0  # held by the radix tree only: free on demand
    kv_pages_protected: int = 0  # in the radix tree and in use by running requests
    radix_nodes: int = 0
    # speculative decoding: proposals verified, of which kept, and verify rows (a request
    # verifying proposals in one step); mean accepted length = 1 + accepted / rows
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_rows: int = 0
    # steps that verified proposals, and steps that could have speculated but the policy
    # (measured or threshold) said no at their batch size
    spec_steps: int = 0
    spec_declined_steps: int = 0
    # KV tiers (docs/kv-tiers.md); zeros when off. Hits: prompt tokens a match took from
    # the host / disk tier (their pages promoted into the pool first); pages moved; bytes
    # moved and the seconds spent copying (disk writes happen on a background thread).
    kv_host_pages_total: int = 0
    kv_host_pages_used: int = 0
    kv_disk_bytes_used: int = 0
    kv_disk_records: int = 0
    cache_hit_tokens_host: int = 0
    cache_hit_tokens_disk: int = 0
    kv_demoted_pages: int = 0  # pool -> host
    kv_promoted_pages: int = 0  # host -> pool
    kv_spilled_pages: int = 0  # host -> disk (queued)
    kv_disk_promoted_pages: int = 0  # disk -> pool
    kv_failed_promotions: int = 0  # no pool pages for a promotion: a plain miss
    kv_disk_read_failures: int = 0  # records missing, corrupt or another model's: a miss
    kv_tier_bytes_moved: int = 0  # pool <-> host, disk -> pool, host -> disk
    kv_tier_move_seconds: float = 0.0  # pool <-> host copies and disk reads
    # the LoRA adapters of running and of waiting requests, sorted (empty without LoRA)
    running_loras: list[str] = msgspec.field(default_factory=list)
    waiting_loras: list[str] = msgspec.field(default_factory=list)


@dataclass(frozen=True)
class CacheFlushResult:
    """What ``Engine.flush_cache`` did. ``idle`` False: the engine had requests, nothing
    was flushed; otherwise ``kv_pages_free`` counts after the tree let go of everything
    (all ``kv_pages_total`` unless pages leaked); ``error``: a failed accounting check."""

    idle: bool
    kv_pages_total: int
    kv_pages_free: int
    radix_nodes_before: int
    error: str | None = None


def l2_normalize(vec: np.ndarray) -> np.ndarray:
    """``vec`` scaled to unit L2 norm (float32; a zero vector stays zero)."""
    vec = np.asarray(vec, dtype=np.float32)
    norm = float(np.linalg.norm(vec.astype(np.float64)))
    return vec / np.float32(norm) if norm > 0 else vec
