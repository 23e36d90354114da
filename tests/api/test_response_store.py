"""The Responses API's store with no server: bounded, least recently used out, and each
response visible to the tenant that made it (and the admin) only."""

from __future__ import annotations

import pytest

from radixserve.api.openai.response_store import ANY_TENANT, ResponseStore, StoredResponse


def _item(owner: str, n: int = 0) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"role": "user", "content": "hi"}], owner)


def test_another_tenant_finds_nothing_and_changes_nothing():
    store = ResponseStore(4)
    store.put("resp_a", _item("alice"))
    # bob: as for an id never stored; alice's entry is untouched by his delete
    assert store.get("resp_a", "bob") is None and store.get("resp_x", "bob") is None
    assert store.delete("resp_a", "bob") is False and store.delete("resp_x", "bob") is False
    assert store.get("resp_a", "alice/u1") is None  # a sub-tenant is a tenant of its own
    assert store.get("resp_a", "alice").owner == "alice"
    assert store.get("resp_a", ANY_TENANT) is not None  # the admin reads any
    assert store.delete("resp_a", ANY_TENANT) and store.get("resp_a", "alice") is None
    store.put("resp_b", _item("alice"))
    assert store.delete("resp_b", "alice") and len(store) == 0


def test_bounded_least_recently_used_first_out():
    store = ResponseStore(2)
    store.put("r1", _item("t"))
    store.put("r2", _item("t"))
    assert store.get("r1", "t") is not None  # r1 is now the most recent
    store.put("r3", _item("t"))
    assert store.get("r2", "t") is None and store.get("r1", "t") and store.get("r3", "t")
    # (r3 is now the most recent) another tenant's look-up does not refresh r1
    assert store.get("r1", "other") is None
    store.put("r4", _item("t"))
    assert store.get("r1", "t") is None and store.get("r3", "t") is not None
    with pytest.raises(ValueError):
        ResponseStore(0)


def test_a_tenant_storing_many_evicts_its_own_not_the_others():
    store = ResponseStore(6)
    for i in range(2):
        store.put(f"a{i}", _item("alice"))
    for i in range(50):  # bob floods the store
        store.put(f"b{i}", _item("bob"))
    assert store.get("a0", "alice") and store.get("a1", "alice")  # alice keeps hers
    assert len(store) == 6 and sum(store.get(f"b{i}", "bob") is not None for i in range(50)) == 4
    assert store.get("b49", "bob") and store.get("b45", "bob") is None  # bob's newest stay
    # once alice holds the most, hers go first
    for i in range(2, 8):
        store.put(f"a{i}", _item("alice"))
    assert len(store) == 6 and store.get("a0", "alice") is None
    assert store.delete("a7", "alice") and store.delete("b49", ANY_TENANT) and len(store) == 4
