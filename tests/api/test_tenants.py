"""Tenants: the keys file, its reload (SIGHUP), how a request's tenant is found, the wire
form, and a live server with per-tenant metrics under the fair policy."""

from __future__ import annotations

import logging
import os
import signal
import time

import grpc
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import SamplingParams
from radixserve.api import auth
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2 as pb
from radixserve.api.grpc.proto.radixserve.v1 import generate_pb2_grpc as pb_grpc
from radixserve.api.tenants import KeysFileError, load_keys_file, parse_keys_file, tenant_tag
from radixserve.core.request import EngineRequest, Tenant
from radixserve.serving import protocol as p
from radixserve.serving.tenancy import DEFAULT_TAG
from tests.api.server_helpers import ServerProcess, free_port

GOOD = """\
# tenants of the test server
alice:sk-alice-0001 weight=2 max_concurrency=4

bob:sk-bob-00002   subtenants=true
   carol:sk:with:colons   weight=0.5
"""


def test_parse_keys_file_fields_comments_and_defaults():
    alice, bob, carol = parse_keys_file(GOOD)
    assert alice.tenant == Tenant("alice", 2.0, 4) and alice.key == b"sk-alice-0001"
    assert not alice.subtenants
    assert bob.tenant == Tenant("bob") and bob.subtenants
    assert carol.tenant == Tenant("carol", 0.5) and carol.key == b"sk:with:colons"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("alice", "expected NAME:KEY"),
        ("al ice:sk-0000001", "expected NAME:KEY"),
        ("-x:sk-00000001", "bad tenant name"),
        ("default:sk-00000001", "reserved"),
        ("alice:short", "shorter than 8"),
        ("alice:sk-alice-0001", "appears twice"),  # the name again
        ("zed:sk-alice-0001", "key appears twice"),
        ("zed:sk-00000009 color=red", "unknown field"),
        ("zed:sk-00000009 weight", "unknown field"),
        ("zed:sk-00000009 weight=0", "weight must be"),
        ("zed:sk-00000009 weight=nan", "weight must be"),
        ("zed:sk-00000009 weight=x", "weight must be"),
        ("zed:sk-00000009 weight=1 weight=2", "given twice"),
        ("zed:sk-00000009 max_concurrency=0", "max_concurrency"),
        ("zed:sk-00000009 max_concurrency=2.5", "max_concurrency"),
        ("zed:sk-00000009 subtenants=yes", "subtenants must be"),
    ],
)
def test_a_bad_line_is_an_error_naming_file_and_line(line, why):
    text = "# ok\nalice:sk-alice-0001\n\n" + line + "\n"
    with pytest.raises(KeysFileError) as err:
        parse_keys_file(text, "tenants.keys")
    assert str(err.value).startswith("tenants.keys:4: ") and why in str(err.value), err.value


def test_a_keys_file_without_keys_or_unreadable_is_an_error(tmp_path):
    with pytest.raises(KeysFileError, match="no keys"):
        parse_keys_file("# nothing\n\n")
    with pytest.raises(KeysFileError, match="cannot read"):
        load_keys_file(tmp_path / "missing.keys")


def test_api_keys_identify_flag_and_file_keys():
    keys = auth.ApiKeys(["flag-key-1"], parse_keys_file(GOOD))
    assert keys.identify("Bearer sk-alice-0001").tenant.name == "alice"
    assert keys.identify(None, "sk-bob-00002").tenant.name == "bob"  # x-api-key
    flag = keys.identify("Bearer flag-key-1")
    assert flag is not None and flag.tenant is None  # --api-key: tenant "default"
    assert keys.identify("Bearer sk-alice-000") is None and not keys.allows("Bearer nope")
    assert auth.ApiKeys([]).allows(None)  # no keys: open


def test_tenant_refinement_only_where_the_key_allows_it():
    alice, bob, _ = parse_keys_file(GOOD)
    sub = {"x-tenant": "team-7"}
    assert tenant_tag(None, sub, "u1") is DEFAULT_TAG
    tag = tenant_tag(alice, sub, "u1")  # no subtenants: header and user ignored
    assert tag.tenant == alice.tenant and tag.label == "alice"
    tag = tenant_tag(bob, sub, "u1")  # the header comes first
    assert tag.tenant.name == "bob/team-7" and tag.label == "bob"
    assert tenant_tag(bob, {}, "u1").tenant.name == "bob/u1"
    assert tenant_tag(bob, {}, None).tenant == bob.tenant
    assert "X-Tenant" in tenant_tag(bob, {"x-tenant": "a b"}, None)  # a 400's message
    assert "user" in tenant_tag(bob, {}, "x" * 129)


def test_reload_swaps_keys_and_a_bad_file_keeps_the_old_ones(tmp_path, caplog):
    path = tmp_path / "tenants.keys"
    path.write_text(GOOD)
    keys = auth.ApiKeys(["flag-key-1"], load_keys_file(path))
    path.write_text("dave:sk-dave-00001 weight=3\n")
    assert auth.reload_keys_file(keys, str(path))
    assert keys.identify("Bearer sk-dave-00001").tenant == Tenant("dave", 3.0)
    assert not keys.allows("Bearer sk-alice-0001")  # gone
    assert keys.allows("Bearer flag-key-1")  # --api-key keys stay
    path.write_text("dave:sk-dave-00001\nerin:tiny\n")
    with caplog.at_level(logging.ERROR, "radixserve.api"):
        assert not auth.reload_keys_file(keys, str(path))
    assert "not reloaded" in caplog.text and ":2: " in caplog.text
    assert keys.identify("Bearer sk-dave-00001").tenant.weight == 3.0  # the old set


def test_the_tenant_travels_on_the_wire():
    sent = EngineRequest("r1", [1, 2], SamplingParams(max_tokens=2), "s", 3, Tenant("a", 2, 3))
    back = msgspec.msgpack.decode(p.encoder.encode(p.GenerateRequest(sent)), type=p.ToEngine)
    assert back.request == sent and back.request.tenant == Tenant("a", 2.0, 3)
    plain = msgspec.msgpack.decode(
        p.encoder.encode(p.GenerateRequest(EngineRequest("r2", [1], SamplingParams()))),
        type=p.ToEngine,
    )
    assert plain.request.tenant is None


def _scrape(url: str, headers: dict) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics", headers=headers).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.slow  # starts a server
def test_server_tenants_from_a_keys_file_with_metrics_and_sighup(tiny_llama, tmp_path):
    keys_file = tmp_path / "tenants.keys"
    keys_file.write_text(GOOD)
    grpc_port = free_port()
    srv = ServerProcess(
        "--model", str(tiny_llama), "--dtype", "float32",
        "--api-keys-file", str(keys_file), "--admin-api-key", "root-key",
        "--schedule-policy", "fair", "--grpc-port", str(grpc_port),
    )  # fmt: skip
    root = {"authorization": "Bearer root-key"}
    url = srv.url + "/v1/completions"
    body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
    try:

        def complete(key: str, **headers: str) -> httpx.Response:
            return httpx.post(
                url, json=body, headers={"authorization": f"Bearer {key}", **headers}, timeout=60
            )

        assert complete("sk-alice-0001", **{"x-tenant": "ignored"}).status_code == 200
        assert complete("sk-bob-00002", **{"x-tenant": "team-1"}).status_code == 200
        r = httpx.post(
            url, json={**body, "user": "u 1"}, headers={"authorization": "Bearer sk-bob-00002"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "user", r.text
        assert complete("nope-nope-nope").status_code == 401
        stream = httpx.post(
            url, json={**body, "stream": True}, headers={"authorization": "Bearer sk-bob-00002"}
        )
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
        # gRPC: the same key in metadata, the sub-tenant in x-tenant metadata
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.GenerateServiceStub(channel)
            req = pb.GenerateRequest(
                text="hi", sampling_params=pb.SamplingParams(max_tokens=3, ignore_eos=True)
            )
            auth_md = ("authorization", "Bearer sk-bob-00002")
            answers = list(stub.Generate(req, metadata=(auth_md, ("x-tenant", "team-2"))))
            assert sum(len(a.token_ids) for a in answers) == 3
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=(auth_md, ("x-tenant", "no spaces"))))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        got = _scrape(srv.url, root)
        tokens = "radixserve_generation_tokens_total"
        assert got[(tokens, (("tenant", "alice"),))] == 3
        assert got[(tokens, (("tenant", "bob"),))] == 9  # team-1, plain bob, gRPC team-2
        labels = {dict(labels).get("tenant") for _, labels in got} - {None}
        defaults = [k for k in got if ("tenant", "default") in k[1]]
        assert labels == {"alice", "bob"}, defaults  # keys-file names, never a sub-tenant
        ttft = "radixserve_time_to_first_token_seconds_count"
        assert got[(ttft, (("tenant", "alice"),))] == 1 and got[(ttft, (("tenant", "bob"),))] == 3
        success = "radixserve_request_success_total"
        assert got[(success, (("finished_reason", "length"), ("tenant", "alice")))] == 1

        # SIGHUP re-reads the file: a new key in, alice out; a bad file keeps them
        keys_file.write_text("dave:sk-dave-00001 weight=3\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while complete("sk-dave-00001").status_code != 200:
            assert time.monotonic() < deadline, "the new key was not taken"
            time.sleep(0.1)
        assert complete("sk-alice-0001").status_code == 401
        keys_file.write_text("dave:sk-dave-00001\nerin:tiny\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "not reloaded" not in srv.log.read_text():
            assert time.monotonic() < deadline, "no log line for the failed reload"
            time.sleep(0.1)
        assert complete("sk-dave-00001").status_code == 200
        assert srv.proc.poll() is None  # SIGHUP did not end the server
    finally:
        srv.stop()
