"""What one tenant can learn of another on live servers (docs/many-users.md): stored
responses are their tenant's (another's read, continue and delete are 404s exactly like an
id that never existed; the admin key reads and deletes any), the prefix cache is scoped by
tenant (``cached_tokens`` is 0 across tenants and high within one; ``global`` shares), and
stored responses stay their tenant's through the router, a dead replica included."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from tests.api.server_helpers import ServerProcess, free_port
from tests.api.test_router import RouterProcess

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

KEYS = """\
alice:sk-alice-0001
bob:sk-bob-00002 subtenants=true
"""
ALICE = {"authorization": "Bearer sk-alice-0001"}
BOB = {"authorization": "Bearer sk-bob-00002"}
ADMIN = {"authorization": "Bearer root-key-01"}
_ARGS = ("--dtype", "float32", "--page-size", "4", "--enable-debug-endpoints")
# a prompt of ~100 tokens: long enough that a prefix hit is plain in cached_tokens
_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10
_NEVER = "resp_00000000000000000000000000000000"


def _args(tiny_llama, keys_file, *extra: str) -> list[str]:
    return [
        "--model", str(tiny_llama), *_ARGS, "--api-keys-file", str(keys_file),
        "--admin-api-key", "root-key-01", *extra,
    ]  # fmt: skip


def _server(tiny_llama, keys_file, *extra: str) -> ServerProcess:
    return ServerProcess(*_args(tiny_llama, keys_file, *extra))


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def workers(tiny_llama, keys_file, grpc_port):
    procs = ServerProcess.start_all(
        _args(tiny_llama, keys_file, "--grpc-port", str(grpc_port)),
        _args(tiny_llama, keys_file),
    )
    yield procs
    for p in procs:
        if p.proc.poll() is None:
            flushed = httpx.post(p.url + "/debug/flush_cache", headers=ADMIN).json()
            assert flushed["idle"] and flushed["pages_leaked"] == 0, flushed
        p.stop()


def _create(url: str, headers: dict, **body) -> dict:
    body = {"input": "Paris is the capital of", "max_output_tokens": 3, "temperature": 0, **body}
    answer = httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _same_as_never_existed(answer: httpx.Response, never: httpx.Response, rid: str) -> None:
    """A 404 whose body is the one an id never stored gets, but for the id itself."""
    assert answer.status_code == never.status_code == 404, answer.text
    assert answer.json() == _replace(never.json(), _NEVER, rid)


def _replace(value, old: str, new: str):
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    if isinstance(value, str):
        return value.replace(old, new)
    return value


def _check_store_isolation(url: str) -> str:
    """Alice stores a response; bob (and bob's sub-tenant) can neither read, continue nor
    delete it; alice and the admin can. Returns the id (deleted by then)."""
    mine = _create(url, ALICE)
    rid = mine["id"]
    for who in (BOB, {**BOB, "x-tenant": "alice"}):
        got = httpx.get(f"{url}/v1/responses/{rid}", headers=who)
        _same_as_never_existed(got, httpx.get(f"{url}/v1/responses/{_NEVER}", headers=who), rid)
        follow = {"input": "And?", "max_output_tokens": 2, "previous_response_id": rid}
        cont = httpx.post(f"{url}/v1/responses", json=follow, headers=who, timeout=60)
        never = httpx.post(
            f"{url}/v1/responses", json={**follow, "previous_response_id": _NEVER}, headers=who
        )
        _same_as_never_existed(cont, never, rid)
        gone = httpx.delete(f"{url}/v1/responses/{rid}", headers=who)
        _same_as_never_existed(gone, httpx.delete(f"{url}/v1/responses/{_NEVER}", headers=who), rid)
    # still there for alice, who continues it; and for the admin, who reads and deletes it
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=ALICE).json() == mine
    nxt = _create(url, ALICE, input="And then?", previous_response_id=rid)
    assert nxt["previous_response_id"] == rid
    assert httpx.get(f"{url}/v1/responses/{nxt['id']}", headers=ADMIN).json() == nxt
    assert httpx.delete(f"{url}/v1/responses/{nxt['id']}", headers=ADMIN).status_code == 200
    assert httpx.get(f"{url}/v1/responses/{nxt['id']}", headers=ALICE).status_code == 404
    assert httpx.delete(f"{url}/v1/responses/{rid}", headers=ALICE).status_code == 200
    # an admin key creates nothing (inference stays the inference keys')
    assert httpx.post(url + "/v1/responses", json={"input": "x"}, headers=ADMIN).status_code == 401
    return rid


def test_stored_responses_belong_to_their_tenant(workers):
    _check_store_isolation(workers[0].url)


def test_sub_tenants_store_apart(workers):
    url = workers[0].url
    team1 = {**BOB, "x-tenant": "team-1"}
    rid = _create(url, team1)["id"]
    assert httpx.get(f"{url}/v1/responses/{rid}", headers=team1).status_code == 200
    for other in (BOB, {**BOB, "x-tenant": "team-2"}, ALICE):
        assert httpx.get(f"{url}/v1/responses/{rid}", headers=other).status_code == 404
    # the sub-tenant named by the body's user field is the same sub-tenant
    cont = _create(url, BOB, input="More", previous_response_id=rid, user="team-1")
    assert cont["previous_response_id"] == rid


def _cached(url: str, headers: dict, prompt: str = _PROMPT, **extra) -> tuple[int, int]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    answer = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def test_cached_tokens_reveal_nothing_across_tenants(workers):
    url = workers[1].url
    prompt = "Alice's secret plan: " + _PROMPT
    assert _cached(url, ALICE, prompt)[0] == 0
    cached, total = _cached(url, BOB, prompt)
    assert cached == 0 and total > 90  # bob learns nothing of alice's prompt
    for sub in ("team-1", "team-2"):  # sub-tenants are tenants of their own
        assert _cached(url, {**BOB, "x-tenant": sub}, prompt)[0] == 0
    assert _cached(url, BOB, prompt, cache_salt="alice")[0] == 0  # no salt reaches alice's
    cached, total = _cached(url, ALICE, prompt)
    assert cached >= total - 4  # within one tenant: all but the last page
    cached, total = _cached(url, {**BOB, "x-tenant": "team-1"}, prompt)
    assert cached >= total - 4


def test_grpc_request_ids_are_per_tenant(workers, grpc_port):
    """Over gRPC a tenant's request_id names its own calls only: another tenant's Abort of
    it finds nothing, and may use the same id at the same time."""
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = pb_grpc.GenerateServiceStub(channel)
        alice = (("authorization", ALICE["authorization"]),)
        bob = (("authorization", BOB["authorization"]),)
        long = pb.GenerateRequest(
            request_id="same",
            token_ids=pb.TokenIds(ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_tokens=400, ignore_eos=True),
        )
        stream = stub.Generate(long, metadata=alice)
        next(stream)  # alice's call is running
        assert not stub.Abort(pb.AbortRequest(request_id="same"), metadata=bob).found
        short = pb.GenerateRequest(
            request_id="same",
            token_ids=pb.TokenIds(ids=[4, 5]),
            sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        assert sum(len(a.token_ids) for a in stub.Generate(short, metadata=bob)) == 2
        assert stub.Abort(pb.AbortRequest(request_id="same"), metadata=alice).found
        reasons = [a.finish_reason for a in stream if a.finish_reason]
        assert reasons == ["abort"], reasons


def test_global_scope_shares_the_prefix_cache(tiny_llama, keys_file):
    srv = _server(tiny_llama, keys_file, "--prefix-cache-scope", "global")
    try:
        assert _cached(srv.url, ALICE)[0] == 0
        cached, total = _cached(srv.url, BOB)
        assert cached >= total - 4
        assert _cached(srv.url, BOB, cache_salt="own")[0] == 0  # a salt still partitions
    finally:
        srv.stop()


def test_through_the_router_too_and_a_dead_replica_tells_no_one_else(workers):
    """Through a router over both replicas: the same 404s, the same cache scope (the
    router's own prefix trees per tenant: tests/serving/test_router_policy.py). When the replica holding
    alice's response is down, alice gets a 503 (it may come back) and bob the 404 of an
    id that never existed. Ends by stopping that replica (the module's last test)."""
    router = RouterProcess(
        [w.url for w in workers], "--policy", "round-robin", "--health-check-interval", "0.3"
    )
    try:
        _check_store_isolation(router.url)
        # a sub-tenant named by X-Tenant, continued by the same one named by user: the
        # router asks the replicas as that sub-tenant (not as its key's tenant)
        team = _create(router.url, {**BOB, "x-tenant": "team-9"})["id"]
        follow = _create(router.url, BOB, input="More", previous_response_id=team, user="team-9")
        assert follow["previous_response_id"] == team
        other = {"input": "x", "previous_response_id": team, "user": "team-8"}
        assert httpx.post(router.url + "/v1/responses", json=other, headers=BOB).status_code == 404
        rid = _create(router.url, ALICE)["id"]
        holder = next(
            w for w in workers if httpx.get(f"{w.url}/v1/responses/{rid}", headers=ADMIN).is_success
        )
        holder.stop()
        deadline = time.monotonic() + 20
        while all(w["healthy"] for w in router.workers()):
            assert time.monotonic() < deadline, "the router did not take the replica out"
            time.sleep(0.1)
        assert httpx.get(f"{router.url}/v1/responses/{rid}", headers=ALICE).status_code == 503
        got = httpx.get(f"{router.url}/v1/responses/{rid}", headers=BOB)
        never = httpx.get(f"{router.url}/v1/responses/{_NEVER}", headers=BOB)
        _same_as_never_existed(got, never, rid)
    finally:
        router.stop()
