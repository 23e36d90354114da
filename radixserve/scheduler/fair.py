"""Policy ``fair``: a virtual token counter per tenant, after "Fairness in Serving Large
Language Models" (Sheng et al., OSDI '24, VTC).

Each tenant's counter grows by the weighted tokens it is served, divided by its weight:
``prompt_weight`` per prompt token it makes the engine compute (charged chunk by chunk as
the chunks are scheduled, so a long prompt half done counts half; a prefix found in the
radix cache is not computed, so not charged; a preempted request recomputing its prompt
is not charged twice) and ``output_weight`` per output token (charged when the step that
samples it is scheduled). Admission takes the backlogged tenant (one with waiting
requests) with the least counter; inside a tenant the request with the longest cached
prefix among its oldest ``window`` waiting ones (arrival order without the radix cache).
Within a step, decodes come first, then prefill chunks of running requests in
tenant-counter order, with the admissions placed after the chunks of tenants served less
than the tenant to admit (and its own): a light tenant's new request, or its prompt half
done, does not wait behind a heavy tenant's long prefills. In a step that completes the
prompt of a request of a tenant ranked first, the tenants ranked after it add at most
``fair_prefill_yield_tokens`` of prefill (the scheduler applies it). When every batch row
is taken, the request offered for admission may preempt a running request of the tenant
served most (``victim_for``), as long as rows then still go to the tenant with fewer of
them per unit of weight (memory is not taken this way: under memory pressure it made
preemptions constant between many tenants, so a request waits for pages as before). A
tenant that becomes backlogged again after idling has its counter lifted to the least
counter among the backlogged tenants (to the last admitted one's if none), never left
behind: idling earns no credit. A tenant at its ``max_running`` cap is passed over until
one of its requests ends.

Cost per admission: O(backlogged tenants + window), and O(running) when it looks for a
request to preempt; per step O(running) to count each tenant's running requests,
O(p log p) to order the p prefill chunks. Nothing of this runs under the other policies.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Callable, Iterator

from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request, RequestState, Tenant
from radixserve.scheduler.policy import WaitingQueue

DEFAULT_PROMPT_WEIGHT = 1.0
DEFAULT_OUTPUT_WEIGHT = 2.0
_WINDOW = 8  # requests of one tenant looked at for the longest cached prefix


class VirtualTokenCounter:
    """The service each tenant has received, in weighted tokens divided by its weight.

    Invariants: a counter never decreases; ``floor`` is the counter of the latest tenant
    admitted, and the least counter of the backlogged tenants never drops below the floor
    at the time they became backlogged; tenants not backlogged whose counter is at or under
    the floor may be forgotten (lifting would put them back at least there), so the table
    stays bounded by the tenants that matter.
    """

    def __init__(self, prompt_weight: float, output_weight: float) -> None:
        if prompt_weight < 0 or output_weight < 0 or prompt_weight + output_weight <= 0:
            raise ValueError("fair policy: token weights must be >= 0, not both 0")
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        self.tenants: dict[str, Tenant] = {}  # the latest settings seen for each name
        self.floor = 0.0

    def value(self, name: str) -> float:
        return self.counters.get(name, self.floor)

    def charge(self, tenant: Tenant, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[tenant.name] = self.value(tenant.name) + cost / tenant.weight

    def lift(self, name: str, least_backlogged: float | None) -> None:
        """``name`` has just become backlogged: it starts no lower than the others."""
        base = self.floor if least_backlogged is None else least_backlogged
        self.counters[name] = max(self.value(name), base)

    def forget_idle(self, keep: set[str]) -> None:
        """Drop counters at or under the floor of tenants not in ``keep``."""
        for name in [n for n, c in self.counters.items() if c <= self.floor and n not in keep]:
            del self.counters[name]
            self.tenants.pop(name, None)


class FairQueue(WaitingQueue):
    """The waiting queue, also kept per tenant. Invariants (on top of ``WaitingQueue``'s):
    ``by_tenant[name]`` holds exactly the waiting requests of tenant ``name``, sorted by
    ``queue_key``, and is absent when there are none; a tenant's counter is lifted when its
    list goes from empty to non-empty."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        super().__init__(use_priority=False)
        self.vtc = vtc
        self.by_tenant: dict[str, tuple[list[tuple[int, int]], list[Request]]] = {}

    def push(self, req: Request, front: bool = False) -> None:
        super().push(req, front)
        tenant = req.tenant
        self.vtc.tenants[tenant.name] = tenant
        entry = self.by_tenant.get(tenant.name)
        if entry is None:
            least = min((self.vtc.value(n) for n in self.by_tenant), default=None)
            self.vtc.lift(tenant.name, least)
            entry = self.by_tenant[tenant.name] = ([], [])
        keys, items = entry
        i = bisect.bisect_right(keys, req.queue_key)
        keys.insert(i, req.queue_key)
        items.insert(i, req)

    def remove(self, req: Request) -> None:
        super().remove(req)
        name = req.tenant.name
        keys, items = self.by_tenant[name]
        i = bisect.bisect_left(keys, req.queue_key)
        assert items[i] is req, "tenant queue out of order"
        del keys[i]
        del items[i]
        if not items:
            del self.by_tenant[name]


class SharedStepCap:
    """(fair) The prompt tokens a step may compute while tenants share the engine, steered
    by the time such steps take on the device, as Sarathi-Serve sizes its chunks for a
    time-between-tokens target: a step with prompt tokens that ran longer than the target
    lowers the cap (in proportion, at most halving it), one under ``SLACK`` of the target
    that used the whole cap raises it by a tenth. The step a tenant's next request waits
    for then lasts about the target whatever the machine, the threads and the model (a
    fixed token cap gave 64-token steps of 30 ms on two threads and 48 ms on one). The
    target is ``target_s``, or ``DECODE_SCALE`` times the shared steps without prompt
    tokens (a running mean) where that is longer: a model whose decode steps alone take
    about ``target_s`` still gets chunks that add half a decode step, not the floor's.
    A step built under a larger cap than the current one (the overlapped loop launches
    one ahead) does not lower it again; steps past the cap (a short prompt admitted whole)
    say nothing.

    Invariant: ``floor <= tokens <= ceiling`` (``floor`` is itself at most ``ceiling``);
    without a target (``target_s`` None) ``tokens`` stays at ``ceiling``."""

    RAISE = 1.1
    SLACK = 0.8  # raise only under this fraction of the target: no hunting at the edge
    DECODE_SCALE = 1.5
    DECODE_WEIGHT = 0.1  # of the newest decode-only step in their running mean

    def __init__(self, ceiling: int, target_s: float | None, floor: int = 16) -> None:
        if ceiling < 1:
            raise ValueError("the shared step cap must be >= 1 token")
        if target_s is not None and not target_s > 0:
            raise ValueError("the shared step's target time must be > 0 (None: no target)")
        self.ceiling = ceiling
        self.floor = min(floor, ceiling)
        self.target_s = target_s
        self.tokens = ceiling
        self.decode_s: float | None = None  # running mean of shared decode-only steps

    @property
    def target(self) -> float | None:
        """The step time steered to (seconds), None without a target."""
        if self.target_s is None or self.decode_s is None:
            return self.target_s
        return max(self.target_s, self.DECODE_SCALE * self.decode_s)

    def observe(self, prefill_tokens: int, cap: int, seconds: float) -> None:
        """A step built under cap ``cap`` computed ``prefill_tokens`` prompt tokens in
        ``seconds`` of device time."""
        if self.target_s is None or seconds <= 0:
            return
        if prefill_tokens <= 0:
            w = self.DECODE_WEIGHT
            self.decode_s = (
                seconds if self.decode_s is None else (1 - w) * self.decode_s + w * seconds
            )
            return
        if prefill_tokens > cap:  # a short prompt admitted whole (PrefillShares): not a chunk
            return
        target = self.target
        assert target is not None
        if seconds > target:
            if cap > self.tokens:  # built before the cap came down: it has reacted already
                return
            shrunk = int(self.tokens * max(0.5, target / seconds))
            self.tokens = max(self.floor, min(self.tokens - 1, shrunk))
        elif seconds < self.SLACK * target and prefill_tokens >= min(cap, self.tokens):
            grown = max(self.tokens + 1, int(self.tokens * self.RAISE))
            self.tokens = min(self.ceiling, grown)


class PrefillShares:
    """(fair) The prefill tokens tenants may still add to the step being built: a tenant
    named in ``limits`` has its own allowance (the yield to a tenant served less), and when
    ``pool`` is not None every tenant also draws from that one allowance (the step's cap
    while tenants share the engine). An admission whose whole prompt fits in what
    ``ceiling`` (the cap before steering: ``SharedStepCap.ceiling``) leaves may take it
    all past the pool: steering shortens the chunks of long prompts, it never splits a
    short prompt. ``room`` is None for no limit.

    Invariant: an allowance never goes below zero; ``take`` is only ever given at most
    ``room`` tokens."""

    def __init__(self, pool: int | None = None, ceiling: int | None = None) -> None:
        self.limits: dict[str, int] = {}
        self.pool = pool
        self.ceiling_left = pool if ceiling is None or pool is None else max(pool, ceiling)

    def room(self, name: str, whole: int | None = None) -> int | None:
        """``whole``: the prompt tokens an admission has left to compute."""
        own = self.limits.get(name)
        if self.pool is None:
            return own
        pool = self.pool
        if whole is not None and self.ceiling_left is not None and whole <= self.ceiling_left:
            pool = max(pool, whole)
        return pool if own is None else min(own, pool)

    def take(self, name: str, n: int) -> None:
        if name in self.limits:
            self.limits[name] -= n
        if self.pool is not None:
            self.pool = max(0, self.pool - n)
            assert self.ceiling_left is not None
            self.ceiling_left = max(0, self.ceiling_left - n)

    def cap(self, name: str, cut: int) -> None:
        """At most ``cut`` more tokens for ``name`` (never raises an allowance)."""
        self.limits[name] = min(self.limits.get(name, cut), cut)


class FairPolicy:
    """Admission order of policy ``fair`` (see the module docstring). ``order`` is lazy: it
    picks the next tenant only when the scheduler asks for the next request, after the
    scheduler charged the previous admission's first chunk (``charge_prompt``), so
    admissions within one step take turns between tenants as the counters move.

    Invariant: a request's ``prompt_charged`` only grows, and its tenant has been charged
    exactly for the prompt positions from its first chunk's start up to it."""

    name = "fair"

    def __init__(
        self,
        queue: FairQueue,
        running: Callable[[], list[Request]],
        cache: RadixCache | None,
        window: int = _WINDOW,
    ) -> None:
        self.queue = queue
        self.vtc = queue.vtc
        self._running = running
        self.cache = cache
        self.window = window
        self._stamp = itertools.count(1)
        self._passed: set[str] = set()  # tenants passed over in the current ``order``
        self._last_active: dict[str, float] = {}  # tenant -> last step it had requests

    def shared(self, now: float, window: float) -> bool:
        """Note the tenants with requests waiting or running as active at ``now``; True
        when more than one tenant has been active within the last ``window`` seconds. A
        tenant between two requests still counts for ``window`` seconds: a step scheduled
        while it is idle is the one its next request will wait for."""
        last = self._last_active
        for name in self.queue.by_tenant:
            last[name] = now
        for req in self._running():
            last[req.tenant.name] = now
        if len(last) > 1:
            since = now - window
            for name in [n for n, t in last.items() if t < since]:
                del last[name]
        return len(last) > 1

    def order(self, waiting: WaitingQueue) -> Iterator[Request]:
        assert waiting is self.queue
        running = Counter(r.tenant.name for r in self._running())
        stamp = next(self._stamp)
        tried: set[str] = set()  # offered this step and still waiting (deferred)
        done = self._passed = set()  # tenants with nothing more to offer this step
        while True:
            name = self._least_tenant(running, done)
            if name is None:
                return
            req = self._pick(name, tried, stamp)
            if req is None:
                done.add(name)
                continue
            yield req
            if req.state is RequestState.PREFILL:  # admitted (its first chunk charged)
                # (recounted: the admission may have preempted another tenant's request)
                running = Counter(r.tenant.name for r in self._running())
                self.vtc.floor = max(self.vtc.floor, self.vtc.value(name))
            elif not req.is_finished:
                tried.add(req.request_id)
        # (unreachable: the loop returns)

    def pass_over(self, name: str) -> None:
        """Offer no more of tenant ``name``'s requests in the current ``order`` (its share
        of the step is used up), so a long backlog is not walked request by request."""
        self._passed.add(name)

    def waiting_tenants(self) -> set[str]:
        return set(self.queue.by_tenant)

    def standing(self, names: set[str]) -> dict[str, tuple[float, int]]:
        """(counter, running requests) of each tenant named: the order in which tenants
        are served (least first), as ``_least_tenant`` ranks them."""
        running = Counter(r.tenant.name for r in self._running())
        return {name: (self.vtc.value(name), running[name]) for name in names}

    def split_held(self, held: list[Request]) -> tuple[list[Request], list[Request]]:
        """Held prefill chunks (all of a step's, in fair mode) in tenant-counter order,
        split into those to schedule before the admissions (tenants served less than the
        next tenant to admit, and that tenant's own) and those after."""
        vtc = self.vtc
        held.sort(key=lambda r: (vtc.value(r.tenant.name), r.admit_seq))
        running = Counter(r.tenant.name for r in self._running())
        least = self._least_tenant(running, set())
        if least is None:
            return held, []
        floor = vtc.value(least)
        first = [r for r in held if r.tenant.name == least or vtc.value(r.tenant.name) < floor]
        if len(first) == len(held):
            return held, []
        ids = {id(r) for r in first}
        return first, [r for r in held if id(r) not in ids]

    def victim_for(self, req: Request, pick: Callable[[list[Request]], Request]) -> Request | None:
        """The running request to preempt so that ``req`` (offered for admission, so of
        the least-served tenant that can take one) gets a batch row: one of the
        running tenant served most (counter at least ``req``'s tenant's; ties: most
        running requests), chosen among that tenant's by ``pick``; None when no tenant
        qualifies. A tenant qualifies only if, after giving up one row to ``req``, it
        still runs at least as many requests per unit of weight as ``req``'s tenant then
        would: rows move from the tenant with more to the one with fewer, never back and
        forth between two tenants that are even."""
        vtc = self.vtc
        mine = req.tenant
        running = Counter(r.tenant.name for r in self._running())
        share = (running[mine.name] + 1) / mine.weight
        floor = vtc.value(mine.name)
        best: tuple[float, int] | None = None
        best_name = None
        for name, n in running.items():
            if name == mine.name:
                continue
            tenant = vtc.tenants.get(name)
            weight = tenant.weight if tenant is not None else 1.0
            value = vtc.value(name)
            if value < floor or (n - 1) / weight < share:
                continue
            if best is None or (value, n) > best:
                best, best_name = (value, n), name
        if best_name is None:
            return None
        return pick([r for r in self._running() if r.tenant.name == best_name])

    def _least_tenant(self, running: Counter, done: set[str]) -> str | None:
        """The backlogged tenant below its cap with the least counter; on a tie the one
        with fewer running requests, then the one waiting longest."""
        best: tuple[float, int, tuple[int, int]] | None = None
        best_name = None
        vtc = self.vtc
        for name, (keys, _) in self.queue.by_tenant.items():
            if name in done:
                continue
            cap = vtc.tenants[name].max_running
            if cap is not None and running[name] >= cap:
                continue
            key = (vtc.value(name), running[name], keys[0])
            if best is None or key < best:
                best, best_name = key, name
        return best_name

    def _pick(self, name: str, tried: set[str], stamp: int) -> Request | None:
        """The tenant's request to offer: the longest cached prefix among its oldest
        ``window`` requests not yet offered this step (the oldest on ties)."""
        _, items = self.queue.by_tenant[name]
        best: Request | None = None
        seen = 0
        for req in items:
            if req.request_id in tried:
                continue
            if self.cache is None:
                return req
            if req.probe_stamp != stamp:
                self._probe(req, stamp)
            if best is None or req.probe_len > best.probe_len:
                best = req
            seen += 1
            if seen == self.window:
                break
        return best

    def _probe(self, req: Request, stamp: int) -> None:
        assert self.cache is not None
        if req.num_tokens < 2:
            req.probe_len, req.probe_node = 0, None
        else:
            hit = self.cache.match_prefix(
                req.token_ids[: req.num_tokens - 1], req.cache_namespace, touch=False
            )
            req.probe_len, req.probe_node = hit.num_tokens, hit.node
        req.probe_stamp = stamp

    def charge_prompt(self, req: Request, end: int) -> None:
        """``req``'s prompt is scheduled up to position ``end``: charge the prompt tokens
        from ``req.num_computed_tokens`` (past its cached prefix) up to ``end`` that were
        never charged before (a preempted request recomputing them is not charged again)."""
        start = max(req.num_computed_tokens, req.prompt_charged)
        stop = min(end, req.num_prompt_tokens)
        if stop > start:
            self.vtc.charge(req.tenant, prompt_tokens=stop - start)
            req.prompt_charged = stop

    def charge_step(self, requests: list[Request], ends: list[int], sample: list[bool]) -> None:
        """A step was scheduled: the prompt chunks not charged yet (``ends``: where each
        row's chunk ends), and each sampled row is one output token of its tenant."""
        for req, end, do_sample in zip(requests, ends, sample, strict=True):
            if end > req.prompt_charged and req.prompt_charged < req.num_prompt_tokens:
                self.charge_prompt(req, end)
            if do_sample:
                self.vtc.charge(req.tenant, output_tokens=1)
        if len(self.vtc.counters) > 4 * len(self.queue.by_tenant) + 256:
            keep = set(self.queue.by_tenant) | {r.tenant.name for r in self._running()}
            self.vtc.forget_idle(keep)
