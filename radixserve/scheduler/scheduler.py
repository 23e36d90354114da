"""Continuous batching: who runs this step, and how many tokens each computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from radixserve.core.request import FinishReason, Request, RequestState
from radixserve.scheduler.kv_manager import KVManager, PageCopy


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_threshold: int | None = None  # per-request tokens per step; None = no cap

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.long_prefill_threshold is not None and self.long_prefill_threshold < 1:
            raise ValueError("long_prefill_threshold must be >= 1")


@dataclass
class ScheduledBatch:
    """One step's work: request ``requests[i]`` computes ``num_new_tokens[i]`` tokens starting
    at its ``num_computed_tokens``; if ``sample[i]`` the chunk reaches its last token and the
    step samples one new token for it."""

    requests: list[Request]
    num_new_tokens: np.ndarray
    sample: np.ndarray
    page_copies: list[PageCopy] = field(default_factory=list)
    # Requests that ended while scheduling (e.g. cannot fit in the pool), with no forward.
    failed: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def num_tokens(self) -> int:
        return int(self.num_new_tokens.sum())


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_aborted: int = 0
    num_failed: int = 0


class Scheduler:
    """FCFS continuous batching under one token budget, with chunked prefill and preemption.

    Invariants:
      * every request added is in exactly one of ``waiting``, ``running``, ``_held`` (n>1
        siblings waiting for their leader's prefill) until it ends, and ends exactly once;
      * running requests hold pages (``table_row >= 0``); waiting ones hold none;
      * decodes and prefill chunks of running requests are scheduled before new admissions,
        in admission order; preemption takes the most recently admitted request first.
    """

    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._held: dict[str, list[Request]] = {}  # group leader id -> siblings
        self._fork_source: dict[str, Request] = {}  # sibling id -> leader to share from
        self._requests: dict[str, Request] = {}
        self._admit_counter = 0
        self.stats = SchedulerStats()

    # -- intake ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def add_group(self, requests: list[Request]) -> None:
        """Add the n samples of one prompt: the first prefills it, the rest then share its KV."""
        leader, *siblings = requests
        self.add_request(leader)
        for sibling in siblings:
            if sibling.request_id in self._requests:
                raise ValueError(f"request id {sibling.request_id!r} is already in use")
            self._requests[sibling.request_id] = sibling
        if siblings:
            self._held[leader.request_id] = siblings

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- the step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        cap = self.config.long_prefill_threshold or budget
        scheduled: list[Request] = []
        counts: list[int] = []
        failed: list[Request] = []
        preemptions_before = self.stats.num_preemptions

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, cap)
            if not self._grow_or_preempt(req, req.num_computed_tokens + n, failed):
                continue  # req itself was preempted or failed; running[i] is now the next one
            scheduled.append(req)
            counts.append(n)
            budget -= n
            i += 1

        while (
            self.stats.num_preemptions == preemptions_before  # no admission after a preemption
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and self.kv.page_table.num_free_rows > 0
        ):
            req = self.waiting[0]
            if not self.kv.can_fit(req.num_tokens + 1):
                self.waiting.popleft()
                self._fail(req, "the prompt needs more KV pages than the whole cache holds", failed)
                continue
            n = self._admit(req, budget, cap)
            if n == 0:
                break
            self.waiting.popleft()
            scheduled.append(req)
            counts.append(n)
            budget -= n

        num_new = np.asarray(counts, dtype=np.int32)
        ends = (
            np.fromiter(
                (r.num_computed_tokens for r in scheduled), dtype=np.int64, count=len(scheduled)
            )
            + num_new
        )
        totals = np.fromiter(
            (r.num_tokens for r in scheduled), dtype=np.int64, count=len(scheduled)
        )
        return ScheduledBatch(
            requests=scheduled,
            num_new_tokens=num_new,
            sample=ends == totals,
            page_copies=self.kv.take_pending_copies(),
            failed=failed,
        )

    def _grow_or_preempt(self, req: Request, num_tokens: int, failed: list[Request]) -> bool:
        """Make ``req``'s pages cover ``num_tokens``, preempting later-admitted requests."""
        while not self.kv.grow(req, num_tokens):
            victim = self.running[-1]
            if victim is req:
                if len(self.running) == 1:
                    self.running.pop()
                    self._fail(
                        req,
                        f"the request needs {self.kv.pool.pages_for(num_tokens)} KV pages, "
                        f"more than the {self.kv.pool.num_pages} the cache holds",
                        failed,
                    )
                else:
                    self._preempt(req)
                return False
            self._preempt(victim)
        return True

    def _admit(self, req: Request, budget: int, cap: int) -> int:
        """Give ``req`` a row, its reusable prefix and the pages of its first chunk; returns
        the chunk (0: not now). Keeps one page per running request in reserve for its next
        decode."""
        source = self._fork_source.get(req.request_id)
        hit = None if source is not None else self.kv.match(req)
        cached = self.kv.attach(req, source, hit)
        n = min(req.num_tokens - cached, budget, cap)
        need = self.kv.pages_needed(req, cached + n)
        if self.kv.available_pages() - need < len(self.running) or not self.kv.grow(
            req, cached + n
        ):
            self.kv.release(req, keep_kv=False)
            return 0
        if self.kv.cache is not None and source is None:
            self.kv.cache.record(req.num_tokens, cached)
        req.num_computed_tokens = req.num_cached_tokens = cached
        self._fork_source.pop(req.request_id, None)
        req.transition(RequestState.PREFILL)
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.running.append(req)
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.transition(RequestState.PREEMPTED)
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    def _fail(self, req: Request, message: str, failed: list[Request]) -> None:
        self._end(req, FinishReason.ERROR, message)
        self.stats.num_failed += 1
        failed.append(req)

    # -- after the forward ----------------------------------------------------------------
    def update_after_step(self, batch: ScheduledBatch, sampled: np.ndarray) -> list[Request]:
        """Advance computed counts and append sampled tokens (``sampled[i]`` for requests with
        ``batch.sample[i]``). Returns the requests that received a token."""
        received: list[Request] = []
        for req, n, do_sample, token in zip(
            batch.requests,
            batch.num_new_tokens.tolist(),
            batch.sample.tolist(),
            sampled.tolist(),
            strict=True,
        ):
            if req.is_finished:
                continue
            req.num_computed_tokens += n
            if n > 1:  # a prefill chunk: its full pages become reusable now
                self.kv.cache_full_pages(req)
            if not do_sample:
                continue
            if req.state is RequestState.PREFILL:
                req.transition(RequestState.DECODE)
                self._release_held(req)
            req.append_token(token)
            received.append(req)
        return received

    def _release_held(self, leader: Request) -> None:
        """The leader's prompt KV is ready (or the leader is ending): queue its siblings."""
        siblings = self._held.pop(leader.request_id, None)
        if not siblings:
            return
        if leader.state is RequestState.DECODE:
            for sibling in siblings:
                self._fork_source[sibling.request_id] = leader
            self.waiting.extendleft(reversed(siblings))
        else:  # the leader ends before its prompt is computed: the next sibling leads
            new_leader, *rest = siblings
            self.waiting.append(new_leader)
            if rest:
                self._held[new_leader.request_id] = rest

    # -- endings --------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a running request (a stop condition met, or its step failed)."""
        self.running.remove(req)
        self._end(req, reason, error)

    def abort(self, request_id: str) -> Request | None:
        """Abort a request in any state; returns it, or None if unknown or already ended."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            for leader_id, siblings in list(self._held.items()):
                if req in siblings:
                    siblings.remove(req)
                    if not siblings:
                        del self._held[leader_id]
                    break
        self._end(req, FinishReason.ABORT)
        self.stats.num_aborted += 1
        return req

    def _end(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        self._release_held(req)
        self._fork_source.pop(req.request_id, None)
        self.kv.release(req)
        req.finish(reason, error)
        self._requests.pop(req.request_id, None)
