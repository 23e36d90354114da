import itertools

import pytest

from radixserve import SamplingParams
from radixserve.core.request import (
    _ALLOWED,
    TERMINAL_STATES,
    FinishReason,
    InvalidTransition,
    Request,
    RequestState,
)

EXPECTED_EDGES = {
    (RequestState.NEW, RequestState.WAITING_FOR_GRAMMAR),
    (RequestState.WAITING_FOR_GRAMMAR, RequestState.NEW),
    (RequestState.WAITING_FOR_GRAMMAR, RequestState.FINISHED),
    (RequestState.WAITING_FOR_GRAMMAR, RequestState.ABORTED),
    (RequestState.NEW, RequestState.PREFILL),
    (RequestState.NEW, RequestState.FINISHED),
    (RequestState.NEW, RequestState.ABORTED),
    (RequestState.PREFILL, RequestState.DECODE),
    (RequestState.PREFILL, RequestState.PREEMPTED),
    (RequestState.PREFILL, RequestState.FINISHED),
    (RequestState.PREFILL, RequestState.ABORTED),
    (RequestState.DECODE, RequestState.PREEMPTED),
    (RequestState.DECODE, RequestState.FINISHED),
    (RequestState.DECODE, RequestState.ABORTED),
    (RequestState.PREEMPTED, RequestState.PREFILL),
    (RequestState.PREEMPTED, RequestState.FINISHED),
    (RequestState.PREEMPTED, RequestState.ABORTED),
}


def _request_in(state: RequestState) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    path = {
        RequestState.NEW: [],
        RequestState.WAITING_FOR_GRAMMAR: [RequestState.WAITING_FOR_GRAMMAR],
        RequestState.PREFILL: [RequestState.PREFILL],
        RequestState.DECODE: [RequestState.PREFILL, RequestState.DECODE],
        RequestState.PREEMPTED: [RequestState.PREFILL, RequestState.PREEMPTED],
        RequestState.FINISHED: [RequestState.FINISHED],
        RequestState.ABORTED: [RequestState.ABORTED],
    }[state]
    for s in path:
        req.transition(s)
    return req


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(RequestState, RequestState)))
def test_every_transition_allowed_or_refused(src, dst):
    req = _request_in(src)
    if (src, dst) in EXPECTED_EDGES:
        req.transition(dst)
        assert req.state is dst
    else:
        with pytest.raises(InvalidTransition):
            req.transition(dst)
        assert req.state is src
    assert {(a, b) for a, bs in _ALLOWED.items() for b in bs} == EXPECTED_EDGES


def test_terminal_state_reached_once():
    req = _request_in(RequestState.DECODE)
    req.finish(FinishReason.LENGTH)
    assert req.state in TERMINAL_STATES and req.finish_reason is FinishReason.LENGTH
    with pytest.raises(InvalidTransition):
        req.finish(FinishReason.ABORT)


def test_tokens_append_up_to_max_tokens():
    req = Request("r", [5, 6], SamplingParams(max_tokens=2))
    req.append_token(7)
    req.append_token(8)
    assert req.output_token_ids.tolist() == [7, 8]
    assert req.all_token_ids.tolist() == [5, 6, 7, 8]
    with pytest.raises(RuntimeError):
        req.append_token(9)


def test_empty_prompt_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        Request("r", [], SamplingParams())


def test_cache_namespace_keeps_tenants_apart_whatever_salt_they_send():
    from radixserve.core.request import DEFAULT_TENANT, Tenant, cache_namespace

    alice, bob = Tenant("alice"), Tenant("bob", weight=2)
    ns = {
        (t.name if t else None, salt, scope): cache_namespace(salt, t, scope)
        for t in (None, DEFAULT_TENANT, alice, bob, Tenant("alice/u1"))
        for salt in (None, "s", repr(("tenant", "alice", None)))
        for scope in ("tenant", "global")
    }
    tenant_scoped = {k: v for k, v in ns.items() if k[2] == "tenant"}
    # under scope tenant, distinct (tenant, salt) pairs are distinct namespaces, except that
    # no tenant and tenant default are one (a server without tenants is unchanged)
    assert len(set(tenant_scoped.values())) == 4 * 3
    assert cache_namespace("s", None, "tenant") == cache_namespace("s", DEFAULT_TENANT, "tenant")
    assert cache_namespace("s", DEFAULT_TENANT, "tenant") == "s"  # as before tenants
    # a named tenant's namespace is no string: no salt a client sends can reach it
    assert cache_namespace(None, alice, "tenant") == ("tenant", "alice", None)
    assert not any(isinstance(cache_namespace(s, alice, "tenant"), str) for s in ("s", None))
    # global: the salt alone
    assert {cache_namespace("s", t, "global") for t in (None, alice, bob)} == {"s"}
    with pytest.raises(ValueError, match="scope"):
        cache_namespace(None, alice, "everyone")
