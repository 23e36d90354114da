"""The web console, in a real headless browser (Debian's chromium driven by Playwright)
against a real ``radixserve serve`` on a tiny model, plus its JSON routes over HTTP.

Screenshots go to ``test-artifacts/console/`` (or ``$RADIXSERVE_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.console_helpers import PAYLOAD, TRIGGER, build_chain_model
from tests.api.server_helpers import InProcessServer

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

KEY = "console-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARTIFACTS = (
    Path(
        os.environ.get(
            "RADIXSERVE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"
        )
    )
    / "console"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_chain_model(tmp_path_factory.mktemp("console") / "chain")
    # one key for both: the console's views of other users' prompts need the admin key
    srv = InProcessServer(
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--page-size",
        "4",
        "--api-key",
        KEY,
        "--admin-api-key",
        KEY,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def stats(server) -> dict:
    r = httpx.get(server.url + "/v1/engine/stats", headers=AUTH, timeout=10)
    r.raise_for_status()
    return r.json()


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(interval)


# -- HTTP -----------------------------------------------------------------------------------
def test_pages_are_public_and_the_json_routes_need_the_key(server):
    for path in ("/", "/console"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert '<script src="/console/app.js"' in r.text
    r = httpx.get(server.url + "/console/app.js")
    assert r.status_code == 200 and "renderMarkdown" in r.text
    for path in ("/v1/engine/stats", "/v1/engine/radix"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(server.url + path, headers=AUTH).status_code == 200
    for query in ("max_nodes=0", "max_nodes=abc", "max_depth=100000"):
        r = httpx.get(server.url + "/v1/engine/radix?" + query, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] in query


def test_stats_count_a_request(server, client):
    before = stats(server)
    out = client.completions.create(
        model=client.models.list().data[0].id, prompt="Paris is", max_tokens=7, temperature=0
    )
    after = wait_for(
        lambda: (
            (s := stats(server))["frontend"]["requests_finished"]
            > before["frontend"]["requests_finished"]
            and s
        )
    )
    assert out.usage.completion_tokens == 7
    gained = after["frontend"]["generation_tokens"] - before["frontend"]["generation_tokens"]
    assert gained == 7
    last = after["recent"][0]
    assert last["completion_tokens"] == 7 and last["finish_reason"] == "length"
    assert last["prompt_tokens"] == out.usage.prompt_tokens
    assert 0 < last["ttft_s"] <= last["e2e_s"]
    engine = after["engine"]
    assert engine["alive"] and engine["running"] == 0 and engine["steps"] > 0
    assert (
        engine["kv_pages_used"] + engine["kv_pages_evictable"] + engine["kv_pages_free"]
        == (engine["kv_pages_total"])
    )
    assert engine["radix_nodes"] >= 1 and engine["kv_pages_evictable"] > 0


def _shared_prefix_requests(client) -> str:
    """Two prompts with a common head (unique to this call); returns the head."""
    head = f"{uuid.uuid4().hex[:8]} Berlin is the capital of Germany. The quick brown fox "
    model = client.models.list().data[0].id
    for tail in ("jumps over the lazy dog.", "sleeps; Paris is in France."):
        client.completions.create(model=model, prompt=head + tail, max_tokens=2, temperature=0)
    return head


def test_radix_summary_holds_the_shared_prefix(server, client):
    head = _shared_prefix_requests(client)
    r = httpx.get(server.url + "/v1/engine/radix?max_nodes=512&max_depth=64", headers=AUTH)
    body = r.json()
    nodes = {n["id"]: n for n in body["nodes"]}
    assert all(n["tier"] == 0 for n in body["nodes"])  # no KV tiers: all in the pool
    shared = [
        n
        for n in body["nodes"]
        if n["preview_text"] and head[:16] in n["preview_text"] and n["children"] == 2
    ]
    assert len(shared) == 1, body
    node = shared[0]
    kids = [n for n in body["nodes"] if n["parent"] == node["id"]]
    assert (
        len(kids) == 2
        and sum(k["subtree_tokens"] for k in kids) + node["tokens"] == (node["subtree_tokens"])
    )
    assert node["tokens"] % body["page_size"] == 0 and node["lock_count"] == 0
    assert nodes[node["parent"]]["subtree_tokens"] >= node["subtree_tokens"]
    assert (
        body["total_nodes"] + body["namespaces"] >= len(body["nodes"])
        and body["engine_cost_ms"] >= 0
    )
    small = httpx.get(server.url + "/v1/engine/radix?max_nodes=2", headers=AUTH).json()
    assert len(small["nodes"]) == 2 and small["truncated"]


# -- browser --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run does it as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.goto(server.url + "/")
    # the API answers 401 without the key: the page asks for it
    pg.locator("#key-form").wait_for(state="visible", timeout=10_000)
    pg.fill("#api-key", KEY)
    pg.click("#key-form button")
    pg.locator("#engine-state.ok").wait_for(timeout=10_000)
    yield pg
    context.close()
    assert not errors, errors


def _set_playground(page, system: str, max_tokens: int) -> None:
    page.click('nav a[data-tab="playground"]')
    page.click("#clear-chat")
    page.fill("#system-prompt", system)
    page.locator("#temperature").fill("0")
    page.fill("#max-tokens", str(max_tokens))


def _send(page, text: str, answers: int) -> None:
    page.fill("#user-input", text)
    page.press("#user-input", "Enter")
    page.wait_for_function(
        "n => { const m = document.querySelectorAll('.msg.assistant');"
        " return m.length === n && m[n - 1].dataset.state !== 'streaming'; }",
        arg=answers,
        timeout=30_000,
    )


def _readout(page, index: int, name: str) -> str:
    return (
        page.locator(".msg.assistant")
        .nth(index)
        .locator(f".readout .{name}")
        .get_attribute("data-value")
    )


def test_playground_streams_the_answer_and_shows_cached_tokens(page, client):
    system = f"You are terse {uuid.uuid4().hex[:8]}. Paris is the capital of France. " * 2
    _set_playground(page, system, 24)
    _send(page, "Tell me about the quick brown fox", 1)
    convo = page.evaluate("radixserveConsole.messages()")
    assert [m["role"] for m in convo] == ["user", "assistant"]
    expected = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "system", "content": system}, convo[0]],
        max_tokens=24,
        temperature=0,
    )
    assert convo[1]["content"] == expected.choices[0].message.content != ""
    assert page.locator(".msg.assistant").first.get_attribute("data-state") == "done"
    assert _readout(page, 0, "tokens") == "24" and _readout(page, 0, "finish") == "length"
    assert _readout(page, 0, "cached") == "0"  # a new system prompt: nothing cached yet
    assert float(_readout(page, 0, "ttft").split()[0]) > 0
    assert float(_readout(page, 0, "tps")) > 0
    _send(page, "And the lazy dog?", 2)
    cached = int(_readout(page, 1, "cached"))
    prompt = int(_readout(page, 1, "prompt"))
    # the second turn's prompt starts with the whole first turn: its pages are reused
    assert 0 < cached < prompt
    first_prompt = int(_readout(page, 0, "prompt"))
    assert cached >= first_prompt // 4 * 4 - 4
    page.screenshot(path=str(ARTIFACTS / "playground.png"), full_page=True)


def test_stop_aborts_the_request_in_the_engine(page, server):
    _set_playground(page, "You talk a lot.", 3000)
    page.fill("#user-input", "Tell me a very long story")
    page.press("#user-input", "Enter")
    answer = page.locator(".msg.assistant").first
    page.wait_for_function(
        "() => radixserveConsole.messages().at(-1).content.length > 40", timeout=30_000
    )
    assert answer.get_attribute("data-state") == "streaming"
    assert stats(server)["engine"]["running"] == 1
    page.click("#stop")
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant').dataset.state === 'stopped'"
    )
    engine = wait_for(
        lambda: (s := stats(server)["engine"])["running"] == 0 and s["waiting"] == 0 and s,
        timeout=5,
    )
    assert engine["kv_pages_protected"] == 0  # nothing locked for it any more
    recent = stats(server)["recent"][0]
    assert recent["finish_reason"] == "cancelled" and 0 < recent["completion_tokens"] < 3000
    text = page.evaluate("radixserveConsole.messages().at(-1).content")
    time.sleep(0.3)
    assert page.evaluate("radixserveConsole.messages().at(-1).content") == text
    assert _readout(page, 0, "finish") == "stopped"
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()


def test_model_output_with_script_is_shown_as_text(page):
    _set_playground(page, "", 16)
    _send(page, f"say it {TRIGGER}", 1)
    content = page.locator(".msg.assistant .content").first
    assert content.text_content() == PAYLOAD  # the markup shows as text
    assert page.locator("#messages script, #messages img").count() == 0
    page.click("#regenerate")  # the same answer again, replacing the first
    page.wait_for_function(
        "() => document.querySelector('.msg.assistant').dataset.state === 'done'"
    )
    assert page.locator(".msg.assistant").count() == 1
    assert page.locator(".msg.assistant .content").first.text_content() == PAYLOAD
    assert _readout(page, 0, "finish") == "stop"
    assert page.evaluate("typeof window.__pwned") == "undefined"


def test_markdown_renders_its_own_tags_only(page):
    source = (
        "# T <b>x</b>\n\n**bold** and `<i>code</i>` *em*\n\n- a\n- <u>b</u>\n\n"
        '```py\n<script>x()</script>\n```\n"><img src=x onerror=alert(1)>\x000\x00'
    )
    html = page.evaluate(
        """(source) => {
        const div = document.createElement("div");
        div.innerHTML = radixserveConsole.renderMarkdown(source);
        return {
          tags: [...div.querySelectorAll("*")].map((e) => e.tagName.toLowerCase()),
          pre: div.querySelector("pre code").textContent,
          code: div.querySelector("p code").textContent,
          text: div.textContent,
        };
      }""",
        source,
    )
    assert sorted(set(html["tags"])) == ["code", "em", "h1", "li", "p", "pre", "strong", "ul"]
    assert html["pre"] == "<script>x()</script>" and html["code"] == "<i>code</i>"
    assert "T <b>x</b>" in html["text"] and '"><img src=x onerror=alert(1)>0' in html["text"]


def test_dashboard_moves_after_a_request(page, client):
    page.click('nav a[data-tab="dashboard"]')
    page.wait_for_function(
        "() => /^\\d+$/.test(document.getElementById('stat-finished').textContent)"
    )
    finished = int(page.text_content("#stat-finished"))
    generated = int(page.text_content("#stat-gen-tokens"))
    client.completions.create(
        model=client.models.list().data[0].id, prompt="Numbers 0123", max_tokens=9, temperature=0
    )
    page.wait_for_function(
        "n => Number(document.getElementById('stat-finished').textContent) > n",
        arg=finished,
        timeout=5_000,
    )
    assert int(page.text_content("#stat-gen-tokens")) == generated + 9
    first_row = page.locator("#recent tbody tr").first.locator("td")
    assert first_row.nth(4).text_content() == "9" and first_row.nth(8).text_content() == "length"
    assert page.text_content("#stat-running") == "0"
    page.wait_for_timeout(1200)  # one more poll: the charts have two points
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)


def test_radix_view_shows_the_shared_node(page, client):
    head = _shared_prefix_requests(client)
    page.click('nav a[data-tab="radix"]')
    page.click("#radix-refresh")
    summary = page.locator("details.radix-node > summary", has_text=head[:16])
    summary.first.wait_for(timeout=10_000)
    assert summary.count() == 1
    node = summary.locator("..")
    assert node.get_attribute("data-children") == "2"
    assert node.locator(":scope > details.radix-node").count() == 2
    assert "engine cost" in page.text_content("#radix-info")
    page.screenshot(path=str(ARTIFACTS / "radix.png"), full_page=True)


@pytest.fixture(scope="module")
def thinker_server(tmp_path_factory):
    """A chain model that answers "!think" with a thinking block, then "Yes."."""
    chain = ["<think>", "Weighing it.", "</think>", "Yes."]
    model = build_chain_model(tmp_path_factory.mktemp("thinker") / "m", "!think", chain)
    srv = InProcessServer(
        "--model", str(model), "--dtype", "float32", "--reasoning-parser", "qwen3"
    )
    yield srv
    srv.stop()


def test_thinking_is_shown_folded_above_the_answer(browser, thinker_server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    try:
        pg.goto(thinker_server.url + "/")
        pg.locator("#engine-state.ok").wait_for(timeout=10_000)
        _set_playground(pg, "", 20)
        _send(pg, "Is it so? !think", 1)
        details = pg.locator(".msg.assistant details.thinking")
        assert details.count() == 1 and details.get_attribute("open") is None  # folded
        assert pg.locator(".msg.assistant .thinking-text").text_content() == "Weighing it."
        assert pg.evaluate("radixserveConsole.messages().at(-1).content") == "Yes."
        details.locator("summary").click()
        assert details.get_attribute("open") is not None
        pg.screenshot(path=str(ARTIFACTS / "thinking.png"), full_page=True)
    finally:
        context.close()
