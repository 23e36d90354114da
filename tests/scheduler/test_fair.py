"""Policy ``fair`` (virtual token counters per tenant) on the simulated device: bounded
service gaps, a light tenant's bounded TTFT under a flood, weights, caps, no starvation,
page accounting at the end of every scenario. No model."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from radixserve import SamplingParams
from radixserve.core.request import Request, RequestState, Tenant
from radixserve.executor.simulated import CostModel
from radixserve.scheduler.fair import DEFAULT_OUTPUT_WEIGHT as W_O
from radixserve.scheduler.fair import DEFAULT_PROMPT_WEIGHT as W_P
from radixserve.scheduler.fair import SharedStepCap
from radixserve.scheduler.scheduler import SchedulerConfig
from radixserve.tools.simulator import Simulator, TraceRequest
from tests.scheduler.test_scheduler import apply, check_accounting, make, run

COST = CostModel(step_s=0.01, token_s=1e-4, kv_token_s=1e-7)


def _prompts(rng: np.random.Generator, length: int):
    return rng.integers(0, 32000, length, dtype=np.int32)


def _sim(
    policy: str,
    max_seqs: int,
    budget: int,
    chunk: int,
    pages: int,
    cache=False,
    step_cap: int | None = None,
    step_target_s: float | None = None,
):
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        long_prefill_threshold=chunk,
        policy=policy,
        fair_step_prefill_tokens=step_cap,
        fair_step_target_s=step_target_s,
    )
    return Simulator(config, num_pages=pages, page_size=16, cost=COST, enable_cache=cache)


class ServiceMeter:
    """Service per tenant measured from outside the policy, from the batches: the prompt
    tokens each step computes (past a request's cached prefix, and never twice for the same
    position of a request: recomputing after a preemption is the server's choice) and the
    output tokens as they arrive; each weighted (``W_P``, ``W_O``) and divided by the
    tenant's weight."""

    def __init__(self) -> None:
        self.service: dict[str, float] = defaultdict(float)
        self.computed: dict[str, int] = {}  # request id -> prompt positions counted
        self.max_running: Counter[str] = Counter()

    def step(self, batch, received, scheduler) -> None:
        starts, counts = batch.starts.tolist(), batch.num_new_tokens.tolist()
        for req, start, n in zip(batch.requests, starts, counts, strict=True):
            done = self.computed.get(req.request_id, 0)
            stop = min(start + n, req.num_prompt_tokens)
            if stop > max(start, done):
                self.service[req.tenant.name] += W_P * (stop - max(start, done)) / req.tenant.weight
                self.computed[req.request_id] = stop
        for req in received:
            self.service[req.tenant.name] += W_O / req.tenant.weight
        running = Counter(r.tenant.name for r in scheduler.running)
        for name, n in running.items():
            self.max_running[name] = max(self.max_running[name], n)

    def backlogged(self, scheduler) -> set[str]:
        return {r.tenant.name for r in scheduler.waiting}


def _run_gap(policy: str, weights: tuple[float, float]):
    """Two tenants, both backlogged from t=0: "a" sends long prompts, "b" short ones,
    interleaved. Returns (largest counter gap while both are backlogged, its bound,
    service by tenant when the first of them stopped being backlogged, the simulator)."""
    rng = np.random.default_rng(1)
    a, b = Tenant("a", weights[0]), Tenant("b", weights[1])
    shapes = {"a": (512, 32), "b": (64, 16)}
    trace = []
    for i in range(150):
        for tenant in (a, b):
            prompt_len, out = shapes[tenant.name]
            trace.append(TraceRequest(i * 1e-3, _prompts(rng, prompt_len), out, tenant=tenant))
    max_seqs = 8
    sim = _sim(policy, max_seqs=max_seqs, budget=2048, chunk=256, pages=2048)
    meter = ServiceMeter()
    gaps: list[float] = []
    at_end: dict[str, float] = {}

    def on_step(batch, received):
        meter.step(batch, received, sim.scheduler)
        if sim.clock.now < 0.2:  # every request arrived by then
            return
        if meter.backlogged(sim.scheduler) == {"a", "b"}:
            gaps.append(abs(meter.service["a"] - meter.service["b"]))
        elif not at_end:
            at_end.update(meter.service)

    result = sim.run(trace, on_step=on_step)
    assert result.num_finished == len(trace) and result.num_failed == 0
    sim.check_pages()
    # Bound (see docs/many-users.md): while both are backlogged, a tenant admitted at time s
    # had the least counter then; after s its counter grows by at most what its running
    # requests still had to compute (prompt chunks are charged as they are scheduled):
    # W_P * L_in + W_O * L_out each, at most max_seqs of them; the other's counter never
    # decreases. Divided by the weight.
    bound = max(
        max_seqs * (W_P * shapes[t.name][0] + W_O * shapes[t.name][1]) / t.weight for t in (a, b)
    )
    return max(gaps), bound, at_end, sim


def test_service_gap_between_backlogged_tenants_stays_bounded():
    gap, bound, at_end, sim = _run_gap("fair", (1.0, 1.0))
    stats = sim.scheduler.stats
    # memory never binds: the only preemptions move rows to the tenant served less, and a
    # preempted prompt is not charged again, so the bound's argument holds with them
    assert stats.num_preemptions == stats.num_fair_preemptions
    assert gap <= bound, (gap, bound)
    # the same trace first come first served: service follows request size, unbounded
    fcfs_gap, _, _, _ = _run_gap("fcfs", (1.0, 1.0))
    assert fcfs_gap > 3 * bound, (fcfs_gap, bound)
    assert at_end["a"] > 2 * bound and at_end["b"] > 2 * bound  # (a long test window)


def test_weight_two_tenant_gets_twice_the_service():
    gap, bound, at_end, _ = _run_gap("fair", (2.0, 1.0))
    assert gap <= bound, (gap, bound)
    # at_end holds service / weight: equal up to the bound, so raw service is ~2:1
    raw_a, raw_b = 2.0 * at_end["a"], at_end["b"]
    assert 1.8 <= raw_a / raw_b <= 2.2, raw_a / raw_b


def _flood(
    policy: str,
    cap: int | None = None,
    duration_s: float = 20.0,
    step_cap: int | None = None,
    step_target_s: float | None = None,
):
    """ "heavy" sends 1,024-token prompts far faster than they can be served; "light" one
    64-token prompt every 0.5 s. Returns (simulation result, meter, bound in seconds);
    ``meter.prompt_tokens`` holds the prompt tokens each step computed."""
    rng = np.random.default_rng(2)
    heavy, light = Tenant("heavy", max_running=cap), Tenant("light")
    h_in, h_out, l_in, l_out = 1024, 32, 64, 8
    trace = [
        TraceRequest(t, _prompts(rng, h_in), h_out, tenant=heavy)
        for t in np.arange(0.0, duration_s, 0.05)  # 20 req/s x 1,056 tokens
    ]
    trace += [
        TraceRequest(t, _prompts(rng, l_in), l_out, tenant=light)
        for t in np.arange(0.01, duration_s, 0.5)
    ]
    max_seqs, chunk = 8, 256
    budget = max_seqs * chunk  # every running request gets a full chunk or a token each step
    pages = max_seqs * math.ceil((h_in + h_out) / 16) + 64  # memory never binds: no preemption
    sim = _sim(
        policy, max_seqs, budget, chunk, pages, step_cap=step_cap, step_target_s=step_target_s
    )
    meter = ServiceMeter()
    ends: list[float] = []  # when each step ended
    prompt_tokens: list[int] = []
    step_s: list[float] = []  # each step's modelled time

    light_first: dict[str, tuple[float, float]] = {}  # (arrival, first token) per request

    def on_step(batch, got):
        meter.step(batch, got, sim.scheduler)
        step_s.append(sim.clock.now - (ends[-1] if ends else 0.0))
        ends.append(sim.clock.now)
        prompt_tokens.append(sum(_prompt_tokens(batch).values()))
        for req in got:
            if req.tenant.name == "light" and req.request_id not in light_first:
                light_first[req.request_id] = (req.arrival_time, sim.clock.now)

    result = sim.run(trace, on_step=on_step)
    meter.step_ends = ends
    meter.step_s = step_s
    meter.prompt_tokens = prompt_tokens
    meter.light_first = list(light_first.values())
    meter.fair_preemptions = sim.scheduler.stats.num_fair_preemptions
    meter.shared_cap = sim.scheduler.shared_cap
    assert result.num_finished == len(trace) and result.num_failed == 0  # nothing starves
    stats = sim.scheduler.stats
    # memory never binds: the only preemptions (fair) give a row to the tenant served less
    assert stats.num_preemptions == stats.num_fair_preemptions
    sim.check_pages()
    # Bound: every running request is served a full chunk (or its decode token) each step,
    # so a heavy request ends P = ceil(h_in / chunk) + h_out steps after its admission, and
    # a row frees at least every P steps. An arriving light request is lifted to heavy's
    # counter: at most one heavy admission (a tie) goes before it, so it is admitted within
    # 2P steps, and samples its first token ceil(l_in / chunk) steps later; +1 for arriving
    # mid-step. Time: each of those steps costs step_s plus at most all rows' KV; the tokens
    # computed meanwhile are at most those of the max_seqs heavy requests running, the two
    # admitted after them and the light prompt (the cost model is linear in tokens).
    steps = 2 * (math.ceil(h_in / chunk) + h_out) + math.ceil(l_in / chunk) + 1
    per_step = COST.step_s + COST.kv_token_s * max_seqs * (h_in + h_out)
    tokens = (max_seqs + 2) * (h_in + h_out) + l_in
    return result, meter, steps * per_step + COST.token_s * tokens


def test_light_tenant_ttft_stays_bounded_under_a_flood():
    result, meter, bound = _flood("fair")
    light = result.ttft_by_tenant["light"]
    assert max(light) <= bound, (max(light), bound)
    assert meter.service["heavy"] > 10 * meter.service["light"]  # heavy is served too
    # first come first served: the light tenant queues behind the whole backlog
    fcfs, _, _ = _flood("fcfs")
    assert max(fcfs.ttft_by_tenant["light"]) > 5 * bound


def test_light_tenant_first_token_within_a_few_steps_of_arrival():
    """Counted in steps, not seconds: a light request arriving during a step is admitted in
    the next one (a heavy request is preempted if every row is taken) and, its 64-token
    prompt fitting in one chunk, has its first token at that step's end."""
    _, meter, _ = _flood("fair")
    assert meter.fair_preemptions > 0  # rows were full: the light tenant took them back
    waits = _steps_to_first_token(meter)
    # the step running when it arrives + its own; one more when it arrives while another
    # light request is being admitted and the heavy tenant is served less at that moment
    assert max(waits) <= 3, sorted(waits)[-5:]
    _, fcfs_meter, _ = _flood("fcfs")
    assert max(_steps_to_first_token(fcfs_meter)) > 30


def test_while_tenants_share_the_engine_a_step_computes_at_most_the_cap():
    """With ``fair_step_prefill_tokens``, every step scheduled while the light tenant is
    active computes at most that many prompt tokens, so the step a light request arrives
    in is short: its TTFT is at most that step and its own (3 steps allowed, as above),
    well under the TTFT without the cap. The heavy tenant pays in throughput, boundedly."""
    cap = 128
    result, meter, _ = _flood("fair", step_cap=cap)
    ends, tokens = np.asarray(meter.step_ends), np.asarray(meter.prompt_tokens)
    first_arrival = min(a for a, _ in meter.light_first)
    seen = min(f for _, f in meter.light_first)
    last = max(f for _, f in meter.light_first)
    shared = tokens[(ends > seen) & (ends <= last)]  # steps scheduled once light was seen
    assert shared.size > 100 and shared.max() <= cap, shared.max()
    assert tokens.max() > 4 * cap  # alone (before light came, after it left): full budget
    # a capped step: its prompt tokens, a decode token per other row, and their KV
    max_seqs, h_in, h_out = 8, 1024, 32
    step = (
        COST.step_s + COST.token_s * (cap + max_seqs) + COST.kv_token_s * max_seqs * (h_in + h_out)
    )
    later = [f - a for a, f in meter.light_first if a > seen]
    assert max(later) <= 3 * step, (max(later), step)
    assert max(_steps_to_first_token(meter)) <= 3
    without, meter_without, _ = _flood("fair")
    light, light_without = result.ttft_by_tenant["light"], without.ttft_by_tenant["light"]
    assert max(light) < 0.5 * max(light_without), (max(light), max(light_without))
    assert first_arrival < seen
    # the heavy tenant's cost: the same work done in at most 10 % more time
    assert meter.step_ends[-1] <= 1.10 * meter_without.step_ends[-1]
    assert meter.service["heavy"] == meter_without.service["heavy"]


def test_the_shared_step_cap_follows_a_target_time():
    """With ``fair_step_target_s``, the cap while tenants share is steered by the steps'
    device times: the modelled 128-token step (about 24 ms) is over a 20 ms target, so the
    cap comes down until the shared steps take about the target (still room for the light
    tenant's 64-token prompts), and its first tokens come sooner than under the token cap
    alone."""
    cap, target = 128, 0.02
    result, meter, _ = _flood("fair", step_cap=cap, step_target_s=target)
    steered = meter.shared_cap
    assert steered is not None and 64 <= steered.tokens < cap, steered.tokens
    ends, tokens = np.asarray(meter.step_ends), np.asarray(meter.prompt_tokens)
    seen = min(f for _, f in meter.light_first)
    last = max(f for _, f in meter.light_first)
    shared = (ends > seen + 1.0) & (ends <= last)  # past the first second of steering
    times = np.asarray(meter.step_s)[shared & (tokens > 0)]
    assert times.size > 100
    # the shared steps sit at the target: at most a few over it by more than a tenth, and
    # most of them above the point from which the cap grows again
    assert np.mean(times > 1.1 * target) < 0.05, np.sort(times)[-10:]
    assert np.median(times) > 0.7 * target, np.median(times)
    fixed, _, _ = _flood("fair", step_cap=cap)
    light, light_fixed = result.ttft_by_tenant["light"], fixed.ttft_by_tenant["light"]
    assert np.percentile(light, 99) < np.percentile(light_fixed, 99)


def test_shared_step_cap_steering():
    """SharedStepCap on a step cost of 25 ms + 0.37 ms per token (one thread's 64-token
    chunk, 48 ms): the cap settles where the steps take the target; a cost that never
    fits leaves it at the floor, one always under the target at the ceiling; steps that
    did not use the cap never raise it; without a target it stays at the ceiling."""

    def settle(cost, target, ceiling=64, steps=300, backlog=10**9):
        cap = SharedStepCap(ceiling, target)
        times = []
        for _ in range(steps):
            n = min(cap.tokens, backlog)
            times.append(cost(n))
            cap.observe(n, cap.tokens, times[-1])
        return cap, times[-100:]

    cap, times = settle(lambda n: 0.025 + 0.00037 * n, 0.035)
    assert 16 < cap.tokens < 40, cap.tokens  # (0.035 - 0.025) / 0.00037 = 27
    assert max(times) <= 0.035 * 1.1 and min(times) >= 0.8 * 0.035 * 0.9, (min(times), max(times))
    cap, _ = settle(lambda n: 0.05 + 0.001 * n, 0.03)
    assert cap.tokens == cap.floor == 16
    cap, _ = settle(lambda n: 0.001 * n, 0.5)
    assert cap.tokens == 64
    # steps that computed fewer tokens than the cap allowed (short of work) never raise it
    cap = SharedStepCap(64, 0.03)
    cap.observe(64, 64, 0.06)
    lowered = cap.tokens
    assert 16 <= lowered < 64
    for _ in range(50):
        cap.observe(4, lowered, 0.005)
    assert cap.tokens == lowered
    # a step built under a larger cap than the current one does not lower it again
    cap = SharedStepCap(64, 0.03)
    cap.observe(64, 64, 0.06)
    assert cap.tokens == 32
    cap.observe(64, 64, 0.06)  # (launched before the cap came down)
    assert cap.tokens == 32
    cap.observe(32, 32, 0.06)
    assert cap.tokens == 16
    # decode steps alone near the target: the target becomes 1.5 of them, and the chunks
    # settle where they add half a decode step (28 ms decode, 0.37 ms a token: 56 tokens
    # would be 48.7 ms, under 1.5 x 28 = 42 ms at most 37 tokens), not at the floor
    cap = SharedStepCap(64, 0.03)
    for _ in range(300):
        cap.observe(0, cap.tokens, 0.028)
        n = cap.tokens
        cap.observe(n, n, 0.028 + 0.00037 * n)
    assert cap.target == pytest.approx(0.042)
    assert 20 < cap.tokens <= 38, cap.tokens
    none = SharedStepCap(64, None)
    none.observe(64, 64, 1.0)
    none.observe(0, 64, 1.0)
    assert none.tokens == 64 and none.target is None
    with pytest.raises(ValueError):
        SharedStepCap(64, 0.0)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="fair", fair_step_target_s=-1.0)


def test_a_steered_cap_shortens_chunks_but_never_splits_a_short_prompt():
    """Steered down to 16 tokens (under its ceiling of 64), the cap limits the heavy
    tenant's chunks to 16, while a light prompt of 40 tokens (within the ceiling) is
    admitted whole; one of 100 is chunked. A step past the cap does not steer it."""
    s, _, light = _heavy_and_light([0.0], 4, fair_step_prefill_tokens=64, fair_step_target_s=0.03)
    apply(s, s.schedule(), [])  # heavy alone: the whole budget
    s.add_request(Request("l0", [5] * 10, SamplingParams(max_tokens=4), tenant=light))
    apply(s, s.schedule(), [])  # tenants share from here
    assert s.shared_cap is not None
    s.shared_cap.tokens = 16  # as if its steps had run long
    batch = s.schedule()
    assert batch.shared_step == (16, sum(_prompt_tokens(batch).values()))
    assert _prompt_tokens(batch)["heavy"] == 16
    s.observe_step(batch, 0.001)  # a full chunk step well under the target: up by one
    assert s.shared_cap.tokens == 17
    apply(s, batch, [])
    s.add_request(Request("l1", [6] * 40, SamplingParams(max_tokens=4), tenant=light))
    batch = s.schedule()
    got = _prompt_tokens(batch)
    # (light was served more than heavy by now: heavy's chunk went first, within the cap)
    assert got["light"] == 40 and got["heavy"] <= 17, got
    s.observe_step(batch, 1.0)  # a whole short prompt past the cap: no steering
    assert s.shared_cap.tokens == 17
    apply(s, batch, [])
    s.add_request(Request("l2", [7] * 100, SamplingParams(max_tokens=4), tenant=light))
    light_tokens = 0
    for _ in range(40):
        batch = s.schedule()
        got = _prompt_tokens(batch)
        assert sum(got.values()) <= 17, got  # a long light prompt is chunked like any
        light_tokens += got["light"]
        apply(s, batch, [])
    assert light_tokens == 100
    run(s)
    check_accounting(s)


def _heavy_and_light(now: list[float], heavy_requests: int, **config):
    """A fair scheduler (budget 256, 8 rows) on the clock ``now[0]``, with tenant "heavy"'s
    ``heavy_requests`` 600-token prompts queued; returns it and the tenants heavy, light."""
    s = make(
        num_pages=2048, page_size=4, budget=256, max_seqs=8, threshold=256, policy="fair", **config
    )
    s.clock = lambda: now[0]
    heavy, light = Tenant("heavy"), Tenant("light")
    for i in range(heavy_requests):
        s.add_request(Request(f"h{i}", [3 + i] * 600, SamplingParams(max_tokens=2), tenant=heavy))
    return s, heavy, light


def test_the_step_cap_is_off_for_a_tenant_alone_and_after_the_others_leave():
    now = [0.0]
    s, _, light = _heavy_and_light(now, 6, fair_step_prefill_tokens=32, fair_active_window_s=5.0)
    batch = s.schedule()
    assert _prompt_tokens(batch)["heavy"] == 256  # alone: the whole budget
    apply(s, batch, [])
    now[0] = 1.0
    s.add_request(Request("l0", [5] * 20, SamplingParams(max_tokens=1), tenant=light))
    batch = s.schedule()
    got = _prompt_tokens(batch)
    assert got["light"] == 20 and got["light"] + got["heavy"] <= 32, got
    ended: list[Request] = []
    apply(s, batch, ended)
    assert [r.request_id for r in ended] == ["l0"]
    for t in (2.0, 4.0, 5.9):  # light is idle, but within the window: still capped
        now[0] = t
        batch = s.schedule()
        assert _prompt_tokens(batch)["heavy"] <= 32
        apply(s, batch, [])
    now[0] = 6.5  # the window since light's last request has passed: the budget is back
    batch = s.schedule()
    assert _prompt_tokens(batch)["heavy"] > 200
    apply(s, batch, [])
    run(s)
    check_accounting(s)


def _prompt_tokens(batch) -> Counter[str]:
    """The prompt tokens a scheduled batch computes, by tenant."""
    out: Counter[str] = Counter()
    for r, start, n in zip(
        batch.requests, batch.starts.tolist(), batch.num_new_tokens.tolist(), strict=True
    ):
        out[r.tenant.name] += max(0, min(start + n, r.num_prompt_tokens) - start)
    return out


def _steps_to_first_token(meter: ServiceMeter) -> list[int]:
    """For each light request, the steps that ended after its arrival, up to the one that
    gave it its first token."""
    ends = np.asarray(meter.step_ends)
    return [int(np.count_nonzero((ends > a) & (ends <= f))) for a, f in meter.light_first]


def test_concurrency_cap_is_honoured_and_leaves_rows_to_others():
    result, meter, bound = _flood("fair", cap=3)
    assert meter.max_running["heavy"] == 3
    assert max(result.ttft_by_tenant["light"]) <= bound


def test_a_returning_tenant_starts_at_the_least_counter_not_zero():
    s = make(num_pages=512, page_size=4, budget=64, max_seqs=2, policy="fair")
    a, b = Tenant("a"), Tenant("b")
    for i in range(4):
        s.add_request(Request(f"a{i}", list(range(10, 40)), SamplingParams(max_tokens=4), tenant=a))
    run(s)
    vtc = s.waiting.vtc
    served = vtc.value("a")
    assert served == 4 * (30 * W_P + 4 * W_O)
    # "a" is idle now; "b" arrives with nothing served: it starts at the floor, not 0
    s.add_request(Request("b0", list(range(10, 40)), SamplingParams(max_tokens=4), tenant=b))
    assert vtc.value("b") == vtc.floor > 0
    # both backlogged: "a" (returning) is lifted to "b"'s counter
    s.add_request(Request("a9", list(range(50, 80)), SamplingParams(max_tokens=4), tenant=a))
    assert vtc.value("a") == served  # already above: never lowered
    run(s)
    assert not s.waiting.by_tenant and not s.running
    check_accounting(s)


def test_admissions_in_one_step_alternate_between_tenants_by_counter():
    s = make(num_pages=1024, page_size=4, budget=1024, max_seqs=16, policy="fair")
    a, b = Tenant("a"), Tenant("b", weight=3.0)
    for i in range(6):  # a's requests all arrive first
        s.add_request(Request(f"a{i}", [1] * 40, SamplingParams(max_tokens=2), tenant=a))
    for i in range(6):
        s.add_request(Request(f"b{i}", [2] * 40, SamplingParams(max_tokens=2), tenant=b))
    batch = s.schedule()
    names = [r.request_id for r in batch.requests]
    # each admission charges 40 / weight: b (weight 3) is admitted three times per a
    assert names[:8] == ["a0", "b0", "b1", "b2", "a1", "b3", "b4", "b5"], names
    apply(s, batch, [])
    run(s)
    check_accounting(s)


def test_cache_aware_inside_a_tenant():
    s = make(num_pages=512, page_size=4, budget=512, cache=True, policy="fair")
    t = Tenant("t")
    base = list(range(100, 164))
    s.add_request(Request("warm", base, SamplingParams(max_tokens=1), tenant=t))
    run(s)
    s.add_request(Request("none", list(range(500, 560)), SamplingParams(max_tokens=1), tenant=t))
    s.add_request(Request("long", [*base[:60], 7, 8], SamplingParams(max_tokens=1), tenant=t))
    batch = s.schedule()
    assert [r.request_id for r in batch.requests] == ["long", "none"]
    assert batch.requests[0].num_cached_tokens == 60
    apply(s, batch, [])
    run(s)
    check_accounting(s)


@pytest.mark.parametrize("overlap", [False, True])
def test_fair_survives_the_randomised_stress(overlap):
    """Aborts, deadlines, preemption, n>1 groups and many tenants: every request ends once
    and the pages add up (the stress of test_stress, with the fair policy)."""
    from tests.scheduler.test_stress import run_stress

    run_stress("fair", overlap, num_requests=1500, tenants=6, num_pages=300)


def test_waiting_request_states_are_consistent_with_tenant_queues():
    s = make(num_pages=64, page_size=4, budget=32, max_seqs=2, policy="fair")
    reqs = [
        Request(f"r{i}", [i + 1] * 20, SamplingParams(max_tokens=3), tenant=Tenant(f"t{i % 3}"))
        for i in range(9)
    ]
    for r in reqs:
        s.add_request(r)
    s.abort("r4")
    ended = run(s)
    assert {r.request_id for r in ended} == {r.request_id for r in reqs} - {"r4"}
    assert all(r.state is RequestState.FINISHED for r in ended)
    assert not s.waiting.by_tenant and not s.waiting
    check_accounting(s)


def test_a_new_light_request_goes_before_running_heavy_prefills():
    s = make(num_pages=1024, page_size=4, budget=64, max_seqs=8, threshold=32, policy="fair")
    heavy, light = Tenant("heavy"), Tenant("light")
    for i in range(2):
        s.add_request(Request(f"h{i}", [3] * 200, SamplingParams(max_tokens=2), tenant=heavy))
    first = s.schedule()
    assert [r.request_id for r in first.requests] == ["h0", "h1"]
    apply(s, first, [])
    s.add_request(Request("l0", [5] * 40, SamplingParams(max_tokens=2), tenant=light))
    batch = s.schedule()
    # fcfs would give the whole budget to the two running prefills
    assert [r.request_id for r in batch.requests] == ["l0", "h0"]
    assert batch.num_new_tokens.tolist() == [32, 32]
    apply(s, batch, [])
    run(s)
    check_accounting(s)


def test_a_trace_file_names_tenants_and_the_summary_reports_each(tmp_path):
    from radixserve.tools.simulator import load_trace

    lines = [
        '{"arrival": 0.0, "prompt_tokens": 600, "output_tokens": 8, "tenant": "heavy", '
        '"max_concurrency": 2}'
    ] * 20 + [
        '{"arrival": 0.1, "prompt_tokens": 20, "output_tokens": 4, "tenant": "light", "weight": 2}'
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines))
    trace = load_trace(path)
    assert trace[-1].tenant == Tenant("light", 2.0) and trace[0].tenant.max_running == 2
    sim = _sim("fair", max_seqs=8, budget=512, chunk=256, pages=1024)
    summary = sim.run(trace).summary()
    sim.check_pages()
    assert summary["finished"] == 21
    assert summary["ttft_p99_s[light]"] < summary["ttft_p99_s[heavy]"]


def test_a_least_served_tenant_takes_a_row_from_the_most_served_one():
    """Every row is the heavy tenant's: a light request preempts one of them (the most
    recently admitted, least progress) instead of waiting for a heavy request to end;
    rows only move from the tenant with more to the one with fewer."""
    s = make(num_pages=1024, page_size=4, budget=400, max_seqs=4, policy="fair")
    heavy, light = Tenant("heavy"), Tenant("light")
    for i in range(6):
        s.add_request(Request(f"h{i}", [3] * 100, SamplingParams(max_tokens=20), tenant=heavy))
    apply(s, s.schedule(), [])
    assert [r.request_id for r in s.running] == ["h0", "h1", "h2", "h3"]
    s.add_request(Request("l0", [5] * 16, SamplingParams(max_tokens=4), tenant=light))
    batch = s.schedule()
    assert "l0" in [r.request_id for r in batch.requests]
    assert s.stats.num_fair_preemptions == 1
    assert s.get("h3").state is RequestState.PREEMPTED  # latest admitted, no output yet
    apply(s, batch, [])
    lights = [s.get("l0")]
    for i in (1, 2):  # served more than heavy now, or even with it in rows: they wait
        lights.append(Request(f"l{i}", [5 + i] * 16, SamplingParams(max_tokens=4), tenant=light))
        s.add_request(lights[-1])
        apply(s, s.schedule(), [])
        running = Counter(r.tenant.name for r in s.running)
        assert running["light"] <= running["heavy"]
    ended = run(s)
    assert len(ended) == 9
    assert s.stats.num_preemptions == s.stats.num_fair_preemptions
    assert all(r.num_preemptions == 0 for r in lights)  # rows never moved back
    check_accounting(s)


@pytest.mark.parametrize("yield_tokens", [0, 24])
def test_heavy_prefill_yields_the_step_that_gives_a_light_tenant_its_first_token(yield_tokens):
    s = make(
        num_pages=1024,
        page_size=4,
        budget=256,
        max_seqs=8,
        threshold=128,
        policy="fair",
        fair_prefill_yield_tokens=yield_tokens,
    )
    heavy, light = Tenant("heavy"), Tenant("light")
    s.add_request(Request("h0", [3] * 600, SamplingParams(max_tokens=2), tenant=heavy))
    s.add_request(Request("h1", [4] * 600, SamplingParams(max_tokens=2), tenant=heavy))
    apply(s, s.schedule(), [])
    s.add_request(Request("l0", [5] * 40, SamplingParams(max_tokens=2), tenant=light))
    batch = s.schedule()
    ids = [r.request_id for r in batch.requests]
    tokens = dict(zip(ids, batch.num_new_tokens.tolist(), strict=True))
    # l0's whole prompt is in this step: the heavy chunks (128 each otherwise) yield
    assert tokens["l0"] == 40
    assert sum(n for rid, n in tokens.items() if rid != "l0") == yield_tokens
    apply(s, batch, [])
    batch = s.schedule()  # the next step: the heavy prefill takes the budget again
    rows = zip(batch.requests, batch.num_new_tokens.tolist(), strict=True)
    assert sum(n for r, n in rows if r.tenant is heavy) == 256 - 1  # l0 decodes
    apply(s, batch, [])
    run(s)
    check_accounting(s)


def test_a_prompt_is_charged_chunk_by_chunk_and_once():
    """Prompt tokens are charged as their chunks are scheduled (so a long prompt half done
    does not count as served), and a preempted request recomputing them is not charged
    again."""
    s = make(num_pages=256, page_size=4, budget=32, max_seqs=4, threshold=32, policy="fair")
    t = Tenant("t")
    r = Request("r", list(range(1, 101)), SamplingParams(max_tokens=3), tenant=t)
    s.add_request(r)
    vtc = s.waiting.vtc
    apply(s, s.schedule(), [])
    assert vtc.value("t") == 32 * W_P
    apply(s, s.schedule(), [])
    assert vtc.value("t") == 64 * W_P
    s._preempt(r)  # (what memory pressure does) its KV is dropped: no radix cache here
    apply(s, s.schedule(), [])
    assert r.num_computed_tokens == 32 and vtc.value("t") == 64 * W_P  # recomputed, free
    run(s)
    assert vtc.value("t") == 100 * W_P + 3 * W_O
    check_accounting(s)
