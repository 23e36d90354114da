"""The deployment files under deploy/ stay in step with the CLI: every flag the
Kubernetes manifest gives ``radixserve serve`` parses, and reaches the configs it means."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from radixserve.api.ray import APP_ARGS
from radixserve.cli import build_parser, engine_kwargs, server_config
from radixserve.engine.config import EngineConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_the_kubernetes_manifest_s_serve_flags_parse() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "radixserve.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "InferencePool"]
    (container,) = docs[0]["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["args"]]
    parsed = build_parser().parse_args(args)
    engine = EngineConfig(**engine_kwargs(parsed))
    assert engine.kv_events_endpoint == "tcp://*:5557"
    assert engine.kv_events_topic == "kv@10.0.0.7:8000@SmolLM2-135M-Instruct"
    assert server_config(parsed).vllm_metrics
    probes = {k: container[k]["httpGet"]["path"] for k in ("readinessProbe", "livenessProbe")}
    assert probes == {"readinessProbe": "/health", "livenessProbe": "/live"}
    pool = docs[2]["spec"]
    assert pool["selector"]["matchLabels"] == docs[0]["spec"]["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": 8000}]


def test_the_rayservice_runs_build_app_with_arguments_it_knows() -> None:
    (service,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "radixserve.api.ray.app:build_app"
    assert set(app["args"]) <= APP_ARGS
    parsed = build_parser().parse_args(["serve", *shlex.split(app["args"]["serve_args"])])
    assert server_config(parsed).vllm_metrics
