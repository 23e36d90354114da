"""Continuous batching: who runs this step, and how many tokens each computes."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from radixserve.core.request import FinishReason, Request, RequestState
from radixserve.core.step import ScheduledBatch
from radixserve.scheduler.fair import (
    DEFAULT_OUTPUT_WEIGHT,
    DEFAULT_PROMPT_WEIGHT,
    FairPolicy,
    FairQueue,
    PrefillShares,
    SharedStepCap,
    VirtualTokenCounter,
)
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.policy import POLICIES, SchedulePolicy, WaitingQueue, make_policy

# In-batch prefix sharing: a waiting request whose next this many uncached tokens equal
# those a running request is prefilling right now waits for that KV instead of
# recomputing it.
_SHARED_PREFIX_PROBE = 32
_MAX_DEFERRALS_PER_STEP = 64


class EngineOverloaded(RuntimeError):
    """Raised by ``add_request`` when the waiting queue is full (``max_waiting_requests``)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's settings. Invariant: every limit is positive (``ValueError``
    otherwise).

    The engine sets the user-facing ones from its ``EngineConfig`` in one place
    (``engine.builder.scheduler_config``). These are internal, tuned constants that only
    the simulator, the benchmarks and the tests change: ``priority_preemption``,
    ``reserve_clip_tokens``, ``reserve_ratio_decay_steps``, ``fair_prompt_weight``,
    ``fair_output_weight``, ``fair_prefill_yield_tokens``."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_threshold: int | None = None  # per-request prefill tokens per step
    policy: str = "fcfs"
    priority_preemption: bool = True  # policy "priority": preempt lower-priority runners
    max_waiting_requests: int | None = None
    max_queue_time_s: float | None = None
    max_loras: int = 8  # different LoRA adapters among the running requests at most
    batch_wait_s: float = 0.0
    # Decode reserve per running request: min(remaining max_tokens, clip) x ratio tokens.
    reserve_clip_tokens: int = 4096
    reserve_ratio_init: float = 0.7
    reserve_ratio_min: float = 0.1
    reserve_ratio_decay_steps: int = 600
    # policy "fair": service charged per prompt token computed and per output token
    fair_prompt_weight: float = DEFAULT_PROMPT_WEIGHT
    fair_output_weight: float = DEFAULT_OUTPUT_WEIGHT
    # policy "fair": in a step that admits a request of a tenant served less, the prefill
    # chunks of tenants served more take at most this many tokens
    fair_prefill_yield_tokens: int = 0
    # policy "fair": while more than one tenant has had a request waiting or running within
    # the last ``fair_active_window_s`` seconds, a step computes at most this many prompt
    # tokens (None: no cap): the step running when a tenant's next request arrives is
    # short, so is its wait for it (one tenant alone keeps the whole budget)
    fair_step_prefill_tokens: int | None = None  # (the engine's default: 64)
    fair_active_window_s: float = 10.0
    # policy fair: steer that cap (down to 16 tokens, up to fair_step_prefill_tokens) so
    # such a step takes about this long on the device, or 1.5 decode-only steps where
    # longer (SharedStepCap; None: the token cap as it is)
    fair_step_target_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_loras < 1:
            raise ValueError("max_loras must be >= 1")
        if self.long_prefill_threshold is not None and self.long_prefill_threshold < 1:
            raise ValueError("long_prefill_threshold must be >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be >= 1")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError("max_queue_time must be > 0")
        if self.batch_wait_s < 0:
            raise ValueError("batch_wait must be >= 0")
        if not 0 <= self.reserve_ratio_min <= self.reserve_ratio_init <= 1:
            raise ValueError("need 0 <= reserve_ratio_min <= reserve_ratio_init <= 1")
        if self.fair_prefill_yield_tokens < 0:
            raise ValueError("fair_prefill_yield_tokens must be >= 0")
        if self.fair_step_prefill_tokens is not None and self.fair_step_prefill_tokens < 1:
            raise ValueError("fair_step_prefill_tokens must be >= 1 (None: no cap)")
        if not self.fair_active_window_s >= 0:
            raise ValueError("fair_active_window_s must be >= 0")
        if self.fair_step_target_s is not None and not self.fair_step_target_s > 0:
            raise ValueError("fair_step_target_s must be > 0 (None: no target)")


@dataclass
class SchedulerStats:
    """Counters for metrics; only ever increase."""

    num_admitted: int = 0
    num_preemptions: int = 0
    num_fair_preemptions: int = 0  # (fair) preempted to make room for a less-served tenant
    num_aborted: int = 0
    num_failed: int = 0
    num_timed_out: int = 0
    num_rejected: int = 0
    num_deferred_for_sharing: int = 0
    # tokens sampled by a launched step for a request that ended before it was processed
    num_discarded_tokens: int = 0


class Scheduler:
    """Continuous batching under one token budget: decodes first, then prefill chunks of
    running requests, then admissions in policy order while memory allows.

    Invariants:
      * every request added is in exactly one of ``waiting``, ``running``, ``_held`` (n>1
        siblings waiting for their leader's prefill) until it ends, and ends exactly once
        (``finish`` / ``abort`` / a failure listed in a batch's ``failed``);
      * running requests hold pages (``table_row >= 0``); waiting ones hold none;
      * a running request is scheduled every step while the budget lasts (decodes first),
        so no prefill, however long, delays a decode by more than one chunk (policy fair:
        after the decodes, prefill chunks go by tenant counter with the admissions among
        them, a chunk that cannot grow without preempting waits for the next step, and in a
        step that completes the prompt of a less-served tenant's new request the chunks of
        tenants served more get at most ``fair_prefill_yield_tokens``; when every row is
        taken, a request admitted for the least-served tenant may preempt one of the
        most-served tenant's, never leaving that tenant fewer rows per unit of weight
        than it);
      * admission keeps free + evictable pages >= the uncached prompt pages of every running
        request + a decode reserve that adapts (``reserve_ratio``) to observed preemptions;
      * steps are launched (``begin_step``) and processed (``end_step``) in order, at most a
        few apart: a launched step advances its requests at once, its sampled tokens are
        placeholders until processed. Only KV of processed steps is ever shared (the radix
        tree, n>1 siblings): a request that ends or is preempted counts its KV only up to the
        first step containing it that is not processed yet.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.running: list[Request] = []
        self._fair: FairPolicy | None = None
        if config.policy == "fair":
            vtc = VirtualTokenCounter(config.fair_prompt_weight, config.fair_output_weight)
            self.waiting: WaitingQueue = FairQueue(vtc)
            self._fair = FairPolicy(self.waiting, lambda: self.running, kv.cache)
            self.policy: SchedulePolicy = self._fair
        else:
            self.policy = make_policy(config.policy, kv.cache)
            self.waiting = WaitingQueue(use_priority=config.policy == "priority")
        # policy fair: the step cap while tenants share, steered by measured step times;
        # (cap, prompt tokens under it) of the step being built when it is shared
        self.shared_cap: SharedStepCap | None = None
        self._shared_step: tuple[int, int] | None = None
        if self._fair is not None and config.fair_step_prefill_tokens is not None:
            self.shared_cap = SharedStepCap(
                config.fair_step_prefill_tokens, config.fair_step_target_s
            )
        self._held: dict[str, list[Request]] = {}  # group leader id -> siblings
        self._fork_source: dict[str, Request] = {}  # sibling id -> leader to share from
        self._requests: dict[str, Request] = {}
        self._timeouts: list[tuple[float, int, Request]] = []  # (when, seq, request)
        self._timeout_seq = itertools.count()
        self._admit_counter = 0
        self.reserve_ratio = config.reserve_ratio_init
        self.stats = SchedulerStats()
        self._unprocessed: deque[ScheduledBatch] = deque()  # launched, results not applied
        self._num_launched = 0

    # -- intake ---------------------------------------------------------------------------
    def _check_capacity(self, extra: int) -> None:
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) + extra > limit:
            self.stats.num_rejected += extra
            raise EngineOverloaded(
                f"server overloaded: {len(self.waiting)} requests already waiting "
                f"(max_waiting_requests={limit}); retry later"
            )

    def add_request(self, request: Request) -> None:
        self.add_group([request])

    def add_group(self, requests: list[Request]) -> None:
        """Add the n samples of one prompt: the first prefills it, the rest then share its KV."""
        self._check_capacity(len(requests))
        for req in requests:
            if req.request_id in self._requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
        leader, *siblings = requests
        for req in requests:
            self._requests[req.request_id] = req
            self._watch_timeouts(req)
        self.waiting.push(leader)
        if siblings:
            self._held[leader.request_id] = siblings

    def _watch_timeouts(self, req: Request) -> None:
        if self.config.max_queue_time_s is not None:
            when = req.arrival_time + self.config.max_queue_time_s
            heapq.heappush(self._timeouts, (when, next(self._timeout_seq), req))
        if req.deadline is not None:
            heapq.heappush(self._timeouts, (req.deadline, next(self._timeout_seq), req))

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- the step -------------------------------------------------------------------------
    def schedule(self, proposals: Mapping[str, np.ndarray] | None = None) -> ScheduledBatch:
        """This step's batch. ``proposals`` (speculative decoding, serial loop only): token
        ids proposed after a decoding request's last token; each is verified in that
        request's chunk as far as the token budget (one token kept for every decode still
        to schedule), ``max_tokens`` and free pages allow (never by preempting)."""
        failed: list[Request] = []
        self._expire(failed)
        self._shared_step = None
        budget = self.config.max_num_batched_tokens
        cap = self.config.long_prefill_threshold or budget
        scheduled: list[Request] = []
        counts: list[int] = []
        spec: list[int] = []
        preemptions_before = self.stats.num_preemptions

        if self.config.policy == "priority":  # higher priority gets budget and pages first
            self.running.sort(key=lambda r: (r.priority, r.admit_seq))
        # policy fair: decodes first, then prefill chunks and admissions by tenant counter
        # (prefill chunks are ``held`` until after the decodes)
        hold = self._fair is not None
        held: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_tokens >= req.sampling_params.max_tokens:
                i += 1  # its last token is not processed yet; it ends without another step
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, cap)
            if hold and n > 1:
                held.append(req)
                i += 1
                continue
            if not self._grow_or_preempt(i, req.num_computed_tokens + n, failed):
                continue  # req itself was preempted or failed; running[i] is now the next one
            k = 0
            if proposals and n == 1 == req.num_tokens - req.num_computed_tokens:
                draft = proposals.get(req.request_id)
                if draft is not None and draft.size:
                    k = self._take_proposals(
                        req, draft, budget - (len(self.running) - i), len(self.running) - i - 1
                    )
            scheduled.append(req)
            counts.append(n + k)
            spec.append(k)
            budget -= n + k
            i += 1

        if self.stats.num_preemptions != preemptions_before:
            self.reserve_ratio = self.config.reserve_ratio_init  # memory was short: be careful
        else:
            span = self.config.reserve_ratio_init - self.config.reserve_ratio_min
            self.reserve_ratio = max(
                self.config.reserve_ratio_min,
                self.reserve_ratio - span / self.config.reserve_ratio_decay_steps,
            )
            admit = budget > 0 and self.waiting and not self._batch_wait_pending()
            if self._fair is not None:
                budget = self._fair_prefills(
                    held, admit, budget, cap, scheduled, counts, failed, spec
                )
                held = []
            elif admit:
                budget = self._admit_waiting(budget, cap, scheduled, counts, failed, spec)
        if held:
            budget = self._schedule_held(held, budget, cap, scheduled, counts, failed)

        num_new = np.asarray(counts, dtype=np.int32)
        starts = np.fromiter(
            (r.num_computed_tokens for r in scheduled), dtype=np.int64, count=len(scheduled)
        )
        totals = np.fromiter(
            (r.num_tokens for r in scheduled), dtype=np.int64, count=len(scheduled)
        )
        num_spec = None
        if any(spec):
            num_spec = np.zeros(len(scheduled), dtype=np.int32)
            num_spec[: len(spec)] = spec  # admissions come after the decodes
        sample = starts + num_new == totals
        if num_spec is not None:
            sample = starts + num_new - num_spec == totals
        if self._fair is not None:
            self._fair.charge_step(scheduled, (starts + num_new).tolist(), sample.tolist())
        if self._shared_step is not None:  # rows with more than their last token: prompt
            self._shared_step = (self._shared_step[0], int(num_new[totals - starts > 1].sum()))
        return ScheduledBatch(
            requests=scheduled,
            num_new_tokens=num_new,
            sample=sample,
            starts=starts,
            totals=totals,
            page_copies=self.kv.take_pending_copies(),
            failed=failed,
            num_spec=num_spec,
            shared_step=self._shared_step,
        )

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """The device time a launched step took (policy fair steers the shared step cap by
        it; ``seconds`` <= 0: not measured)."""
        if self.shared_cap is not None and batch.shared_step is not None:
            cap, prefill = batch.shared_step
            self.shared_cap.observe(prefill, cap, seconds)

    def _fair_prefills(
        self,
        held: list[Request],
        admit: bool,
        budget: int,
        cap: int,
        scheduled: list[Request],
        counts: list[int],
        failed: list[Request],
        spec: list[int],
    ) -> int:
        """Policy fair, after the decodes: the held prefill chunks of tenants served less
        than the next tenant to admit (and its own), then the admissions, then the other
        chunks. Once a request whose whole prompt fits in this step is admitted, every
        tenant ranked after its tenant at the step's start (a greater counter, or the same
        with more running requests) adds at most ``fair_prefill_yield_tokens`` of prefill
        (admissions and chunks) to the step: the step that gives a less-served tenant its
        first token is not lengthened by the prompts of tenants served more. Returns the
        budget left."""
        fair = self._fair
        assert fair is not None
        cut = None if self.shared_cap is None else self.shared_cap.tokens
        shared = cut is not None and fair.shared(self.clock(), self.config.fair_active_window_s)
        ceiling = None if self.shared_cap is None else self.shared_cap.ceiling
        limits = PrefillShares(cut if shared else None, ceiling)
        at_start = fair.standing({r.tenant.name for r in held} | fair.waiting_tenants())
        first, later = fair.split_held(held) if held else ([], [])
        budget = self._schedule_held(first, budget, cap, scheduled, counts, failed, limits)
        if admit:
            budget = self._admit_waiting(
                budget, cap, scheduled, counts, failed, spec, limits, at_start
            )
        budget = self._schedule_held(later, budget, cap, scheduled, counts, failed, limits)
        if shared and cut is not None:
            self._shared_step = (cut, 0)  # its prompt tokens: counted once the batch is final
        return budget

    def _schedule_held(
        self,
        held: list[Request],
        budget: int,
        cap: int,
        scheduled: list[Request],
        counts: list[int],
        failed: list[Request],
        limits: PrefillShares | None = None,
    ) -> int:
        """Prefill chunks held back by policy fair, in order, with the budget left (never
        preempting: the growing is done) and ``limits`` (the tokens tenants may still add
        to this step; used up here). Returns the budget left."""
        for req in held:
            if budget <= 0:
                break
            if req.state is not RequestState.PREFILL:
                continue  # preempted meanwhile (to make room for an earlier one here)
            n = min(req.num_tokens - req.num_computed_tokens, budget, cap)
            name = req.tenant.name
            room = None if limits is None else limits.room(name)
            if room is not None:
                n = min(n, room)
                if n <= 0:
                    continue
            grown = self.kv.grow(req, req.num_computed_tokens + n)
            if not grown and not scheduled:
                # nothing else runs this step: make room as the running loop would (the
                # batch is empty, so no victim is in it)
                grown = self._grow_or_preempt(
                    self.running.index(req), req.num_computed_tokens + n, failed
                )
            if grown:
                scheduled.append(req)
                counts.append(n)
                budget -= n
                self._fair.charge_prompt(req, req.num_computed_tokens + n)
                if limits is not None:
                    limits.take(name, n)
        return budget

    def _take_proposals(self, req: Request, draft: np.ndarray, room: int, others: int) -> int:
        """Put up to ``room`` proposals after ``req``'s last token (in ``token_ids`` past
        ``num_tokens``: unverified, uncounted) if its pages can grow to hold them and still
        leave a page for each of the ``others`` decodes after it; returns how many. At most
        ``max_tokens - outputs - 1``: every proposal kept, plus the token after them, stays
        within ``max_tokens``."""
        limit = req.sampling_params.max_tokens - req.num_output_tokens - 1
        k = max(0, min(int(draft.size), room, limit))
        if k == 0:
            return 0
        need = self.kv.pages_needed(req, req.num_tokens + k)
        if need and need + others > self.kv.available_pages():
            return 0
        if not self.kv.grow(req, req.num_tokens + k):
            return 0
        req.token_ids[req.num_tokens : req.num_tokens + k] = draft[:k]
        return k

    def _batch_wait_pending(self) -> bool:
        """Hold admissions while the batch is small and the oldest waiting request arrived
        less than ``batch_wait`` ago (more may come to batch with it)."""
        wait = self.config.batch_wait_s
        if wait <= 0 or len(self.running) >= max(1, self.config.max_num_seqs // 8):
            return False
        oldest = min(r.arrival_time for r in self.waiting)
        return self.clock() - oldest < wait

    def next_wakeup(self) -> float | None:
        """When a held-back admission (batch wait) becomes due, or None."""
        if self.config.batch_wait_s <= 0 or not self.waiting:
            return None
        return min(r.arrival_time for r in self.waiting) + self.config.batch_wait_s

    def _admit_waiting(
        self,
        budget: int,
        cap: int,
        scheduled: list[Request],
        counts: list[int],
        failed: list[Request],
        spec: list[int] | None = None,
        limits: PrefillShares | None = None,
        standing: dict[str, tuple[float, int]] | None = None,
    ) -> int:
        """Admit waiting requests in policy order; ``spec`` (proposals per scheduled decode,
        aligned with the first ``len(spec)`` of ``scheduled``) loses the entry of a victim
        taken out of the batch. Policy fair: ``limits`` holds the prefill tokens left to a
        tenant this step (used up here); once a request whose whole prompt fits in this
        step is admitted, every tenant ranked after its tenant at the step's start
        (``standing``: counter, then running requests) is limited to
        ``fair_prefill_yield_tokens`` more. Returns the budget left."""
        committed = self._committed_pages()
        prefilling = self._prefilling_keys()
        deferrals_left = _MAX_DEFERRALS_PER_STEP
        # the LoRA adapters running (at most max_loras: one on none of them waits its turn,
        # passed over, not blocking those behind it)
        adapters = {id(r.lora) for r in self.running if r.lora is not None}
        for req in self.policy.order(self.waiting):
            if budget <= 0:
                break
            preempted_for_it = False
            rows_full = (
                len(self.running) >= self.config.max_num_seqs
                or self.kv.page_table.num_free_rows == 0
            )
            if rows_full and self._fair is None:
                break
            if not self.kv.can_fit(req.num_tokens + 1):
                self.waiting.remove(req)
                self._fail(req, "the prompt needs more KV pages than the whole cache holds", failed)
                continue
            if (
                req.lora is not None
                and id(req.lora) not in adapters
                and len(adapters) >= self.config.max_loras
            ):
                continue
            if prefilling and self._shares_running_prefill(req, prefilling):
                self.stats.num_deferred_for_sharing += 1
                deferrals_left -= 1
                if deferrals_left == 0:
                    break  # bounded work per step; the rest would most likely wait too
                continue
            whole = req.num_tokens - req.num_computed_tokens
            limit = None if limits is None else limits.room(req.tenant.name, whole)
            if limit is not None and limit <= 0:  # (fair) its share of the step is used up
                self._fair.pass_over(req.tenant.name)
                continue
            if rows_full:  # (fair) a row from the most-served tenant, or wait
                victim = self._fair.victim_for(req, self._victim)
                if victim is None:
                    break
                budget += self._unschedule(victim, scheduled, counts, spec)
                self._preempt(victim)
                self.stats.num_fair_preemptions += 1
                preempted_for_it = True
                committed = self._committed_pages()
            n, pages = self._admit(req, self._room(budget, limit), cap, committed)
            while n == 0 and self.config.policy == "priority":
                victim = self._lower_priority_victim(req)
                if victim is None:
                    break
                budget += self._unschedule(victim, scheduled, counts, spec)
                self._preempt(victim)
                preempted_for_it = True
                committed = self._committed_pages()
                n, pages = self._admit(req, self._room(budget, limit), cap, committed)
            if n == 0:
                break  # head-of-line: later requests wait too (no starvation of this one)
            self.waiting.remove(req)
            if req.lora is not None:
                adapters.add(id(req.lora))
            committed += pages
            scheduled.append(req)
            counts.append(n)
            budget -= n
            if self._fair is not None:  # charged now: the next admission sees it
                self._fair.charge_prompt(req, req.num_computed_tokens + n)
            if limits is not None:
                limits.take(req.tenant.name, n)
                if standing is not None and req.num_computed_tokens + n == req.num_tokens:
                    self._yield_to(req.tenant.name, limits, standing)
            key = self._prefix_key(req, req.num_computed_tokens) if self.kv.cache else None
            if key is not None:  # its KV reaches the tree only after this step
                prefilling.add(key)
            if preempted_for_it and self._fair is None:
                break  # the room was made for this request, not for those behind it
        return budget

    def _yield_to(
        self, name: str, limits: PrefillShares, standing: dict[str, tuple[float, int]]
    ) -> None:
        """(fair) Tenant ``name`` has a prompt finishing its prefill in this step: every
        tenant ranked after it at the step's start (a greater counter, or the same with more
        running requests) gets at most ``fair_prefill_yield_tokens`` more."""
        mine = standing.get(name)
        if mine is None:
            return
        cut = self.config.fair_prefill_yield_tokens
        for other, rank in standing.items():
            if rank > mine:
                limits.cap(other, cut)

    @staticmethod
    def _room(budget: int, limit: int | None) -> int:
        return budget if limit is None else min(budget, limit)

    @staticmethod
    def _unschedule(
        victim: Request, scheduled: list[Request], counts: list[int], spec: list[int] | None
    ) -> int:
        """Take ``victim`` out of this step's batch if it is in it (before preempting it);
        returns the tokens given back to the budget. ``spec`` loses its entry too."""
        if victim not in scheduled:
            return 0
        j = scheduled.index(victim)
        if spec is not None and j < len(spec):
            spec.pop(j)  # (its grown pages go with it: _preempt releases them)
        del scheduled[j]
        return counts.pop(j)

    def _reserve_tokens(self, req: Request) -> float:
        remaining = req.sampling_params.max_tokens - req.num_output_tokens
        return min(remaining, self.config.reserve_clip_tokens) * self.reserve_ratio

    def _committed_pages(self) -> int:
        """Pages running requests will still take: the rest of their prompts (chunked
        prefill) plus the adaptive decode reserve."""
        pool = self.kv.pool
        total = 0
        for r in self.running:
            total += max(0, pool.pages_for(r.num_tokens) - r.num_pages)
            total += math.ceil(self._reserve_tokens(r) / pool.page_size)
        return total

    def _admit(self, req: Request, budget: int, cap: int, committed: int) -> tuple[int, int]:
        """Give ``req`` a row, its reusable prefix and the pages of its first chunk, if its
        whole prompt plus its own reserve fit next to what running requests still need.
        Returns (chunk tokens, pages it commits); (0, 0) means not now."""
        source = self._fork_source.get(req.request_id)
        hit = None if source is not None else self.kv.match(req)
        cached = self.kv.attach(req, source, hit)
        n = min(req.num_tokens - cached, budget, cap)
        pool = self.kv.pool
        prompt_pages = self.kv.pages_needed(req, req.num_tokens)
        own = prompt_pages
        if self.running:  # alone, a request only needs its prompt to fit (it may grow later)
            own += math.ceil(self._reserve_tokens(req) / pool.page_size)
        if self.kv.available_pages() - own < committed or not self.kv.grow(req, cached + n):
            self.kv.release(req, keep_kv=False)
            return 0, 0
        if self.kv.cache is not None and source is None:
            self.kv.cache.record(req.num_tokens, cached)
        req.num_computed_tokens = req.num_cached_tokens = cached
        self._fork_source.pop(req.request_id, None)
        req.transition(RequestState.PREFILL)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        self.stats.num_admitted += 1
        self.running.append(req)
        still_needed = self.kv.pages_needed(req, req.num_tokens)
        return n, still_needed + math.ceil(self._reserve_tokens(req) / pool.page_size)

    # -- in-batch prefix sharing ----------------------------------------------------------
    def _prefix_key(self, req: Request, computed: int) -> tuple | None:
        """Identifies the tokens right after ``computed`` (rounded down to a page), in the
        request's cache namespace: a request never waits for KV another namespace (another
        tenant, another salt) is computing, which it could not reuse, and its time to first
        token tells nothing of what others are prefilling."""
        start = computed // self.kv.page_size * self.kv.page_size
        end = start + _SHARED_PREFIX_PROBE
        if end > req.num_tokens - 1:
            return None
        return (req.cache_namespace, start, *req.token_ids[start:end].tolist())

    def _prefilling_keys(self) -> set:
        """The next uncached tokens of every request prefilling now (radix cache only)."""
        if self.kv.cache is None:
            return set()
        keys = {
            self._prefix_key(r, r.num_computed_tokens)
            for r in self.running
            if r.state is RequestState.PREFILL
        }
        keys.discard(None)
        return keys

    def _shares_running_prefill(self, req: Request, prefilling: set) -> bool:
        """Whether ``req``'s first uncached tokens are being computed by a running request:
        then it waits and reuses them from the cache instead of computing them twice."""
        if req.num_preemptions or self.kv.cache is None:
            return False
        if req.probe_stamp:  # a prefix-aware policy keeps this estimate fresh
            hit_len = req.probe_len
        else:
            tokens = req.token_ids[: req.num_tokens - 1]
            hit_len = self.kv.cache.match_prefix(
                tokens, req.cache_namespace, touch=False
            ).num_tokens
        key = self._prefix_key(req, hit_len)
        return key is not None and key in prefilling

    # -- preemption -----------------------------------------------------------------------
    def _victim(self, candidates: list[Request]) -> Request:
        """Lowest priority first, then least progress, then the most recently admitted."""
        return max(
            candidates,
            key=lambda r: (
                r.priority if self.config.policy == "priority" else 0,
                -r.num_output_tokens,
                r.admit_seq,
            ),
        )

    def _grow_or_preempt(self, index: int, num_tokens: int, failed: list[Request]) -> bool:
        """Make the pages of ``running[index]`` cover ``num_tokens``, preempting requests not
        yet scheduled this step (those after it) by policy, and finally itself."""
        req = self.running[index]
        while not self.kv.grow(req, num_tokens):
            later = self.running[index + 1 :]
            if later:
                self._preempt(self._victim(later))
                continue
            need = self.kv.pool.pages_for(num_tokens)
            if len(self.running) == 1 and need > self.kv.pool.num_pages:
                self.running.pop()
                self._fail(
                    req,
                    f"the request needs {need} KV pages, "
                    f"more than the {self.kv.pool.num_pages} the cache holds",
                    failed,
                )
            else:  # (alone, it waits for pages others hold: a step in flight, a tree lock)
                self._preempt(req)
            return False
        return True

    def _lower_priority_victim(self, req: Request) -> Request | None:
        """Policy ``priority``: the running request to preempt to make room for ``req`` (one
        of strictly lower priority, i.e. a higher value), or None."""
        if not self.config.priority_preemption:
            return None
        lower = [r for r in self.running if r.priority > req.priority]
        return self._victim(lower) if lower else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        settled = self._settled_counts(req)
        if settled is not None:  # KV still being computed does not go into the tree
            req.num_computed_tokens = settled[0]
        self.kv.release(req)  # its computed KV goes into the tree: it resumes with a hit
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.num_preemptions += 1
        req.transition(RequestState.PREEMPTED)
        self.waiting.push(req, front=True)
        self.stats.num_preemptions += 1

    # -- timeouts -------------------------------------------------------------------------
    def _expire(self, failed: list[Request]) -> None:
        now = self.clock()
        while self._timeouts and self._timeouts[0][0] <= now:
            _, _, req = heapq.heappop(self._timeouts)
            if req.is_finished or self._requests.get(req.request_id) is not req:
                continue
            if req.deadline is not None and req.deadline <= now:
                message = "the request's deadline passed before it finished"
            elif req in self.waiting and req.state is RequestState.NEW:
                message = (
                    f"the request waited longer than max_queue_time "
                    f"({self.config.max_queue_time_s} s) without starting"
                )
            else:
                continue  # queue-time limit, but it is running already
            self._remove_anywhere(req)
            self.stats.num_timed_out += 1
            self._fail(req, message, failed)

    def _fail(self, req: Request, message: str, failed: list[Request]) -> None:
        self._end(req, FinishReason.ERROR, message)
        self.stats.num_failed += 1
        failed.append(req)

    # -- launching and processing steps ----------------------------------------------------
    def begin_step(self, batch: ScheduledBatch, placeholders: np.ndarray) -> None:
        """``batch`` is launched: advance each request past its chunk and append
        ``placeholders[i]`` for sampled requests, so the next step can be scheduled before this
        one's tokens are known (``end_step`` writes the real tokens)."""
        self._num_launched += 1
        batch.step_id = step_id = self._num_launched
        real = batch.num_new_tokens
        if batch.num_spec is not None:  # proposals are not counted until verified
            real = real - batch.num_spec
        for req, n, do_sample, token in zip(
            batch.requests,
            real.tolist(),
            batch.sample.tolist(),
            placeholders.tolist(),
            strict=True,
        ):
            req.num_computed_tokens += n
            req.last_step = step_id
            if do_sample:
                req.append_token(token)
        self._unprocessed.append(batch)

    def end_step(
        self,
        batch: ScheduledBatch,
        sampled: np.ndarray,
        spec_tokens: Mapping[int, np.ndarray] | None = None,
    ) -> list[tuple[Request, int]]:
        """Apply the results of the oldest launched step: ``sampled[i]`` replaces the
        placeholder of each sampled request still unfinished; finished prefill chunks become
        reusable. Returns (request, index of its new token) for those that received one.

        ``spec_tokens[i]``: every token row i emitted after verifying its proposals (the
        first is ``sampled[i]``); they are written after its last token and one entry per
        token is returned, in order, but the request's counts stay at its first new token
        (``reveal`` moves them, token by token, so a stop ends it exactly there); pages held
        for rejected proposals are released now."""
        assert self._unprocessed and self._unprocessed[0] is batch, "steps end in launch order"
        self._unprocessed.popleft()
        received: list[tuple[Request, int]] = []
        real = batch.num_new_tokens
        if batch.num_spec is not None:
            real = real - batch.num_spec
        for row, (req, start, n, do_sample, token) in enumerate(
            zip(
                batch.requests,
                batch.starts.tolist(),
                real.tolist(),
                batch.sample.tolist(),
                sampled.tolist(),
                strict=True,
            )
        ):
            if req.is_finished:  # ended meanwhile: whatever it computed is discarded
                self.stats.num_discarded_tokens += do_sample
                continue
            if n > 1 and req.table_row >= 0:  # a prefill chunk: its full pages are reusable
                self.kv.cache_full_pages(req, start + n)
            if not do_sample:
                continue
            if req.state is RequestState.PREFILL:
                req.transition(RequestState.DECODE)
            if req.request_id in self._held:
                self._release_held(req)
            emitted = None if spec_tokens is None else spec_tokens.get(row)
            if emitted is None:
                req.token_ids[start + n] = token
                received.append((req, start + n))
                continue
            m = int(emitted.size)
            req.token_ids[start + n : start + n + m] = emitted
            # KV is valid for the last token and the m - 1 accepted proposals only
            self.kv.shrink(req, start + n + m - 1)
            received.extend((req, start + n + j) for j in range(m))
        return received

    @staticmethod
    def reveal(req: Request, index: int) -> None:
        """Speculative tokens are applied one at a time: ``token_ids[index]`` (already
        written by ``end_step``) becomes the request's last token, the KV before it
        computed. A request that stops there ends exactly as without speculation."""
        req.num_tokens = index + 1
        req.num_computed_tokens = index

    def fail_step(self, batch: ScheduledBatch, message: str) -> list[Request]:
        """The oldest launched step failed: end its unfinished requests with an error (their
        counts back to before the step). Returns them."""
        assert self._unprocessed and self._unprocessed[0] is batch, "steps end in launch order"
        failed = [r for r in batch.requests if not r.is_finished]
        for req in failed:
            self.finish(req, FinishReason.ERROR, message)
        self._unprocessed.popleft()
        return failed

    def update_after_step(self, batch: ScheduledBatch, sampled: np.ndarray) -> list[Request]:
        """Serial form of ``begin_step`` + ``end_step``: the tokens are known at launch.
        Returns the requests that received a token."""
        self.begin_step(batch, sampled)
        return [req for req, _ in self.end_step(batch, sampled)]

    @property
    def num_unprocessed_steps(self) -> int:
        return len(self._unprocessed)

    def _settled_counts(self, req: Request) -> tuple[int, int] | None:
        """(num_computed_tokens, num_tokens) of ``req`` before the oldest launched,
        unprocessed step that contains it; None when there is none."""
        if not self._unprocessed or req.last_step < self._unprocessed[0].step_id:
            return None
        for batch in self._unprocessed:
            row = batch.row_of(req.request_id)
            if row is not None and batch.requests[row] is req:
                return int(batch.starts[row]), int(batch.totals[row])
        return None

    def _release_held(self, leader: Request) -> None:
        """The leader's prompt KV is ready (or the leader is ending): queue its siblings."""
        siblings = self._held.pop(leader.request_id, None)
        if not siblings:
            return
        if leader.state is RequestState.DECODE:
            for sibling in reversed(siblings):
                self._fork_source[sibling.request_id] = leader
                self.waiting.push(sibling, front=True)
        else:  # the leader ends before its prompt is computed: the next sibling leads
            new_leader, *rest = siblings
            self.waiting.push(new_leader, front=True)
            if rest:
                self._held[new_leader.request_id] = rest

    # -- endings --------------------------------------------------------------------------
    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request that received its last token (a stop condition met) or whose step
        failed; it is running, or preempted since that step was launched."""
        self._remove_anywhere(req)
        self._end(req, reason, error)

    def abort(self, request_id: str) -> Request | None:
        """Abort a request in any state; returns it, or None if unknown or already ended."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._remove_anywhere(req)
        self._end(req, FinishReason.ABORT)
        self.stats.num_aborted += 1
        return req

    def _remove_anywhere(self, req: Request) -> None:
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

    def _end(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        settled = self._settled_counts(req)
        if settled is not None:  # work launched after its end is discarded, never counted
            req.num_computed_tokens, req.num_tokens = settled
        self._release_held(req)
        self._fork_source.pop(req.request_id, None)
        self.kv.release(req)
        req.finish(reason, error)
        self._requests.pop(req.request_id, None)
