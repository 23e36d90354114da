"""Steps launched before the previous one is processed (the overlapped loop), at the level
of the scheduler: placeholders, discarded tokens, and KV shared only once it is computed."""

from __future__ import annotations

import numpy as np

from radixserve.core.request import FinishReason, RequestState
from tests.scheduler.test_scheduler import check_accounting, make, req


def _placeholders(batch, base: int) -> np.ndarray:
    return -(base + np.arange(len(batch.requests), dtype=np.int64)) - 1


def test_next_step_is_scheduled_on_a_placeholder_and_a_stop_discards_one_token():
    s = make(cache=True)
    r = req("a", 10, max_tokens=8)
    s.add_request(r)
    prefill = s.schedule()
    s.begin_step(prefill, _placeholders(prefill, 0))
    assert r.num_computed_tokens == 10 and r.num_tokens == 11 and r.token_ids[10] == -1
    decode = s.schedule()  # scheduled before the prefill's token is known
    assert decode.requests == [r] and decode.num_new_tokens.tolist() == [1]
    assert decode.starts.tolist() == [10] and decode.totals.tolist() == [11]
    s.begin_step(decode, _placeholders(decode, 5))
    assert r.num_tokens == 12 and r.token_ids[11] == -6
    assert s.end_step(prefill, np.array([42])) == [(r, 10)]
    assert r.token_ids[10] == 42 and r.state is RequestState.DECODE
    # token 42 is a stop: the request ends while its next step is in flight
    s.finish(r, FinishReason.STOP)
    assert (r.num_computed_tokens, r.num_tokens) == (10, 11)  # as if that step never ran
    assert r.num_output_tokens == 1
    # only KV of processed steps reached the tree: the prompt, not the stop token's KV
    hit = s.kv.cache.match_prefix(np.array([*range(1, 11), 42, 7], dtype=np.int32), None)
    assert hit.num_tokens == 10
    assert s.end_step(decode, np.array([7])) == []  # the extra token is discarded
    assert s.stats.num_discarded_tokens == 1
    check_accounting(s)
    s.kv.cache.reset()
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_a_failed_step_rolls_its_requests_back_and_shares_nothing_of_it():
    s = make(cache=True)
    r = req("a", 10, max_tokens=8)
    s.add_request(r)
    first = s.schedule()
    s.begin_step(first, _placeholders(first, 0))
    second = s.schedule()
    s.begin_step(second, _placeholders(second, 5))
    assert s.fail_step(first, "boom") == [r]
    assert r.finish_reason is FinishReason.ERROR and r.error == "boom"
    assert (r.num_computed_tokens, r.num_tokens) == (0, 10)
    assert s.kv.cache.match_prefix(np.arange(1, 11, dtype=np.int32), None).num_tokens == 0
    assert s.end_step(second, np.array([3])) == []
    check_accounting(s)
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_abort_and_preemption_with_a_step_in_flight_keep_only_processed_kv():
    s = make(cache=True, num_pages=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    s.begin_step(first, _placeholders(first, 0))
    s.end_step(first, np.array([50, 60]))
    second = s.schedule()
    s.begin_step(second, _placeholders(second, 5))
    assert a.num_computed_tokens == 9 and b.num_computed_tokens == 9
    s.abort("a")  # its decode is in flight: KV of token 50 is not complete yet
    assert (a.num_computed_tokens, a.num_tokens) == (8, 9)
    assert s.kv.cache.match_prefix(np.array([*range(1, 9), 50, 1], np.int32), None).num_tokens == 8
    s._preempt(b)  # as schedule() would under memory pressure
    assert b.state is RequestState.PREEMPTED and b.num_tokens == 10
    assert s.kv.cache.match_prefix(np.array([*range(1, 9), 60, 1], np.int32), None).num_tokens == 8
    # the preempted request still receives the token its in-flight step sampled
    assert s.end_step(second, np.array([-1, 61])) == [(b, 9)]
    assert b.token_ids[9] == 61 and b in s.waiting
    s.finish(b, FinishReason.STOP)  # a stop may end it while it waits
    assert not s.has_unfinished()
    check_accounting(s)
    s.kv.cache.reset()
    assert s.kv.pool.num_free == s.kv.pool.num_pages


def test_a_request_at_max_tokens_gets_no_lookahead_step():
    s = make()
    r = req("a", 4, max_tokens=1)
    s.add_request(r)
    prefill = s.schedule()
    s.begin_step(prefill, _placeholders(prefill, 0))
    assert r.num_output_tokens == 1
    assert s.schedule().is_empty  # it ends when its token is processed: no extra token
