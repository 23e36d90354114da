"""benchmarks/vs_llamacpp.py and benchmarks/build_llamacpp.sh without building llama.cpp: the
arguments, the result JSON's shape and ratios, the parsing of llama-bench's JSON, the message
when the binaries are missing, and the build script's "second run does nothing"."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "vs_llamacpp.py"
BUILD = REPO / "benchmarks" / "build_llamacpp.sh"


def _module():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vs = _module()

# two tests of one `llama-bench -o json -r 2 -p 512 -n 128` run (fields trimmed)
LLAMA_BENCH_JSON = """[
  {"build_commit": "x", "model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 512,
   "n_gen": 0, "n_depth": 0, "avg_ts": 270.0, "stddev_ts": 2.0,
   "samples_ns": [1896296296, 1896296296], "samples_ts": [268.0, 272.0]},
  {"build_commit": "x", "model_type": "llama ?B Q4_1", "n_threads": 2, "n_prompt": 0,
   "n_gen": 128, "n_depth": 0, "avg_ts": 115.0, "stddev_ts": 1.0,
   "samples_ns": [1113043478, 1113043478], "samples_ts": [114.0, 116.0]}
]"""


def test_defaults_and_quick_mode():
    args = vs.parse_args([])
    assert args.models == ["smollm2", "gemma3"]
    assert args.measures == ["decode", "prefill", "online"]
    assert (args.threads, args.repeats, args.concurrency) == (2, 3, 16)
    quick = vs.parse_args(["--quick", "--repeats", "5", "--models", "gemma3"])
    assert quick.repeats == 1 and quick.models == ["gemma3"]
    assert quick.online_requests == 16 and quick.online_output_len == 32


@pytest.mark.parametrize(
    "argv", [["--models", "llama"], ["--measures", "decode,ttft"], ["--repeats", "0"]]
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as err:
        vs.parse_args(argv)
    assert err.value.code == 2
    assert "error" in capsys.readouterr().err


def test_llama_bench_json_is_read_per_repetition():
    assert vs.parse_llama_bench(LLAMA_BENCH_JSON) == {
        "pp512": [268.0, 272.0],
        "tg128": [114.0, 116.0],
    }
    mixed = json.loads(LLAMA_BENCH_JSON)[:1]
    mixed[0]["n_gen"] = 16  # a prompt+generation test is not one of the two measured
    with pytest.raises(ValueError):
        vs.parse_llama_bench(json.dumps(mixed))


def test_result_json_has_the_issue_keys_and_ratios_of_medians():
    raw = {
        "smollm2": {"decode": {"radixserve": [100.0, 120.0, 110.0], "llamacpp": [100.0]}},
        "gemma3": {
            "decode": {"radixserve": [60.0], "llamacpp": [80.0, 70.0, 75.0]},
            "prefill": {"radixserve": [1500.0, 1700.0], "llamacpp": [600.0, 700.0]},
        },
    }
    result = vs.summarize_results(raw)
    assert result["decode_bs1_ratio_smollm2"] == 1.1
    assert result["decode_bs1_ratio_gemma3"] == 0.8
    assert result["prefill_ratio_gemma3"] == round(1600 / 650, 3)
    assert result["online_c16_ratio_gemma3"] is None  # not measured: present, None
    for key in ("decode_bs1_ratio_moe", "online_c16_ratio_moe", "peak_rss_ratio_moe"):
        assert key in result and result[key] is None  # #42's keys, None until measured
    assert result["raw"] is raw
    json.dumps(result)  # the last line is JSON
    moe = {"moe": {"memory": {"radixserve": [6.0, 6.0], "llamacpp": [4.0, 4.2]}}}
    assert vs.summarize_results(moe)["peak_rss_ratio_moe"] == round(6.0 / 4.1, 3)


def test_stand_ins_are_written_from_codes_and_run(tmp_path):
    """A tiny shape of the codes writer (an OLMoE with four experts) loads in radixserve
    from its codes and is a valid GGUF file for the gguf package."""
    import sys

    import gguf

    from radixserve import LLM

    sys.path.insert(0, str(Path(vs.__file__).parent))
    import synthetic_gguf as sg

    sg.CODE_SHAPES["olmoe-test"] = {
        **sg.CODE_SHAPES["olmoe-1b-7b"],
        "hidden": 256,
        "intermediate": 256,
        "layers": 2,
        "heads": 2,
        "kv_heads": 2,
        "vocab": 49216,
        "experts": 4,
        "experts_used": 2,
    }
    try:
        path = sg.codes_file("olmoe-test", tmp_path)
    finally:
        del sg.CODE_SHAPES["olmoe-test"]
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"  # use_more_bits picks the last
    assert types["output.weight"] == "Q6_K"
    llm = LLM(str(path), max_model_len=64)
    assert "int4-g32 (Q4_K)" in llm.engine.startup_line
    out = llm.generate([[5, 6, 7]], vs_greedy(4), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    llm.engine.close()


def vs_greedy(tokens: int):
    from radixserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def test_random_prompts_are_fresh_ordinary_ids():
    a = vs.random_ids(1, 4, 512, 49152)
    b = vs.random_ids(2, 4, 512, 49152)
    assert len(a) == 4 and all(len(p) == 512 for p in a)
    assert a != b and a[0] != a[1]
    assert all(1000 <= t < 49152 - 1000 for p in a for t in p)
    assert vs.random_ids(1, 4, 512, 49152) == a  # one seed, one set: both engines get it


def test_missing_binaries_say_how_to_build(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--llamacpp-bin", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "benchmarks/build_llamacpp.sh" in proc.stderr
    assert "llama-bench" in proc.stderr and "--llamacpp-bin" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    # the default folder is the build script's cache folder
    assert vs.default_bin_dir() != tmp_path  # HOME-based here; XDG in the subprocess only
    (tmp_path / "bin").mkdir()
    for name in vs.BINARIES:
        (tmp_path / "bin" / name).write_text("#!/bin/sh\n")
    with pytest.raises(vs.MissingBinaries):  # present but not executable
        vs.find_binaries(tmp_path / "bin")
    for name in vs.BINARIES:
        (tmp_path / "bin" / name).chmod(0o755)
    assert vs.find_binaries(tmp_path / "bin")["llama-server"] == tmp_path / "bin" / "llama-server"


def test_build_script_second_run_does_nothing(tmp_path):
    """A finished build (the binaries and the stamp of the same version and flags) is left
    alone: no download (PYTHON=false would fail it), the bin folder printed. A stale stamp
    starts a build, which fails here at the download."""
    dest = tmp_path / "llamacpp"
    env = {**os.environ, "LLAMACPP_DIR": str(dest), "PYTHON": "false"}
    stamp = subprocess.run(
        ["bash", str(BUILD), "--print-stamp"], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    assert "llama-cpp-python==" in stamp and "-DGGML_NATIVE=ON" in stamp
    (dest / "bin").mkdir(parents=True)
    for name in ("llama-bench", "llama-server", "llama-quantize"):
        (dest / "bin" / name).write_text("#!/bin/sh\n")
        (dest / "bin" / name).chmod(0o755)
    (dest / "STAMP").write_text(stamp + "\n")
    done = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(dest / "bin")
    assert "already built" in done.stdout
    (dest / "STAMP").write_text("llama-cpp-python==0.0.1\n")
    stale = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, env=env)
    assert stale.returncode != 0 and "already built" not in stale.stdout
    assert not list(dest.glob("work.*"))  # the failed attempt cleans up after itself
