"""Several models behind one real server: SmolLM2 (Q4_1) and two tiny float models (Llama
and Qwen3 architectures), under a ``--memory-budget`` that holds two of them. Requests alternate between
the models from two clients at once: every answer equals that model's answer served alone,
nothing is lost across the evictions, the engines' memory stays within the budget, a file
that cannot be loaded fails its own requests only, and a killed engine comes back without
touching the other models."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from radixserve import LLM, SamplingParams
from tests.api.server_helpers import ServerProcess

pytestmark = pytest.mark.slow

KV_GIB = 0.25
# counted per model (the larger of the engine's resident memory and the estimate before it
# loads: ~0.70 GiB SmolLM2, ~0.56 each tiny one): any two fit, the three do not
BUDGET_GIB = 1.45
# the engines' resident memory may pass the sum counted by this much (a KV page is made
# resident when first used, after the model was measured; the server process is apart)
RSS_MARGIN_GIB = 0.15
PROMPT = "The capital of France is"
GREEDY = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}


def _engine_rss(server_pid: int) -> int:
    """Resident bytes of the server's engine processes, all together."""
    total = 0
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        try:
            if b"engine_process" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue  # (it exited meanwhile)
    return total


def _engine_of(server_pid: int, model_path: str) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"engine_process" in cmdline and model_path.encode() in cmdline:
            return int(pid)
    raise AssertionError(f"no engine for {model_path}")


def _status(url: str) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(url + "/v1/models").json()["data"]}


def _complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(
        url + "/v1/completions", json={**GREEDY, "model": model, **extra}, timeout=180
    )


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory, smollm2_path, tiny_models, tiny_llama) -> Path:
    folder = tmp_path_factory.mktemp("models")
    (folder / "smollm2.gguf").symlink_to(smollm2_path)
    (folder / "qwen3").symlink_to(tiny_models["qwen3"])
    (folder / "tiny").symlink_to(tiny_llama)
    (folder / "broken.gguf").write_bytes(b"GGUF but not really")
    (folder / "models.toml").write_text('[models.tiny]\naliases = ["tiny-float"]\n')
    return folder


def test_three_models_under_a_budget_for_two(models_dir, tiny_llama, smollm2_path):
    # each model served alone (offline, the same engine and defaults): the reference
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = {
        "tiny": LLM(str(tiny_llama)).generate(PROMPT, greedy)[0].outputs[0].text,
        "smollm2": LLM(str(smollm2_path)).generate(PROMPT, greedy)[0].outputs[0].text,
    }
    srv = ServerProcess(
        "--models-dir",
        str(models_dir),
        "--memory-budget",
        str(BUDGET_GIB),
        "--kv-cache-memory",
        str(KV_GIB),
        "--idle-unload",
        "-1",
    )
    peak = [0]
    done = threading.Event()

    def watch_memory() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _engine_rss(srv.proc.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_memory, daemon=True)
    watcher.start()
    try:
        status = _status(srv.url)
        assert {"smollm2", "qwen3", "tiny", "broken"} <= set(status)
        assert all(card["status"] == "unloaded" for card in status.values())

        # the first answer of each model (the one later answers must equal)
        r = _complete(srv.url, "qwen3")
        assert r.status_code == 200, r.text
        alone["qwen3"] = r.json()["choices"][0]["text"]
        assert r.json()["model"] == "qwen3"

        # two clients, each going round the three models: every pair of models fits, the
        # three do not, so models are unloaded and loaded again under load
        order = ["smollm2", "tiny", "qwen3", "tiny-float"]

        def client(names: list[str]) -> list[tuple[str, int, str]]:
            out = []
            for name in names:
                r = _complete(srv.url, name)
                out.append((name, r.status_code, r.text if r.status_code != 200 else ""))
                if r.status_code == 200:
                    served = r.json()["model"]
                    text = r.json()["choices"][0]["text"]
                    out[-1] = (served, 200, text)
            return out

        with ThreadPoolExecutor(2) as pool:
            results = [*pool.map(client, [order, order[::-1]])]
        for served, code, text in [x for r in results for x in r]:
            assert code == 200, text
            assert text == alone[{"tiny-float": "tiny"}.get(served, served)], served
        status = _status(srv.url)
        assert sum(card.get("loads", 0) for card in status.values()) >= 4, status
        assert "model=" in httpx.get(srv.url + "/metrics").text  # (series by model)
        loaded = [n for n, card in status.items() if card["status"] == "loaded"]
        assert len(loaded) <= 2
        assert sum(status[n]["memory_bytes"] for n in loaded) <= BUDGET_GIB * 2**30

        # a file that cannot be loaded: its own requests fail, saying why; others answer
        r = _complete(srv.url, "broken")
        assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed"
        assert "broken" in r.json()["error"]["message"]
        assert _complete(srv.url, "tiny").status_code == 200
        r = _complete(srv.url, "no-such-model")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        # a killed engine restarts; the other loaded model answers meanwhile
        for name in ("tiny", "smollm2"):
            assert _complete(srv.url, name).json()["choices"][0]["text"] == alone[name]
        os.kill(_engine_of(srv.proc.pid, str(models_dir / "smollm2.gguf")), signal.SIGKILL)
        assert _complete(srv.url, "tiny").json()["choices"][0]["text"] == alone["tiny"]
        deadline = time.monotonic() + 120
        while (r := _complete(srv.url, "smollm2")).status_code != 200:
            assert r.json()["error"]["code"] in ("engine_dead", "engine_restarting"), r.text
            assert time.monotonic() < deadline, "the killed engine did not come back"
            time.sleep(0.5)
        assert r.json()["choices"][0]["text"] == alone["smollm2"]

        # keep_alive 0 (ollama's): unloaded once answered; the admin routes by hand
        assert _complete(srv.url, "tiny", keep_alive=0).status_code == 200
        deadline = time.monotonic() + 30
        while _status(srv.url)["tiny"]["status"] != "unloaded":
            assert time.monotonic() < deadline, "keep_alive 0 did not unload the model"
            time.sleep(0.1)
        assert _complete(srv.url, "tiny", keep_alive="5x").status_code == 400
        r = httpx.post(srv.url + "/v1/models/unload", json={"model": "smollm2"})
        assert r.status_code == 200 and r.json()["status"] == "unloaded"
    finally:
        done.set()
        watcher.join()
        srv.stop()
    assert srv.proc.returncode == 0
    assert peak[0] <= (BUDGET_GIB + RSS_MARGIN_GIB) * 2**30, peak[0] / 2**30
