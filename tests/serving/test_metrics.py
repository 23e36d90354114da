"""The vLLM-named series (``--vllm-metrics``) from engine stats, with no model: the names,
labels and values llm-d's endpoint picker reads (its model-server protocol)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from radixserve.engine.outputs import EngineStats
from radixserve.serving.metrics import Metrics, VLLMNames


def _stats(**kw) -> EngineStats:
    base = dict(
        running=3,
        waiting=5,
        kv_pages_total=200,
        kv_pages_free=130,
        kv_pages_evictable=20,  # cached by the radix tree alone: free on demand
        cache_hit_tokens=40,
        cache_queried_tokens=100,
        preemptions=0,
        steps=9,
    )
    return EngineStats(**(base | kw))


def _families(metrics: Metrics) -> dict:
    text = metrics.render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_picker_s_series_one_each_labelled_as_vllm() -> None:
    stats = _stats(running_loras=["sql", "chat"], waiting_loras=["tools"])
    metrics = Metrics(lambda: stats, VLLMNames("smol", 16, max_loras=4))
    families = _families(metrics)
    expected = {
        "vllm:num_requests_running": 3,
        "vllm:num_requests_waiting": 5,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:gpu_cache_usage_perc": 0.25,
    }
    for name, value in expected.items():
        (sample,) = families[name].samples  # one series: the picker reads the first
        assert families[name].type == "gauge"
        assert sample.labels == {"model_name": "smol", "engine": "0"}
        assert sample.value == value, name
    hits = {s.name: s.value for s in families["vllm:prefix_cache_hits"].samples}
    assert hits["vllm:prefix_cache_hits_total"] == 40
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "200"
    (lora,) = families["vllm:lora_requests_info"].samples
    # exactly vLLM's three labels, lists comma-joined without spaces, the value a time
    assert lora.labels == {
        "max_lora": "4",
        "running_lora_adapters": "sql,chat",
        "waiting_lora_adapters": "tools",
    }
    assert abs(lora.value - time.time()) < 60
    # radixserve's own names stay
    assert families["radixserve_num_requests_running"].samples[0].value == 3


def test_off_by_default_and_nothing_before_the_engine_reports() -> None:
    assert not any(n.startswith("vllm:") for n in _families(Metrics(lambda: _stats())))
    assert not any(
        n.startswith("vllm:") for n in _families(Metrics(lambda: None, VLLMNames("m", 16)))
    )
