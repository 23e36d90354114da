"""The frontend keeps serving through engine faults: the watchdog, restarts, the soak."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.api.asgi import ASGIApp, HTTPRequest, json_response
from radixserve.serving.supervisor import (
    IDLE_SILENCE_S,
    ProgressWatch,
    RestartBackoff,
    SupervisorConfig,
    describe_exit,
)
from tests.api.server_helpers import ServerProcess
from tests.api.test_asgi import _Client, _noop, _scope

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_watch_counts_only_time_with_work():
    clock = FakeClock()
    watch = ProgressWatch(clock)
    clock.now += 50  # idle and silent: only the idle rule applies
    assert watch.hang_reason(False, 10) == ("the idle engine has not been heard from for 50.0 s")
    watch.heard(steps=0, outputs=False, busy=False)  # a heartbeat
    assert watch.hang_reason(False, 10) is None
    watch.work_started()  # the long idle time before this is not a stall
    clock.now += 9
    watch.heard(steps=0, outputs=False, busy=True)  # heartbeats without a step: no progress
    assert watch.hang_reason(True, 10) is None
    clock.now += 2
    assert "no progress for 11.0 s" in watch.hang_reason(True, 10)
    assert watch.hang_reason(True, None) is None  # no watchdog: a busy engine never hangs
    watch.heard(steps=1, outputs=False, busy=True)  # a step finished
    assert watch.hang_reason(True, 10) is None
    clock.now += 20
    watch.heard(steps=1, outputs=True, busy=True)  # outputs are progress too
    assert watch.hang_reason(False, 10) is None
    clock.now += 11  # the frontend waits on nothing, but the engine said it is busy
    assert watch.hang_reason(False, 10) is not None
    watch.heard(steps=1, outputs=False, busy=False)
    assert watch.hang_reason(False, 10) is None
    clock.now += IDLE_SILENCE_S + 0.1
    assert "idle engine" in watch.hang_reason(False, 10)


def test_restart_backoff_doubles_for_quick_deaths_and_resets_after_a_stable_run():
    backoff = RestartBackoff(SupervisorConfig(backoff_s=0.5, max_backoff_s=3, stable_s=30))
    assert backoff.next_delay(100.0) == 0.0  # a long-lived engine: restart at once
    assert [backoff.next_delay(1.0), backoff.next_delay(None), backoff.next_delay(2.0)] == [
        0.5,
        1.0,
        2.0,
    ]
    assert backoff.next_delay(None) == 3.0 and backoff.next_delay(0.1) == 3.0  # capped
    assert backoff.next_delay(31.0) == 0.0
    assert backoff.next_delay(5.0) == 0.5
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
    with pytest.raises(ValueError):
        SupervisorConfig(hang_timeout_s=-1)


def test_a_body_over_the_limit_is_read_to_its_end_before_the_413():
    """So that a client still sending gets the 413, not a reset connection (the soak met
    it); a body over 4x the limit is not read further."""

    async def scenario(size: int) -> _Client:
        app = ASGIApp(64, lambda _: None, _noop, _noop)

        @app.route("POST", "/echo")
        async def echo(request: HTTPRequest):
            return json_response({"got": len(request.body)})

        client = _Client(b"x" * size, chunk=10)
        await app(_scope("POST", "/echo"), client.receive, client.send)
        return client

    over = asyncio.run(scenario(200))
    assert over.status == 413 and over.inbox.empty()
    huge = asyncio.run(scenario(1000))
    assert huge.status == 413 and huge.inbox.qsize() == 100 - 26  # read to 260 > 4 * 64
    assert asyncio.run(scenario(60)).status == 200


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _stream_lines(url: str, body: dict, on_event, timeout: float = 60) -> list[bytes]:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:].encode())
                on_event(len(events))
    return events


def test_sigkill_mid_stream_fails_the_stream_then_the_engine_restarts(tiny_llama):
    srv = ServerProcess("--model", str(tiny_llama), "--dtype", "float32")
    try:
        assert httpx.post(srv.url + "/debug/flush_cache").status_code == 404  # off by default
        first = srv.engine_pid()
        body = {"prompt": "count", "max_tokens": 1500, "ignore_eos": True, "stream": True}

        def kill_after_two(n: int) -> None:
            if n == 2:
                os.kill(first, signal.SIGKILL)

        t0 = time.monotonic()
        events = _stream_lines(srv.url, body, kill_after_two)
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
        assert "killed by SIGKILL" in error["message"] and "restarting" in error["message"]
        assert not any(b'"finish_reason":"length"' in e for e in events)  # it did not finish
        # /health is 503 (saying why) while the new engine starts, then 200 again
        health = httpx.get(srv.url + "/health")
        saw_restart = health.status_code == 503 and "killed by SIGKILL" in health.text
        assert httpx.get(srv.url + "/live").status_code == 200  # a restart is not a death
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() - t0 < 90, "the engine was not restarted"
            time.sleep(0.1)
        assert saw_restart, health.text
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert srv.engine_pid() != first
        m = _metrics(srv.url)
        assert m["radixserve_engine_restarts_total"] == 1
        assert m["radixserve_engine_deaths_total"] == 1
        assert m["radixserve_engine_hangs_total"] == 0 and m["radixserve_engine_up"] == 1
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def _hanging_server(tiny_llama, *flags: str) -> ServerProcess:
    os.environ["RADIXSERVE_FAULTS"] = "hang_after:40"
    try:
        return ServerProcess(
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--engine-hang-timeout",
            "1.5",
            "--enable-debug-endpoints",
            *flags,
        )
    finally:
        del os.environ["RADIXSERVE_FAULTS"]


def test_watchdog_fails_requests_of_a_hung_engine_and_health_says_why(tiny_llama):
    srv = _hanging_server(tiny_llama, "--no-engine-restart")
    try:
        body = {"prompt": "count", "max_tokens": 200, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        events = _stream_lines(srv.url, body, lambda n: None)
        assert 1.5 < time.monotonic() - t0 < 30
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == "engine_hung" and "no progress" in error["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "no progress" in health.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_hung"
        state = httpx.get(srv.url + "/debug/engine").json()
        assert state["state"] == "hung" and state["hangs"] == 1 and state["restarts"] == 0
        t0 = time.monotonic()
    finally:
        srv.stop()
    assert srv.proc.returncode == 0 and time.monotonic() - t0 < 8  # the hung engine is killed


def test_a_hung_engine_is_restarted(tiny_llama):
    srv = _hanging_server(tiny_llama)
    try:
        long = {"prompt": "count", "max_tokens": 200, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_hung"
        t0 = time.monotonic()
        while httpx.get(srv.url + "/health").status_code != 200:
            assert time.monotonic() - t0 < 90, "the hung engine was not restarted"
            time.sleep(0.1)
        # < 40 steps; 40 prompt tokens fill pages the radix tree keeps
        short = {"prompt": list(range(5, 45)), "max_tokens": 5, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=short, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        m = _metrics(srv.url)
        assert m["radixserve_engine_hangs_total"] == 1
        assert m["radixserve_engine_restarts_total"] == 1
        flushed = httpx.post(srv.url + "/debug/flush_cache").json()
        assert flushed["idle"] and flushed["pages_leaked"] == 0 and flushed["error"] is None
        assert flushed["radix_nodes_before"] > 0  # the short request's prompt was cached
    finally:
        srv.stop()


def test_a_malformed_fault_spec_stops_serve_before_it_starts():
    env = {**os.environ, "RADIXSERVE_FAULTS": "step_exception:often"}
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "RADIXSERVE_FAULTS: step_exception must be a number" in proc.stderr


def _soak(tiny_llama, *soak_args: str) -> dict:
    """``radixserve soak`` against a launched tiny server: small KV cache (preemption),
    small batches (chunked prefill), a short waiting queue (bursts overflow it)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "soak",
            "--concurrency",
            "6",
            "--burst-every",
            "6",
            "--burst-size",
            "24",
            "--huge-body-mb",
            "2",
            "--max-rss-growth",
            "1.0",  # a short run: asserted below with its own bound
            "--min-requests",
            "110",  # a slow or busy machine runs longer rather than less
            *soak_args,
            "--",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "0.00025",  # 32 pages of 16 tokens
            "--schedule-conservativeness",
            "0.3",
            "--max-model-len",
            "256",
            "--max-num-batched-tokens",
            "64",
            "--max-waiting-requests",
            "8",
            "--max-body-mb",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(proc.stdout[-3000:])
    assert report["lost"] == 0, report["examples"]
    assert report["unexpected_5xx"] == 0, report["examples"]
    assert report["wrong"] == 0, report["examples"]
    assert report["pages_leaked"] == 0 and report["page_check_error"] is None
    out = report["outcomes"]
    assert report["requests"] >= 100 and out["ok"] >= 50
    assert out["rejected"] > 0 and out["overloaded"] > 0 and out["abandoned"] > 0
    assert report["preemptions"] > 0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return report


def test_soak_with_step_exceptions(tiny_llama):
    """One soak (a soak without faults asserts the same less the faults: this one covers it)."""
    report = _soak(tiny_llama, "--duration", "15", "--faults", "step_exception:0.01,seed:1")
    assert report["outcomes"]["fault"] > 0 and report["engine_restarts"] == 0
    assert report["rss_growth"]["server"] is not None and report["rss_growth"]["engine"] is not None
