"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official openai client."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.server_helpers import InProcessServer, ServerProcess

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = InProcessServer(
        "--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4", "--vllm-metrics"
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _model(client) -> str:
    return client.models.list().data[0].id


def test_completion_stream_equals_non_stream_and_usage_is_exact(client, server):
    model = _model(client)
    kwargs = dict(
        model=model,
        prompt="Paris is the capital",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    prompt_ids = httpx.post(
        server.url + "/tokenize", json={"prompt": "Paris is the capital"}
    ).json()
    assert full.usage.prompt_tokens == prompt_ids["count"]
    assert full.usage.completion_tokens == 12
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices].count("length") == 1
    # A stop string longer than the whole answer holds every character back until the end;
    # each token step still sends a chunk (empty text), as vLLM's completions stream does,
    # so a client sees its first token when it is made.
    held = list(client.completions.create(stream=True, stop=["#" * 40 + "never"], **kwargs))
    texts = [c.choices[0].text for c in held if c.choices and c.choices[0].finish_reason is None]
    assert "".join(texts) == full.choices[0].text
    assert texts[0] == "" and texts.count("") >= 2, texts


def test_chat_streams_role_first_and_n_samples(client):
    model = _model(client)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=1.0,
        seed=3,
        n=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = {0: "", 1: "", 2: ""}
    finishes: dict[int, int] = {0: 0, 1: 0, 2: 0}
    roles = set()
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:
                roles.add(ch.index)
                assert texts[ch.index] == ""  # the role comes before any content
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] += 1
    assert roles == {0, 1, 2} and finishes == {0: 1, 1: 1, 2: 1}
    assert len(set(texts.values())) > 1
    once = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=1.0,
        seed=3,
        n=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.content for c in once.choices] == [texts[i] for i in range(3)]  # seeded


def test_stop_seed_and_cached_tokens(client):
    model = _model(client)
    base = dict(
        model=model,
        prompt="Numbers 0123456789 and symbols",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**base).choices[0].text
    stop = text[3:6]
    stopped = client.completions.create(stop=[stop], **base).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]
    sampled = dict(base, temperature=1.0, seed=11)
    a = client.completions.create(**sampled).choices[0].text
    b = client.completions.create(**sampled).choices[0].text
    assert a == b
    again = client.completions.create(**base)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 1000}, "n"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "stop": ["x"] * 17}, "stop"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_input_is_a_400_and_the_server_keeps_serving(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_requests_of_other_kinds(server):
    url = server.url
    for raw, content_type in (
        (b"{not json", "application/json"),
        (b"\xff\xfe", "application/json"),  # invalid UTF-8
        (b'{"prompt": "x"}', "text/plain"),
    ):
        r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": content_type})
        assert r.status_code == 400 and "error" in r.json()
    assert httpx.post(url + "/v1/chat/completions", json={"model": "x"}).status_code == 400
    bad_part = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert httpx.post(url + "/v1/chat/completions", json=bad_part).status_code == 400
    unknown = httpx.post(url + "/v1/completions", json={"prompt": "x", "model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/no/such/route").status_code == 404
    wrong_method = httpx.get(url + "/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    huge = b'{"prompt": "' + b"a" * (8 * 2**20) + b'"}'  # over the 8 MiB default limit
    r = httpx.post(
        url + "/v1/completions", content=huge, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("request body")
    assert (
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code
        == 200
    )


def test_logprobs_are_consistent_with_the_chosen_tokens(client):
    model = _model(client)
    out = client.completions.create(
        model=model,
        prompt="Paris is",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    ).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # OpenAI keys top_logprobs by token text, so tokens with the same text collide
        # (a random tiny model emits partial UTF-8 pieces): check what survives that.
        assert chosen <= 0 and 1 <= len(top) <= 3 and token in top
        assert chosen >= max(top.values()) - 1e-5  # greedy takes the most likely token
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    entries = [e for c in chat for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 4
    assert all(
        len(e.top_logprobs) == 2 and e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5)
        for e in entries
    )


def test_echo_with_logprobs_covers_the_prompt(client, server):
    """echo + logprobs: the prompt's own tokens come first (the first without a logprob),
    streamed or not, and agree with the engine computing them token by token."""
    model = _model(client)
    prompt = "The quick brown fox jumps"
    kwargs = dict(
        model=model,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    lp = choice.logprobs
    num_prompt = full.usage.prompt_tokens
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[num_prompt:]) == choice.text[len(prompt) :]
    # prompt token k's logprob is what the model gives it after tokens 0..k-1: ask for the
    # continuation of each prefix with logprobs and compare with what it says of token k
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    for k in (1, num_prompt - 1):
        step = client.completions.create(
            model=model,
            prompt=ids[:k],
            max_tokens=1,
            temperature=0,
            logprobs=5,
            logit_bias={str(ids[k]): 100},  # force token k; logprobs are of the raw model
        ).choices[0]
        assert step.logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[k], abs=1e-4)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_prompt_logprobs_only_with_max_tokens_0(client):
    """echo + logprobs + max_tokens 0 (OpenAI and vLLM accept it): the prompt and its
    logprobs, no completion, streamed or not; without echo max_tokens 0 is a 400."""
    model = _model(client)
    prompt = "The quick brown fox jumps"
    kwargs = dict(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == full.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    with_one = client.completions.create(**{**kwargs, "max_tokens": 1, "temperature": 0})
    n = full.usage.prompt_tokens
    assert with_one.choices[0].logprobs.token_logprobs[:n] == pytest.approx(
        choice.logprobs.token_logprobs, abs=1e-5
    )
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_continuous_usage_stats_and_model_retrieve(client, server):
    """guidellm's stream_options (usage in every chunk) and client.models.retrieve."""
    model = _model(client)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 5 and completion[0] == 0
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == (
        chunks[-1].usage.prompt_tokens + 5
    )
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server.url + "/v1/models/" + model)
    assert r.status_code == 200 and r.json()["max_model_len"] > 0
    bad = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x", "stream": True, "stream_options": {"typo_option": True}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("stream_options")


def test_metrics_parse_and_move(server, client):
    def scrape() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name + str(sorted(sample.labels.items()))] = sample.value
        return out

    before = scrape()
    client.completions.create(
        model=_model(client),
        prompt="hi",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape()
    key = "radixserve_generation_tokens_total[('tenant', 'default')]"
    assert after[key] - before.get(key, 0) == 3
    assert any(k.startswith("radixserve_num_requests_running") for k in after)
    assert any(k.startswith("radixserve_time_to_first_token_seconds_count") for k in after)
    for histogram in ("request_queue_time", "e2e_request_latency", "time_to_first_token"):
        count = f"radixserve_{histogram}_seconds_count[('tenant', 'default')]"
        assert after[count] - before.get(count, 0) == 1, histogram
    reason = (
        "radixserve_request_success_total[('finished_reason', 'length'), ('tenant', 'default')]"
    )
    assert after[reason] - before.get(reason, 0) == 1
    # --vllm-metrics: the series llm-d's endpoint picker scrapes, as vLLM labels them
    labels = f"[('engine', '0'), ('model_name', '{_model(client)}')]"
    assert after["vllm:num_requests_running" + labels] == 0
    assert after["vllm:num_requests_waiting" + labels] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc" + labels] <= 1
    queries = "vllm:prefix_cache_queries_total" + labels
    assert after[queries] > before[queries]
    (info,) = [k for k in after if k.startswith("vllm:cache_config_info")]
    assert "('block_size', '4')" in info and after[info] == 1


def test_native_generate_and_detokenize(server):
    r = httpx.post(
        server.url + "/generate",
        json={
            "text": "Paris",
            "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert len(body["output_ids"]) == 4 and body["meta_info"]["finish_reason"] == "length"
    d = httpx.post(server.url + "/detokenize", json={"tokens": body["output_ids"]}).json()
    assert d["prompt"] == body["text"]


def test_clients_that_time_out_are_aborted(tiny_llama):
    """200 streaming clients give up after 1 s (their streams could not finish by then);
    every one of them did time out, the engine aborted their requests and, once idle,
    every KV page is back in the pool (checked by the engine's own accounting)."""
    srv = InProcessServer(
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "--disable-radix-cache",
        "--enable-debug-endpoints",
    )
    try:

        async def one(client: httpx.AsyncClient) -> str:
            body = {"prompt": "count", "max_tokens": 1500, "stream": True, "ignore_eos": True}
            chunks = 0
            try:
                async with asyncio.timeout(1.0):
                    async with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
                        async for _ in r.aiter_bytes():
                            chunks += 1
            except TimeoutError:
                return "timed out"
            return f"finished after {chunks} chunks"

        async def many() -> list[str]:
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                return await asyncio.gather(*(one(client) for _ in range(200)))

        outcomes = asyncio.run(many())
        assert outcomes == ["timed out"] * 200, sorted(set(outcomes))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = httpx.get(srv.url + "/metrics").text
            stats = {
                s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            }
            if (
                stats.get("radixserve_num_requests_running") == 0
                and stats.get("radixserve_kv_cache_usage_ratio") == 0
                and stats.get("radixserve_num_requests_waiting") == 0
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"requests or pages left: {stats}")
        # the engine generated far fewer tokens than 200 x 1500: the requests were aborted
        assert stats["radixserve_engine_steps_total"] < 1500, stats
        flushed = httpx.post(srv.url + "/debug/flush_cache").json()
        assert flushed["idle"] and flushed["error"] is None, flushed
        assert flushed["pages_leaked"] == 0 and flushed["kv_pages_free"] > 0, flushed
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_engine_death_is_a_503_and_sigterm_drains(tiny_llama):
    srv = ServerProcess("--model", str(tiny_llama), "--dtype", "float32", "--no-engine-restart")
    try:
        os.kill(srv.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 1.0
        while httpx.get(srv.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503 within a second"
            time.sleep(0.05)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        # no restart coming: not live either (a Kubernetes liveness probe restarts the pod),
        # once the supervisor has seen the death (a moment after /health: found by a full
        # run of tests/api on a busy 2-core machine)
        deadline = time.monotonic() + 2.0
        while httpx.get(srv.url + "/live").status_code != 503:
            assert time.monotonic() < deadline, "/live did not turn 503 within two seconds"
            time.sleep(0.05)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0

    srv = ServerProcess("--model", str(tiny_llama), "--dtype", "float32")
    engine = srv.engine_pid()

    async def in_flight() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.create_task(
                c.post(
                    srv.url + "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True},
                )
            )
            await asyncio.sleep(0.3)
            srv.proc.send_signal(signal.SIGTERM)
            return await task

    try:
        response = asyncio.run(in_flight())
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 200
        assert srv.proc.wait(30) == 0
        assert not os.path.exists(f"/proc/{engine}")  # the engine process was reaped
    finally:
        srv.stop()


def test_vllm_request_fields_clients_send(client, server):
    """truncate_prompt_tokens keeps the prompt's last k tokens; request_id names the
    answer; chat's add_special_tokens adds the tokenizer's specials to the templated text;
    an unknown field is still a 400 naming it."""
    model = _model(client)
    prompt = "one two three four five six seven eight nine ten"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    kwargs = dict(model=model, max_tokens=4, temperature=0, logprobs=0, echo=True)
    cut = client.completions.create(
        prompt=prompt, extra_body={"truncate_prompt_tokens": 3}, **kwargs
    )
    direct = client.completions.create(prompt=ids[-3:], **kwargs)
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == direct.choices[0].text  # the echo is what the model saw
    named = client.completions.create(
        model=model, prompt="hi", max_tokens=1, extra_body={"request_id": "abc123"}
    )
    assert named.id == "cmpl-abc123"
    chat = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    plain = client.chat.completions.create(**chat).usage.prompt_tokens
    special = client.chat.completions.create(
        **chat, extra_body={"add_special_tokens": True}
    ).usage.prompt_tokens
    added = len(httpx.post(server.url + "/tokenize", json={"prompt": "x"}).json()["tokens"])
    assert special - plain == added - 1 >= 0  # what the tokenizer adds around a text
    bad = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 0}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_rerank_needs_a_reranker_or_the_flag(server):
    r = httpx.post(server.url + "/v1/rerank", json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "rerank_not_enabled"


def test_render_routes_give_the_tokens_the_engine_would_run(client, server):
    """vLLM's /v1/completions/render and /v1/chat/completions/render (read by llm-d's
    router): the prompt's token ids exactly as the generating route runs them, its
    sampling parameters, and the generating route's 400s."""
    model = _model(client)
    prompts = ["Paris is the capital", "one two three"]
    body = {"model": model, "prompt": prompts, "max_tokens": 5, "temperature": 0.5, "seed": 3}
    answer = httpx.post(server.url + "/v1/completions/render", json=body)
    assert answer.status_code == 200, answer.text
    items = answer.json()
    assert len(items) == 2 and items[0]["request_id"].endswith("-0")
    for item, prompt in zip(items, prompts, strict=True):
        ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert item["token_ids"] == ids and item["model"] == model
        sp = item["sampling_params"]
        assert (sp["max_tokens"], sp["temperature"], sp["seed"]) == (5, 0.5, 3)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    chat = {"model": model, "messages": messages, "max_tokens": 4, "stream": True}
    rendered = httpx.post(server.url + "/v1/chat/completions/render", json=chat).json()
    assert rendered["stream"] is True and rendered["sampling_params"]["max_tokens"] == 4
    done = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0
    )
    assert len(rendered["token_ids"]) == done.usage.prompt_tokens
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    assert rendered["token_ids"] == tokenized["tokens"]
    # refused as the generating routes refuse it
    for path, bad in (
        ("/v1/completions/render", {"model": model, "prompt": "x", "max_tokens": 10**7}),
        ("/v1/completions/render", {"model": model, "prompt": "x", "max_tokens": 0}),
        ("/v1/chat/completions/render", {"model": model, "messages": [], "bogus": 1}),
        ("/v1/chat/completions/render", {"model": "no-such-model", "messages": messages}),
    ):
        answer = httpx.post(server.url + path, json=bad)
        assert answer.status_code in (400, 404), (path, answer.text)
        assert "error" in answer.json()
