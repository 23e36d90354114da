"""The command line, run as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixserve.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow  # runs the CLI in a subprocess
def test_generate_streams_a_chat_answer_with_the_default_model():
    result = _run("generate", "Tell me about Paris", "--max-tokens", "24", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow  # runs the CLI in a subprocess
def test_generate_no_chat_on_a_tiny_model(tiny_llama):
    """Greedy (a random-weight model's samples may all be whitespace): the CLI prints
    what ``LLM.generate`` gives for the same raw prompt."""
    from radixserve import LLM, SamplingParams

    result = _run(
        "generate",
        "Paris is",
        "--model",
        str(tiny_llama),
        "--no-chat",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--dtype",
        "float32",
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=5)
    want = llm.generate(["Paris is"], params, use_tqdm=False)[0].outputs[0].text
    llm.engine.close()
    assert want.strip() and result.stdout == want + "\n"


@pytest.mark.slow  # runs the CLI in a subprocess
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    result = _run("generate", "hi", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow  # runs the CLI in a subprocess
def test_unknown_dtype_is_rejected_by_the_parser():
    result = _run("generate", "hi", "--dtype", "float16")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.slow  # runs the CLI in a subprocess
def test_simulate_runs_a_trace_and_reports(tmp_path):
    import json

    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "arrival": i * 0.05,
            "prompt_tokens": 300,
            "prefix_group": i % 3,
            "prefix_tokens": 256,
            "output_tokens": 20,
        }
        for i in range(30)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    result = _run("simulate", "--workload", str(trace), "--policy", "lpm", "--num-pages", "512")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"] == 30 and summary["failed"] == 0
    assert summary["hit_rate"] > 0.5  # 256 of 300 tokens shared within each group
    assert summary["ttft_p50_s"] > 0 and summary["itl_p50_ms"] > 0
    bad = _run("simulate", "--workload", str(tmp_path / "missing.jsonl"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr


@pytest.mark.slow  # runs the CLI in a subprocess
def test_generate_prints_its_timings_on_stderr(tiny_llama):
    result = _run(
        "generate", "Paris is", "--model", str(tiny_llama), "--no-chat", "--max-tokens", "6",
        "--dtype", "float32", "--temperature", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("radixserve: load ") and "tokens/s" in line, result.stderr
    assert " 6 tokens in " in line  # greedy on fixed random weights: no EOS within 6 tokens
    assert "radixserve:" not in result.stdout


@pytest.mark.parametrize(
    ("flags", "model_defaults", "expected"),
    [
        ([], {}, {"temperature": 0.7, "top_p": 0.9}),  # no generation config
        ([], {"temperature": 0.3}, {}),  # the model's generation config applies
        (["--temperature", "0"], {}, {"temperature": 0.0, "top_p": 0.9}),  # greedy
        (["--top-k", "5"], {"temperature": 0.3}, {"top_k": 5}),
    ],
)
def test_generate_samples_with_the_generation_config_or_a_non_greedy_default(
    flags, model_defaults, expected
):
    from radixserve.cli import build_parser, generate_sampling

    args = build_parser().parse_args(["generate", "hi", *flags])
    assert generate_sampling(args, model_defaults) == expected


def test_overlap_and_timed_device_flags_reach_the_engine_config():
    from radixserve.cli import build_parser, engine_kwargs
    from radixserve.engine.config import EngineConfig

    def config(*args: str) -> EngineConfig:
        return EngineConfig(**engine_kwargs(build_parser().parse_args(["serve", *args])))

    timed = config("--simulated-device-time", "--simulated-device-cost", "0.01,0,1e-9")
    assert timed.simulated_device and timed.simulated_device_cost == (0.01, 0.0, 1e-9)
    assert timed.overlap  # asynchronous device: overlapped by default
    assert not config("--simulated-device-time", "--disable-overlap").overlap
    assert not config("--device", "cpu").overlap  # the CPU model: serial by default
    assert config("--enable-overlap").overlap
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-overlap", "--disable-overlap"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--simulated-device-cost", "1,2"])


def test_device_and_load_format_flags_reach_the_engine_config():
    from radixserve.cli import build_parser, engine_kwargs
    from radixserve.engine.config import EngineConfig

    flags = "--device cpu --load-format dummy --cuda-graph-max-bs 64 --disable-cuda-graph"
    args = build_parser().parse_args(["generate", "hi", *flags.split()])
    c = EngineConfig(**engine_kwargs(args))
    assert (c.device, c.load_format, c.cuda_graph_max_bs, c.disable_cuda_graph) == (
        "cpu",
        "dummy",
        64,
        True,
    )
    assert c.resolved_device == "cpu" and not c.overlap
    defaults = EngineConfig(**engine_kwargs(build_parser().parse_args(["serve"])))
    assert defaults.device == "auto" and defaults.cuda_graph_max_bs == 256
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", "tpu"])
