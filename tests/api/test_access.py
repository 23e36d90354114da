"""Who may call what: inference keys, admin keys, loopback-only admin routes (the policy
without a server), and per-request limits and the body deadline on a live server."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from radixserve.api.auth import AccessPolicy, ApiKeys
from radixserve.api.openai.state import (
    _PROTECTED_PATHS,
    _PROTECTED_PREFIXES,
    ADMIN_PATHS,
    ADMIN_PREFIXES,
    STORED_PREFIX,
)
from tests.api.server_helpers import InProcessServer


def _policy(keys=(), admin=(), loopback=True) -> AccessPolicy:
    return AccessPolicy(
        ApiKeys(keys),
        ApiKeys(admin),
        loopback,
        protected=(_PROTECTED_PREFIXES, _PROTECTED_PATHS),
        admin=(ADMIN_PREFIXES, ADMIN_PATHS),
        admin_too=(STORED_PREFIX,),
    )


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "path", ["/metrics", "/v1/engine/radix", "/v1/engine/stats", "/debug/engine"]
)
def test_admin_routes_need_the_admin_key_not_an_inference_key(path):
    policy = _policy(keys=["user"], admin=["root"])
    assert policy.check(path, _bearer("root")) is None
    assert policy.check(path, {"x-api-key": "root"}) is None
    assert policy.check(path, _bearer("user")).status == 401
    assert policy.check(path, {}).status == 401
    # inference routes: the inference key, as before
    assert policy.check("/v1/completions", _bearer("user")) is None
    assert policy.check("/v1/completions", _bearer("root")).status == 401
    assert policy.check("/health", {}) is None


def test_stored_responses_take_the_admin_key_too_and_nothing_else_does():
    policy = _policy(keys=["user"], admin=["root"])
    for method_path in ("/v1/responses/resp_1", "/v1/responses/resp_1/"):
        assert policy.check(method_path, _bearer("root")) is None
        assert policy.check(method_path, _bearer("user")) is None
        assert policy.check(method_path, _bearer("nope")).status == 401
    assert policy.is_admin(_bearer("root")) and not policy.is_admin(_bearer("user"))
    # creating one (and every other inference route) stays the inference keys'
    assert policy.check("/v1/responses", _bearer("root")).status == 401
    assert not _policy(keys=["user"]).is_admin({})  # no admin key configured: nobody is


def test_without_an_admin_key_admin_routes_are_loopback_only():
    open_loopback = _policy()
    assert open_loopback.check("/metrics", {}) is None
    assert open_loopback.may_read_prompts({})  # a single-user server is its own admin
    keyed_loopback = _policy(keys=["user"])
    assert keyed_loopback.check("/v1/engine/radix", _bearer("user")) is None
    assert keyed_loopback.check("/v1/engine/radix", {}).status == 401
    assert not keyed_loopback.may_read_prompts(_bearer("user"))  # counts, never text
    exposed = _policy(keys=["user"], loopback=False)
    for path in ("/metrics", "/v1/engine/radix", "/debug/flush_cache"):
        denied = exposed.check(path, _bearer("user"))
        assert denied.status == 403 and "--admin-api-key" in denied.message
    assert exposed.check("/v1/completions", _bearer("user")) is None
    admin = _policy(keys=["user"], admin=["root"], loopback=False)
    assert admin.may_read_prompts(_bearer("root")) and not admin.may_read_prompts(_bearer("user"))


@pytest.mark.slow  # starts a server
def test_per_request_limits_body_deadline_and_the_radix_view(tiny_llama):
    srv = InProcessServer(
        "--model", str(tiny_llama), "--dtype", "float32",
        "--api-key", "user", "--admin-api-key", "root",
        "--max-prompts-per-request", "4", "--max-sequences-per-request", "6",
        "--max-prompt-tokens-per-request", "300", "--max-completion-tokens-per-request", "100",
        "--body-timeout", "1",
    )  # fmt: skip
    user, root = _bearer("user"), _bearer("root")
    try:
        url = srv.url + "/v1/completions"
        for body, what in [
            ({"prompt": [[1, 2]] * 5}, "--max-prompts-per-request"),
            ({"prompt": ["a b"] * 5000}, "--max-prompts-per-request"),
            ({"prompt": [[1, 2]] * 4, "n": 2}, "--max-sequences-per-request"),
            ({"prompt": [list(range(3, 103))] * 4}, "--max-prompt-tokens-per-request"),
            ({"prompt": [[1, 2]] * 2, "n": 2, "max_tokens": 30}, "--max-completion-tokens"),
        ]:
            r = httpx.post(url, json={"max_tokens": 4, **body}, headers=user, timeout=60)
            assert r.status_code == 400 and what in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == "request_too_large"
        ok = httpx.post(url, json={"prompt": [[1, 2]] * 4, "max_tokens": 4}, headers=user)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4

        # a body that never ends: 408 after --body-timeout, counted from the headers
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer user\r\n"
                b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"prompt"'
            )
            started = time.monotonic()
            answer = s.recv(4096)
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408") and 0.9 < waited < 5, (answer[:200], waited)

        # the radix view: counts for an inference key holder... no: admin routes need root
        radix = srv.url + "/v1/engine/radix"
        assert httpx.get(radix, headers=user).status_code == 401
        assert httpx.get(srv.url + "/metrics", headers=user).status_code == 401
        view = httpx.get(radix, headers=root).json()
        assert view["total_tokens"] > 0
        assert any(node["preview_text"] for node in view["nodes"])  # the admin sees text
    finally:
        srv.stop()
