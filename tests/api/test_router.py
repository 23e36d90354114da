"""``radixserve router`` over real ``radixserve serve`` workers, and ``serve -dp 2``; all on
127.0.0.1 with the tiny random Llama, driven by the official openai client and httpx."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.server_helpers import InProcessServer, ServerProcess, free_port

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

_WORKER_ARGS = ("--dtype", "float32", "--page-size", "4", "--enable-embeddings")
_PREFIX = "The quick brown fox jumps over the lazy dog. " * 6


class RouterProcess:
    """``radixserve router`` in a subprocess, started once every worker is healthy."""

    def __init__(self, workers: list[str], *args: str, startup_timeout: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"radixserve-router-{self.port}.log"
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        flags = [x for url in workers for x in ("--worker", url)]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve.cli",
                "router",
                "--port",
                str(self.port),
                *flags,
                *args,
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                state = httpx.get(self.url + "/workers", timeout=1).json()
                if all(w["healthy"] for w in state["workers"]):
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"router did not start: {self.log.read_text()[-3000:]}")

    def workers(self) -> list[dict]:
        return httpx.get(self.url + "/workers", timeout=5).json()["workers"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log_file.close()


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _routed(router: RouterProcess) -> dict[str, float]:
    """Requests routed so far, by worker URL."""
    return {
        dict(labels)["worker"]: v
        for (name, labels), v in _samples(router.url).items()
        if name == "radixserve_router_requests_total"
    }


def _tokens(url: str, text: str) -> int:
    return httpx.post(url + "/tokenize", json={"prompt": text}).json()["count"]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(url: str, prompt: str, max_tokens: int = 8) -> str:
    client = _client(url)
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


@pytest.fixture(scope="module")
def workers(tiny_llama):
    # the second is a process of its own: the module's last test stops and kills it
    own = ServerProcess("--model", str(tiny_llama), *_WORKER_ARGS, wait=False)  # starts meanwhile
    try:
        procs = [InProcessServer("--model", str(tiny_llama), *_WORKER_ARGS), own]
        own.wait_ready()
    except BaseException:
        own.stop()
        raise
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def router(workers):
    r = RouterProcess([w.url for w in workers], "--health-check-interval", "0.5")
    yield r
    r.stop()


def test_router_answers_equal_direct_requests(workers, router):
    direct, routed = _client(workers[0].url), _client(router.url)
    model = direct.models.list().data[0].id
    assert routed.models.list().data[0].id == model
    kwargs = dict(model=model, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    for prompt in ("Paris is the capital", "Numbers 0123456789 and"):
        want = direct.completions.create(prompt=prompt, **kwargs).choices[0].text
        assert routed.completions.create(prompt=prompt, **kwargs).choices[0].text == want
        chunks = list(routed.completions.create(prompt=prompt, stream=True, **kwargs))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    messages = [{"role": "user", "content": "hello there"}]
    want = direct.chat.completions.create(messages=messages, **kwargs).choices[0].message
    got = routed.chat.completions.create(messages=messages, **kwargs).choices[0].message
    assert got.content == want.content
    # errors pass through with the worker's status and body
    with pytest.raises(openai.BadRequestError) as info:
        routed.completions.create(model=model, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    assert httpx.post(router.url + "/tokenize", json={"prompt": "hi"}).json()["count"] > 0
    render = {"model": model, "prompt": "hi there"}  # (llm-d's router reads these)
    rendered = httpx.post(router.url + "/v1/completions/render", json=render).json()
    assert (
        rendered[0]["token_ids"]
        == httpx.post(workers[0].url + "/tokenize", json={"prompt": "hi there"}).json()["tokens"]
    )


def test_messages_and_embeddings_through_the_router(workers, router):
    """Anthropic's Messages API (its client, its x-api-key header, its stream events) and
    embeddings go through the router and answer as a worker does directly; a request the
    worker refuses keeps the Messages API's error shape."""
    import anthropic

    def claude(url: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)

    model = _client(workers[0].url).models.list().data[0].id
    kwargs = dict(
        model=model,
        max_tokens=8,
        extra_body={"temperature": 0},  # (this SDK's create has no temperature argument)
        system="Answer briefly.",
        messages=[{"role": "user", "content": "Name a colour."}],
    )
    want = claude(workers[0].url).messages.create(**kwargs)
    got = claude(router.url).messages.create(**kwargs)
    assert got.content[0].text == want.content[0].text

    def prompt_tokens(usage) -> int:  # Anthropic's input_tokens leave out cache reads
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt_tokens(got.usage) == prompt_tokens(want.usage)
    with claude(router.url).messages.stream(**kwargs) as stream:
        assert "".join(stream.text_stream) == want.content[0].text
    counted = claude(router.url).messages.count_tokens(
        model=model, messages=kwargs["messages"], system=kwargs["system"]
    )
    assert counted.input_tokens == prompt_tokens(want.usage)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude(router.url).messages.create(**{**kwargs, "extra_body": {"temperature": 9}})
    assert info.value.body["type"] == "error"
    # embeddings: the same vector from the router as from a worker
    texts = ["Paris is the capital", "Numbers 0123456789"]
    direct = _client(workers[1].url).embeddings.create(model=model, input=texts)
    routed = _client(router.url).embeddings.create(model=model, input=texts)
    for a, b in zip(direct.data, routed.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    assert routed.usage.prompt_tokens == direct.usage.prompt_tokens


def test_cache_aware_sends_a_shared_prefix_to_one_worker(workers, router):
    hits_before = {w.url: _samples(w.url) for w in workers}
    routed_before = _routed(router)
    prefix = "Numbers 0123456789 and symbols !?.,;:-_()[]{} appear in text. " * 4
    prefix_tokens = _tokens(router.url, prefix)
    assert prefix_tokens >= 32
    for question in ("Paris?", "Berlin?", "café?"):
        _complete(router.url, prefix + question, max_tokens=4)
    routed = _routed(router)
    delta = {url: routed.get(url, 0) - routed_before.get(url, 0) for url in routed}
    (target,) = [url for url, d in delta.items() if d]  # all three went to one worker
    assert delta[target] == 3
    outcomes = {
        dict(labels)["outcome"]: v
        for (name, labels), v in _samples(router.url).items()
        if name == "radixserve_router_routing_total" and dict(labels)["worker"] == target
    }
    assert outcomes.get("cache_hit", 0) >= 2
    for w in workers:  # the worker that got them found the prefix cached; the other did nothing
        key = ("radixserve_prefix_cache_hits_total", ())
        gained = _samples(w.url)[key] - hits_before[w.url][key]
        if w.url == target:  # two requests found the prefix (up to its last page)
            assert gained >= 2 * (prefix_tokens - 8)
        else:
            assert gained == 0


def test_round_robin_alternates(workers):
    r = RouterProcess([w.url for w in workers], "--policy", "round-robin")
    try:
        order = []
        for i in range(4):
            before = _routed(r)
            _complete(r.url, _PREFIX + str(i), max_tokens=2)
            after = _routed(r)
            (url,) = [u for u in after if after[u] != before.get(u, 0)]
            order.append(url)
        assert order[0] != order[1] and order[0::2] == [order[0]] * 2
        assert order[1::2] == [order[1]] * 2
    finally:
        r.stop()


def _stream(url: str, max_tokens: int) -> tuple[httpx.Client, object, object]:
    client = httpx.Client(timeout=30)
    body = {"prompt": _PREFIX, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.send(
        client.build_request("POST", url + "/v1/completions", json={**body, "stream": True}),
        stream=True,
    )
    assert response.status_code == 200
    return client, response, response.iter_lines()


def _rest(lines) -> list[bytes]:
    return [line for line in lines if line]


def test_data_parallel_serve_equals_one_engine_and_uses_both(workers, tiny_llama):
    dp = ServerProcess("--model", str(tiny_llama), *_WORKER_ARGS, "-dp", "2")
    try:
        prompts = ["Paris is the capital", "Numbers 0123456789 and", _PREFIX]
        for prompt in prompts:
            assert _complete(dp.url, prompt, 12) == _complete(workers[0].url, prompt, 12)
        samples = _samples(dp.url)
        per_engine = {
            dict(labels)["engine"]: v
            for (name, labels), v in samples.items()
            if name == "radixserve_dp_engine_requests_total"
        }
        assert set(per_engine) == {"0", "1"} and all(v >= 1 for v in per_engine.values())
        assert sum(per_engine.values()) == len(prompts)
        # a repeated prompt goes where its prefix is: that engine finds it cached
        before = _samples(dp.url)
        _complete(dp.url, _PREFIX + " again", 4)
        after = _samples(dp.url)
        gained = {
            dict(labels)["engine"]: v - before.get((name, labels), 0)
            for (name, labels), v in after.items()
            if name == "radixserve_dp_engine_prefix_cache_hits_total"
        }
        assert sorted(gained.values()) == [0, max(gained.values())]
        assert max(gained.values()) >= _tokens(dp.url, _PREFIX) - 8
        assert httpx.get(dp.url + "/health").status_code == 200
        # an engine that dies gets no new requests: the other one answers them all
        children = Path(f"/proc/{dp.proc.pid}/task/{dp.proc.pid}/children").read_text().split()
        engines = [
            int(pid)
            for pid in children
            if b"radixserve.serving.engine_process" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert len(engines) == 2
        os.kill(engines[0], signal.SIGKILL)

        def engines_alive() -> list[float]:
            text = httpx.get(dp.url + "/metrics").text
            return [
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "radixserve_dp_engine_alive"
            ]

        deadline = time.monotonic() + 5  # the client notices within 0.1 s
        while sorted(engines_alive()) != [0.0, 1.0]:
            assert time.monotonic() < deadline, engines_alive()
            time.sleep(0.05)
        for prompt in prompts:
            assert _complete(dp.url, prompt, 6) == _complete(workers[0].url, prompt, 6)
        assert httpx.get(dp.url + "/health").status_code == 200
    finally:
        dp.stop()


def test_a_request_whose_worker_fails_before_any_output_goes_elsewhere(workers, tiny_llama):
    """A worker whose engine is dead answers 503 (whole) or an engine_dead first event
    (streamed) before any output: the router sends the request to another worker, and
    the client never sees the failure (counted in radixserve_router_retries)."""
    dead = ServerProcess("--model", str(tiny_llama), *_WORKER_ARGS, "--no-engine-restart")
    # health checked rarely: the router still thinks the dead worker healthy
    r = RouterProcess(
        [dead.url, workers[0].url], "--policy", "round-robin", "--health-check-interval", "60"
    )
    try:
        os.kill(dead.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(dead.url + "/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        expected = _complete(workers[0].url, "Paris is the capital")
        for _ in range(2):  # round-robin: one of each pair goes to the dead worker first
            assert _complete(r.url, "Paris is the capital") == expected
            client, _, lines = _stream(r.url, 6)
            rest = _rest(lines)
            client.close()
            assert rest[-1] == "data: [DONE]" and not any("error" in x for x in rest), rest
        retries = _samples(r.url)[("radixserve_router_retries_total", (("worker", dead.url),))]
        assert retries >= 2
        assert all(w["load"] == 0 for w in r.workers())
    finally:
        r.stop()
        dead.stop()


def test_a_stored_response_is_continued_read_and_deleted_on_the_replica_that_holds_it(workers):
    """Responses traffic through the router: round-robin would send every other request to
    the replica without the stored response (a 404 there); the router pins follow-ups,
    retrievals and deletes to the one holding it, remembers ids from plain and streamed
    answers, and finds an id it never saw (a restarted router) by asking the replicas."""
    r = RouterProcess([w.url for w in workers], "--policy", "round-robin")
    try:
        client = _client(r.url)
        model = client.models.list().data[0].id
        kwargs = {"model": model, "max_output_tokens": 3, "temperature": 0}
        first = client.responses.create(input="Paris is the capital of", **kwargs)
        with client.responses.stream(input="Berlin is the capital of", **kwargs) as events:
            streamed = events.get_final_response()
        chain = [first.id, streamed.id]
        for turn in range(4):  # each continues the last: pinned, whatever round-robin says
            previous = chain[turn % 2] if turn < 2 else chain[-1]
            nxt = client.responses.create(
                input="And then?", previous_response_id=previous, **kwargs
            )
            assert nxt.previous_response_id == previous
            chain.append(nxt.id)
        owners = {}
        for rid in chain:
            holders = [
                i
                for i, w in enumerate(workers)
                if httpx.get(f"{w.url}/v1/responses/{rid}").status_code == 200
            ]
            assert len(holders) == 1, (rid, holders)
            owners[rid] = holders[0]
        assert set(owners.values()) == {0, 1}  # round-robin did spread the conversations
        for rid in chain:  # read through the router, whichever replica holds it
            assert httpx.get(f"{r.url}/v1/responses/{rid}").json()["id"] == rid

        # a restarted router knows no ids: it asks the replicas
        r.stop()
        r = RouterProcess([w.url for w in workers], "--policy", "round-robin")
        client = _client(r.url)
        for _ in range(2):
            nxt = client.responses.create(input="More.", previous_response_id=chain[-1], **kwargs)
            chain.append(nxt.id)
        assert owners[chain[-3]] == next(
            i
            for i, w in enumerate(workers)
            if httpx.get(f"{w.url}/v1/responses/{chain[-1]}").status_code == 200
        )

        # deleted through the router, on its replica; then unknown everywhere
        answer = httpx.delete(f"{r.url}/v1/responses/{chain[0]}")
        assert answer.status_code == 200 and answer.json()["deleted"] is True
        gone = httpx.get(f"{r.url}/v1/responses/{chain[0]}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.create(input="x", previous_response_id=chain[0], **kwargs)
        assert missing.value.body["code"] == "previous_response_not_found"
        assert all(w["load"] == 0 for w in r.workers())
    finally:
        r.stop()


def test_a_failed_worker_is_taken_out_and_its_stream_ends_with_an_error(workers):
    victim = workers[1]  # (the module's last test: it kills this worker)
    # round-robin starts with the victim; quick health checks, two misses take a worker out
    r = RouterProcess(
        [victim.url, workers[0].url],
        "--policy",
        "round-robin",
        "--health-check-interval",
        "0.2",
        "--health-check-timeout",
        "1",
    )
    engine = victim.engine_pid()
    try:
        # a hung worker (stopped): its stream ends once the health checks give up on it
        client, _, lines = _stream(r.url, 1500)
        first = next(lines)
        assert first.startswith("data: {")
        os.kill(victim.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        rest = _rest(lines)
        assert time.monotonic() - started < 15
        error = orjson.loads(rest[-2][6:])["error"]
        assert error["code"] == "worker_failed" and victim.url in error["message"]
        assert rest[-1] == "data: [DONE]"
        client.close()
        assert [w["healthy"] for w in r.workers()] == [False, True]
        assert _complete(r.url, "Paris is the capital") == _complete(
            workers[0].url, "Paris is the capital"
        )
        # back in once it answers its health checks again
        os.kill(victim.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while not r.workers()[0]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)

        # a killed worker: the connection drops, the stream ends with an error at once
        client, _, lines = _stream(r.url, 1500)  # round-robin: the victim again
        assert next(lines).startswith("data: {")
        os.kill(victim.proc.pid, signal.SIGKILL)
        os.kill(engine, signal.SIGKILL)
        rest = _rest(lines)
        error = orjson.loads(rest[-2][6:])["error"]
        assert error["code"] == "worker_failed" and rest[-1] == "data: [DONE]"
        client.close()
        for _ in range(3):  # the dead worker gets nothing: every request succeeds
            _complete(r.url, "Berlin is", max_tokens=2)
        assert [w["healthy"] for w in r.workers()] == [False, True]
        assert all(w["load"] == 0 for w in r.workers())
        router_metrics = _samples(r.url)
        key = ("radixserve_router_worker_failures_total", (("worker", victim.url),))
        assert router_metrics[key] == 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.proc.pid, signal.SIGCONT)
        r.stop()
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
