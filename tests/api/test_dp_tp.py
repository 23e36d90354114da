"""``serve -dp 2 -tp 2`` end to end on the CPU: two engine processes behind one frontend,
each rank 0 of its own TP=2 group (gloo, one worker process each); greedy completions
through the one server equal TP=1 greedy, and both replicas serve."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.server_helpers import ServerProcess

pytestmark = pytest.mark.slow  # starts servers (pytest -m "not slow" leaves it out)

_ARGS = ("--dtype", "float32", "--page-size", "4", "--kv-cache-memory", "0.02")
_PROMPTS = [
    "Paris is the capital",
    "Numbers 0123456789 and",
    "The quick brown fox jumps over the lazy dog. The quick",
    "Unicode text: café",
]
_TOKENS = 8


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


_TP1 = """
import json, sys
from radixserve import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", page_size=4, kv_cache_memory_gb=0.02)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[3]), params, use_tqdm=False)
vecs = llm.embed(json.loads(sys.argv[3]), "last")
print(json.dumps([[o.outputs[0].text for o in outs], [v.tolist() for v in vecs]]))
"""


def test_dp2_tp2_serve_equals_tp1_greedy(tiny_llama):
    # TP=1 in a child process: the CPU kernels' library (built with -ffast-math) would
    # switch this process's floats to flush-to-zero, which later hypothesis tests refuse
    tp1 = subprocess.run(
        [sys.executable, "-c", _TP1, str(tiny_llama), str(_TOKENS), json.dumps(_PROMPTS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    expected, embeddings = json.loads(tp1.stdout.strip().splitlines()[-1])
    assert all(expected) and len(set(expected)) == len(expected)

    server = ServerProcess(
        "--model", str(tiny_llama), *_ARGS, "-dp", "2", "-tp", "2", "--enable-embeddings"
    )
    try:
        engines = [pid for pid in _children(server.proc.pid) if b"engine_process" in _cmdline(pid)]
        assert len(engines) == 2
        for pid in engines:  # each replica is rank 0 of a TP=2 group with one worker
            workers = [c for c in _children(pid) if b"radixserve.executor.worker" in _cmdline(c)]
            assert len(workers) == 1

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(prompt: str) -> str:
            out = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text

        assert [complete(p) for p in _PROMPTS[:2]] == expected[:2]  # one at a time
        with ThreadPoolExecutor(4) as pool:  # all at once, batched on both replicas
            assert list(pool.map(complete, _PROMPTS)) == expected
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        per_engine = {
            s.labels["engine"]: s.value
            for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "radixserve_dp_engine_requests_total"
        }
        assert set(per_engine) == {"0", "1"} and all(v >= 1 for v in per_engine.values())
        assert sum(per_engine.values()) == 2 + len(_PROMPTS)
        # pooling requests through both replicas' TP groups: TP=1's embeddings
        with ThreadPoolExecutor(4) as pool:
            got = list(
                pool.map(
                    lambda p: client.embeddings.create(model=model, input=p).data[0].embedding,
                    _PROMPTS,
                )
            )
        for g, w in zip(got, embeddings, strict=True):
            assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < 1e-4
    finally:
        server.stop()
