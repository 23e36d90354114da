"""The router's prefix tree and routing policies, with no model and no server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.api.router.server import RouterConfig, requester, routing_key, routing_namespace
from radixserve.serving.balancer import (
    BalanceConfig,
    Balancer,
    NoWorkerAvailable,
    token_key,
)
from radixserve.serving.prefix_tree import PrefixTree, _common

_TEXT = st.text(alphabet="abc", max_size=12)


def _brute(stored: list[str], key: str) -> int:
    best = 0
    for s in stored:
        n = 0
        while n < min(len(s), len(key)) and s[n] == key[n]:
            n += 1
        best = max(best, n)
    return best


def _edges_total(tree: PrefixTree) -> int:
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first and child.parent is node
            assert child.stamp <= node.stamp or node is tree.root
            total += len(child.edge)
            stack.append(child)
    return total


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, max_size=20), st.lists(_TEXT, min_size=1, max_size=10))
def test_tree_match_is_the_brute_force_longest_prefix(inserted, queries):
    tree = PrefixTree()
    for s in inserted:
        tree.insert(s)
    assert tree.size == _edges_total(tree)
    for q in queries + inserted:
        assert tree.match(q) == _brute(inserted, q)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=30), st.integers(1, 20), _TEXT)
def test_tree_eviction_keeps_the_bound_and_the_newest(inserted, max_size, query):
    tree = PrefixTree(max_size)
    for i, s in enumerate(inserted):
        tree.insert(s)
        assert tree.size <= max_size
        assert tree.size == _edges_total(tree)
        # the newest string is whole (up to the bound); nothing unknown is ever matched
        assert tree.match(s) == min(len(s), max_size)
        assert tree.match(query) <= _brute(inserted[: i + 1], query)


@given(st.text(max_size=40), st.text(max_size=40))
def test_common_prefix(a, b):
    assert _common(a, b) == _brute([a], b)


def test_tree_evicts_least_recently_inserted_first():
    tree = PrefixTree(max_size=8)
    tree.insert("aaaa")
    tree.insert("bbbb")
    tree.insert("aaaa")  # touched again: "bbbb" is now the oldest
    tree.insert("cccc")
    assert tree.match("aaaa") == 4 and tree.match("cccc") == 4 and tree.match("bbbb") == 0


def test_round_robin_alternates_over_available_workers():
    b = Balancer(3, "round-robin")
    assert [b.choose("x").worker for _ in range(4)] == [0, 1, 2, 0]
    b.set_available(1, False)
    assert [b.choose("x").worker for _ in range(4)] == [2, 0, 2, 0]
    assert all(d.outcome == "round_robin" for d in [b.choose("x")])


def test_least_load_and_release():
    b = Balancer(2, "least-load")
    assert [b.choose("x").worker for _ in range(3)] == [0, 1, 0]
    assert b.load == [2, 1]
    b.release(0)
    b.release(0)
    assert b.choose("x").worker == 0 and b.load == [1, 1]
    b.release(1)
    b.release(1)  # never below zero
    assert b.load == [1, 0]


def test_cache_aware_sticks_to_a_prefix_and_spreads_new_ones():
    b = Balancer(2, "cache-aware")
    a1 = b.choose("A" * 100 + "question 1")
    assert a1.outcome == "cache_miss"
    other = b.choose("B" * 100 + "question 1")
    assert other.outcome == "cache_miss" and other.worker != a1.worker  # the emptier tree
    for q in range(2, 6):
        d = b.choose("A" * 100 + f"question {q}")
        assert (d.worker, d.outcome) == (a1.worker, "cache_hit") and d.matched >= 100
        d = b.choose("B" * 100 + f"question {q}")
        assert (d.worker, d.outcome) == (other.worker, "cache_hit")


def test_cache_aware_matches_within_a_namespace_only():
    """A tenant's prompt is never routed by another tenant's (the replicas would not match
    it either), and the namespace counts for nothing in the matched fraction."""
    b = Balancer(2, "cache-aware")
    alice = b.choose("S" * 100 + "q1", namespace="alice")
    bob = b.choose("S" * 100 + "q1", namespace="bob")
    assert (alice.outcome, bob.outcome) == ("cache_miss", "cache_miss")
    assert bob.worker != alice.worker and bob.matched == 0  # the emptier tree, no match
    again = b.choose("S" * 100 + "q2", namespace="alice")
    assert (again.worker, again.outcome, again.matched) == (alice.worker, "cache_hit", 101)
    # a short prompt of a known namespace matches only its own characters
    short = b.choose("xyz", namespace="alice")
    assert short.outcome == "cache_miss" and short.matched == 0


def test_router_namespaces_follow_the_credentials_and_salt():
    alice = {"authorization": "Bearer sk-alice-0001"}
    bob = {"authorization": "Bearer sk-bob-00002"}
    assert requester(alice) == requester(dict(alice)) != requester(bob)
    assert requester(alice) != requester({**alice, "x-tenant": "t1"})
    assert requester({"x-api-key": "ab"}) != requester({"authorization": "ab"})
    body = {"prompt": "hi"}
    assert routing_namespace("tenant", alice, body) != routing_namespace("tenant", bob, body)
    assert routing_namespace("global", alice, body) == routing_namespace("global", bob, body) == ""
    salted = {**body, "cache_salt": "s\x00"}
    assert routing_namespace("global", alice, salted) == "cache_salt=" + repr("s\x00")
    assert "\x00" not in routing_namespace("tenant", alice, salted)  # the balancer's separator
    # a LoRA adapter (the model) computes pages of its own
    on = routing_namespace("global", alice, {**body, "model": "sql"})
    assert on != routing_namespace("global", alice, {**body, "model": "support"}) and on
    # the user field names a sub-tenant only where the key allows it: routing ignores it
    assert routing_namespace("tenant", alice, {"user": "u1"}) == routing_namespace(
        "tenant", alice, {"user": "u2"}
    )
    with pytest.raises(ValueError):
        RouterConfig(workers=("http://a:1",), prefix_cache_scope="nobody")


def test_cache_aware_balances_when_load_is_unbalanced():
    b = Balancer(2, "cache-aware", BalanceConfig(balance_abs_threshold=4, balance_rel_threshold=2))
    first = b.choose("P" * 50).worker
    for _ in range(4):  # load 5 vs 0: difference 5 > 4 and 5 > 0 * 2
        assert b.choose("P" * 50 + "x").worker == first
    d = b.choose("P" * 50 + "y")
    assert d.outcome == "load_balance" and d.worker != first


def test_unavailable_workers_are_never_chosen_and_lose_their_tree():
    b = Balancer(2, "cache-aware")
    w = b.choose("shared prefix " * 10).worker
    b.set_available(w, False)
    assert b.trees[w].size == 0
    assert b.choose("shared prefix " * 10).worker == 1 - w
    b.set_available(1 - w, False)
    with pytest.raises(NoWorkerAvailable):
        b.choose("anything")
    b.set_available(w, True)
    assert b.choose("x", exclude=frozenset()).worker == w
    with pytest.raises(NoWorkerAvailable):
        b.choose("x", exclude=frozenset({w}))


def test_bad_configurations_are_value_errors():
    with pytest.raises(ValueError):
        Balancer(2, "random")
    with pytest.raises(ValueError):
        Balancer(0)
    with pytest.raises(ValueError):
        BalanceConfig(cache_threshold=1.5)
    with pytest.raises(ValueError):
        BalanceConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        RouterConfig(workers=())
    with pytest.raises(ValueError):
        RouterConfig(workers=("127.0.0.1:8000",))
    with pytest.raises(ValueError):
        RouterConfig(workers=("http://a:1", "http://a:1"))


def test_routing_keys():
    assert routing_key("/v1/completions", {"prompt": "hello"}) == "hello"
    assert routing_key("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert routing_key("/v1/completions", {"prompt": [1, 2, 3]}) == token_key([1, 2, 3])
    assert routing_key("/generate", {"input_ids": [5, 6]}) == token_key([5, 6])
    assert routing_key("/generate", {"text": "hi"}) == "hi"
    chat = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ]
    }
    key = routing_key("/v1/chat/completions", chat)
    assert key == "<system>be brief<user>hi"
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "yo"}]}
    assert routing_key("/v1/chat/completions", longer).startswith(key)  # turns share a prefix
    assert routing_key("/v1/completions", None) == ""
    assert routing_key("/v1/completions", {"prompt": [-1]}) == ""
    # Anthropic's Messages: the system prompt (a string or text blocks) leads, as in chat
    messages = {"system": [{"type": "text", "text": "be brief"}], "messages": chat["messages"][1:]}
    assert routing_key("/v1/messages", messages) == key
    assert routing_key("/v1/messages", {**messages, "system": "be brief"}) == key
    # embeddings: the first input, text or token ids
    assert routing_key("/v1/embeddings", {"input": "hello"}) == "hello"
    assert routing_key("/v1/embeddings", {"input": ["a", "b"]}) == "a"
    assert routing_key("/v1/embeddings", {"input": [[7, 8], [9]]}) == token_key([7, 8])


def test_cli_flags():
    from radixserve.api.router.cli import balance_config
    from radixserve.api.router.server import RouterConfig
    from radixserve.cli import build_parser, server_config
    from radixserve.core.settings import from_args

    args = build_parser().parse_args(["serve", "-dp", "2", "--dp-policy", "round-robin"])
    config = server_config(args)
    assert config.data_parallel_size == 2 and config.dp_policy == "round-robin"
    assert config.dp_balance == BalanceConfig()
    with pytest.raises(ValueError):
        server_config(build_parser().parse_args(["serve", "--data-parallel-size", "0"]))
    r = build_parser().parse_args(
        ["router", "--worker", "http://127.0.0.1:1", "--worker", "http://127.0.0.1:2"]
    )
    routed = RouterConfig(**from_args(r, RouterConfig), balance=balance_config(r))
    assert routed.workers == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert (routed.policy, r.host, r.port) == ("cache-aware", "127.0.0.1", 8080)
    assert routed == RouterConfig(workers=routed.workers)  # the flags' defaults are the fields'
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--worker", "http://a:1", "--policy", "random"])
    with pytest.raises(SystemExit):  # --worker is required
        build_parser().parse_args(["router"])


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"tensor_parallel_size": 2, "master_port": 29500}, "master_port"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "master_port": 29500}, "one node"),
    ],
)
def test_data_parallel_refuses_replicas_that_would_collide(fields, match):
    from radixserve.engine.config import EngineConfig
    from radixserve.serving.dp_client import DataParallelClient

    config = EngineConfig(device="cpu", **fields)  # nothing is loaded before start()
    with pytest.raises(ValueError, match=match):
        DataParallelClient(config, tokenizer=None, size=2)
