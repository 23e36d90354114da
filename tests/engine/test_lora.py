"""LoRA adapters (executor/lora.py) against transformers + peft: adapters made by peft here,
with random non-zero B so they change the output; a mixed batch of adapters equal to each
request alone; the prefix cache partitioned by adapter; refusals that name the problem."""

from __future__ import annotations

import json
import math

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.core.errors import LoRAError, LoRANotFound
from tests.helpers import generate_ids, greedy

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 17, 33, 9, 100, 41], [7, 7, 300, 12], [90, 2 + 1, 44, 45, 46, 47, 48, 49, 50]]


def _base(folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def make_adapter(model_folder, out, seed, **config):
    """A peft LoRA of the model in ``model_folder``, saved to ``out``; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    kwargs = {"r": 8, "lora_alpha": 16, "target_modules": ALL, "init_lora_weights": False}
    kwargs.update(config)
    model = get_peft_model(_base(model_folder), LoraConfig(**kwargs)).eval()
    model.save_pretrained(str(out))
    return model


def hf_greedy_logprobs(model, ids, n):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item()
        for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Three adapters of the tiny Llama: every projection; q and v with rsLoRA and an
    alpha pattern; the MLP only at rank 4 on layer 1."""
    root = tmp_path_factory.mktemp("lora")
    folder = tiny_models["llama"]
    made = {
        "all": make_adapter(folder, root / "all", 1),
        "qv": make_adapter(
            folder,
            root / "qv",
            2,
            target_modules=["q_proj", "v_proj"],
            use_rslora=True,
            alpha_pattern={"v_proj": 4},
        ),
        "mlp": make_adapter(
            folder,
            root / "mlp",
            3,
            r=4,
            target_modules=["gate_proj", "down_proj"],
            layers_to_transform=[1],
        ),
    }
    return folder, root, made


@pytest.fixture(scope="module")
def lora_llm(adapters):
    folder, root, _ = adapters
    return LLM(
        str(folder),
        dtype="float32",
        lora_modules=tuple(f"{n}={root / n}" for n in ("all", "qv", "mlp")),
    )


@pytest.mark.parametrize("name", ["all", "qv", "mlp"])
def test_equals_peft_unmerged(adapters, lora_llm, name):
    _, _, made = adapters
    model = made[name]
    params = greedy(10, logprobs=0)
    for ids in PROMPTS:
        want, want_lp = hf_greedy_logprobs(model, ids, 10)
        out = lora_llm.generate([ids], params, use_tqdm=False, lora=name)[0].outputs[0]
        assert out.token_ids == want
        got_lp = [lp.logprob for lp in out.logprobs]
        assert got_lp == pytest.approx(want_lp, abs=2e-4)


@pytest.mark.parametrize("name", ["all", "mlp"])
def test_equals_peft_merged(adapters, lora_llm, name):
    """The adapter merged into the base by peft is the function radixserve computes
    unmerged (it never merges)."""
    from peft import PeftModel

    folder, root, _ = adapters
    merged = PeftModel.from_pretrained(_base(folder), str(root / name)).merge_and_unload()
    merged.generation_config.eos_token_id = None
    for ids in PROMPTS[:2]:
        want, _ = hf_greedy_logprobs(merged, ids, 10)
        out = lora_llm.generate([ids], greedy(10), use_tqdm=False, lora=name)
        assert out[0].outputs[0].token_ids == want


def test_the_adapters_change_the_output(adapters, lora_llm):
    base = generate_ids(lora_llm, PROMPTS, greedy(10))
    for name in ("all", "qv", "mlp"):
        outs = lora_llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora=name)
        assert [o.outputs[0].token_ids for o in outs] != base, name


def test_mixed_batch_equals_each_alone(lora_llm):
    """Base and three adapters in one batch (prefill and decode steps together, the
    requests of one adapter not neighbours) give what each gives alone."""
    names = [None, "all", "qv", "mlp", "all", None, "mlp", "qv"]
    prompts = [PROMPTS[i % 3] + [60 + i] for i in range(len(names))]
    alone = [
        lora_llm.generate([p], greedy(12), use_tqdm=False, lora=n)[0].outputs[0].token_ids
        for p, n in zip(prompts, names, strict=True)
    ]
    lora_llm.engine.flush_cache()
    together = lora_llm.generate(prompts, greedy(12), use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in together] == alone
    lora_llm.engine.check_idle()


def test_mixed_batch_on_an_int4_base(adapters):
    """The common case: adapters over a quantized base (int4 panels, bfloat16)."""
    folder, root, _ = adapters
    llm = LLM(
        str(folder),
        quantization="int4",
        lora_modules=(f"all={root / 'all'}", f"qv={root / 'qv'}", f"mlp={root / 'mlp'}"),
    )
    names = ["all", None, "qv", "mlp"]
    prompts = [PROMPTS[i % 3] + [70 + i] for i in range(len(names))]
    alone = [
        llm.generate([p], greedy(10), use_tqdm=False, lora=n)[0].outputs[0].token_ids
        for p, n in zip(prompts, names, strict=True)
    ]
    together = llm.generate(prompts, greedy(10), use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert len({tuple(a) for a in alone}) == 4  # each adapter (and the base) differs
    llm.engine.check_idle()


def test_prefix_cache_is_partitioned_by_adapter(lora_llm):
    prompt = list(range(100, 164))  # four pages
    lora_llm.engine.flush_cache()

    def cached(name):
        out = lora_llm.generate([prompt], greedy(2), use_tqdm=False, lora=name)[0]
        return out.num_cached_tokens

    assert cached("all") == 0
    assert cached("all") > 0  # the same adapter reuses its pages
    assert cached("qv") == 0  # another adapter never does
    assert cached(None) == 0  # nor the base
    assert cached(None) > 0
    lora_llm.engine.check_idle()


def test_unknown_adapter_is_refused_before_anything_runs(lora_llm):
    with pytest.raises(LoRANotFound, match="nope"):
        lora_llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora=["all", "nope", None])
    assert not lora_llm.engine.has_unfinished()


def test_load_and_unload_at_run_time(adapters, tmp_path):
    folder, root, made = adapters
    llm = LLM(str(folder), dtype="float32")
    want, _ = hf_greedy_logprobs(made["qv"], PROMPTS[0], 8)
    llm.load_lora("late", str(root / "qv"))
    engine = llm.engine
    engine.add_request("r1", PROMPTS[0], greedy(8), lora="late")
    tokens = [t for delta in engine.step() for t in delta.token_ids]  # in flight ...
    llm.unload_lora("late")  # ... finishes on the adapter it started with
    with pytest.raises(LoRANotFound):
        engine.add_request("r2", PROMPTS[0], greedy(8), lora="late")
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.token_ids
    assert tokens == want
    engine.check_idle()


def test_max_loras_bounds_the_adapters_running_at_once(adapters):
    folder, root, _ = adapters
    llm = LLM(
        str(folder),
        dtype="float32",
        max_loras=1,
        lora_modules=(f"all={root / 'all'}", f"qv={root / 'qv'}"),
    )
    engine = llm.engine
    for i, name in enumerate(["all", "qv", "all", None]):
        engine.add_request(f"r{i}", PROMPTS[0] + [i], greedy(20), lora=name)
    seen = 0
    while engine.has_unfinished():
        engine.step()
        running = {r.lora.name for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= 1
        seen += len(running)
        # the stats name them (vllm:lora_requests_info), the waiting ones apart
        stats = engine.stats()
        assert stats.running_loras == sorted(running)
        waiting = {r.lora.name for r in engine.scheduler.waiting if r.lora is not None}
        assert stats.waiting_loras == sorted(waiting)
    assert seen > 0
    engine.check_idle()


def test_max_cpu_loras_reads_a_dropped_adapter_again(adapters):
    folder, root, made = adapters
    llm = LLM(
        str(folder),
        dtype="float32",
        max_loras=1,
        max_cpu_loras=1,
        lora_modules=(f"all={root / 'all'}", f"qv={root / 'qv'}"),
    )
    assert list(llm.engine.loras.loaded) == ["qv"]
    want, _ = hf_greedy_logprobs(made["all"], PROMPTS[1], 6)
    out = llm.generate([PROMPTS[1]], greedy(6), use_tqdm=False, lora="all")
    assert out[0].outputs[0].token_ids == want
    assert list(llm.engine.loras.loaded) == ["all"]


def _write(folder, config, tensors):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, None, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"peft_type": "IA3"}, None, "not LoRA"),
        (
            {},
            {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
            "lm_head.lora_A.weight is not a LoRA weight",
        ),
        (
            {},
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)},
            "embedding",
        ),
        (
            {},
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                    4, 64
                ),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(
                    60, 4
                ),
            },
            "do not fit",
        ),
        (
            {},
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
            "without lora_B",
        ),
        (
            {},
            {
                "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(
                    4, 64
                ),
                "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": torch.zeros(
                    64, 4
                ),
            },
            "layer 9",
        ),
        (
            {},
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                    128, 64
                ),
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(
                    64, 128
                ),
            },
            "max-lora-rank",
        ),
    ],
)
def test_bad_adapters_are_refused_naming_the_problem(lora_llm, tmp_path, config, tensors, message):
    ok = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
    }
    folder = _write(
        tmp_path / "bad", {"r": 4, "lora_alpha": 8, **config}, ok if tensors is None else tensors
    )
    names = lora_llm.engine.lora_names()
    with pytest.raises(LoRAError, match=message):
        lora_llm.load_lora("bad", str(folder))
    assert lora_llm.engine.lora_names() == names  # nothing registered, nothing disturbed


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"lora_alpha": None}, "lora_alpha .* must be a number"),
        ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must be an object"),
        ({"alpha_pattern": {"(": 2}}, "error"),
        ({"r": 4, "lora_alpha": "x"}, "lora_alpha"),
    ],
)
def test_malformed_configs_are_a_lora_error(lora_llm, tmp_path, config, message):
    """Whatever is wrong in a config is a LoRAError (a 400 at the API), never another
    exception that would take the engine process down."""
    ok = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
    }
    folder = _write(tmp_path / "bad", {"r": 4, **config}, ok)
    with pytest.raises(LoRAError, match=message):
        lora_llm.load_lora("bad", str(folder))
    rank0 = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(0, 64),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 0),
    }
    with pytest.raises(LoRAError, match="rank 0"):
        lora_llm.load_lora("bad", str(_write(tmp_path / "r0", {"r": 4}, rank0)))


def test_alpha_pattern_is_matched_as_peft_matches_it(tiny_models, tmp_path):
    """PEFT's keys: a full module path, or a pattern matched against the end of the full
    name; the first that matches wins. The scales land where peft puts them."""
    folder = tiny_models["llama"]
    patterns = {"model.layers.0.self_attn.q_proj": 64, "self_attn.(k|v)_proj": 2, "v_proj": 99}
    model = make_adapter(folder, tmp_path / "p", 9, alpha_pattern=patterns)
    llm = LLM(str(folder), dtype="float32", lora_modules=(f"p={tmp_path / 'p'}",))
    for ids in PROMPTS:
        want, want_lp = hf_greedy_logprobs(model, ids, 8)
        out = llm.generate([ids], greedy(8, logprobs=0), use_tqdm=False, lora="p")[0].outputs[0]
        assert out.token_ids == want
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(want_lp, abs=2e-4)


def test_missing_files_are_refused(lora_llm, tmp_path):
    with pytest.raises(LoRAError, match="neither a folder"):
        lora_llm.load_lora("x", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match=r"adapter_config\.json"):
        lora_llm.load_lora("x", str(tmp_path / "empty"))
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAError, match=r"adapter_model\.safetensors"):
        lora_llm.load_lora("x", str(tmp_path / "empty"))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "phi3"])
def test_other_families_equal_peft(tiny_models, tmp_path, arch):
    """Qwen2 (q/k/v biases), Gemma 3 (its own forward) and Phi-3 (q/k/v and gate/up stored
    fused: peft targets ``qkv_proj`` and ``gate_up_proj``)."""
    folder = tiny_models[arch]
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if arch == "phi3" else ALL
    model = make_adapter(folder, tmp_path / "ad", 4, target_modules=targets)
    llm = LLM(str(folder), dtype="float32", lora_modules=(f"ad={tmp_path / 'ad'}",))
    for ids in PROMPTS[:2]:
        want, want_lp = hf_greedy_logprobs(model, ids, 8)
        out = llm.generate([ids], greedy(8, logprobs=0), use_tqdm=False, lora="ad")[0]
        assert out.outputs[0].token_ids == want
        assert [lp.logprob for lp in out.outputs[0].logprobs] == pytest.approx(want_lp, abs=2e-4)
    assert not math.isnan(want_lp[0])


def test_sampling_params_and_lora_are_independent(lora_llm):
    """A seeded sample on an adapter is a function of (request, seed): twice the same."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    a = lora_llm.generate([PROMPTS[0]], params, use_tqdm=False, lora="all")
    b = lora_llm.generate([PROMPTS[0]], params, use_tqdm=False, lora="all")
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


# -- llama.cpp's GGUF LoRA files ---------------------------------------------------------
LLAMACPP_VERSION = "0.3.36"


def llamacpp_sources():
    """llama.cpp's conversion scripts from the llama-cpp-python sdist (``.ci/run`` puts
    them in the cache; ``RADIXSERVE_LLAMACPP_SRC`` names another folder), or None."""
    import os
    from pathlib import Path

    from radixserve.core.cache_dir import cache_root

    env = os.environ.get("RADIXSERVE_LLAMACPP_SRC")
    folder = Path(env) if env else cache_root() / f"llamacpp-src-{LLAMACPP_VERSION}"
    return folder if (folder / "convert_lora_to_gguf.py").is_file() else None


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_gguf_lora_from_llamacpps_converter_equals_its_peft_source(
    adapters, lora_llm, tmp_path, outtype
):
    """The PEFT adapter converted by llama.cpp's own ``convert_lora_to_gguf.py`` (q and k
    rows permuted as llama.cpp stores them, alpha in the metadata) serves what the PEFT
    folder serves: the same tokens in float32 (f32 file), and close to it from Q8_0 codes."""
    import subprocess
    import sys

    src = llamacpp_sources()
    if src is None:
        pytest.skip("llama.cpp's conversion scripts are not in the cache (.ci/run fetches them)")
    folder, root, _ = adapters
    out = tmp_path / f"all-{outtype}.gguf"
    subprocess.run(
        [sys.executable, str(src / "convert_lora_to_gguf.py"), "--base", str(folder),
         "--outfile", str(out), "--outtype", outtype, str(root / "all")],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    lora_llm.load_lora(f"gguf-{outtype}", str(out))
    try:
        for ids in PROMPTS:
            want = lora_llm.generate([ids], greedy(10), use_tqdm=False, lora="all")
            got = lora_llm.generate([ids], greedy(10), use_tqdm=False, lora=f"gguf-{outtype}")
            if outtype == "f32":
                assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
            else:  # 8-bit codes of A and B: the same first tokens at least
                assert got[0].outputs[0].token_ids[:3] == want[0].outputs[0].token_ids[:3]
        tol = 0 if outtype == "f32" else 0.02
        for module in ("q_proj", "k_proj", "v_proj"):  # q and k: permuted by llama.cpp
            a = lora_llm.engine.lora("all").weights[0][module]
            b = lora_llm.engine.lora(f"gguf-{outtype}").weights[0][module]
            for x, y in ((a.a, b.a), (a.b_t(), b.b_t())):
                torch.testing.assert_close(y, x, rtol=tol, atol=tol * float(x.abs().max()))
    finally:
        lora_llm.unload_lora(f"gguf-{outtype}")


def test_gguf_files_that_are_not_lora_adapters_are_refused(lora_llm, tmp_path):
    import gguf

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type("model")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoRAError, match="not a GGUF LoRA adapter"):
        lora_llm.load_lora("g", str(path))


def test_the_cache_key_is_what_the_adapter_computes(adapters, tmp_path):
    """The same weights under two names share cached pages; other weights loaded under a
    name that served before never see its pages (the key hashes weights and scales)."""
    folder, root, _ = adapters
    llm = LLM(str(folder), dtype="float32", lora_modules=(f"x={root / 'all'}",))
    prompt = list(range(100, 164))

    def cached(name):
        out = llm.generate([prompt], greedy(2), use_tqdm=False, lora=name)[0]
        return out.num_cached_tokens

    assert cached("x") == 0 and cached("x") > 0
    llm.load_lora("twin", str(root / "all"))
    assert cached("twin") > 0  # the same adapter: the same numbers
    llm.unload_lora("x")
    llm.load_lora("x", str(root / "qv"))  # other weights under the old name
    assert cached("x") == 0
    config = json.loads((root / "all" / "adapter_config.json").read_text())
    import shutil

    shutil.copytree(root / "all", tmp_path / "alpha")
    (tmp_path / "alpha" / "adapter_config.json").write_text(
        json.dumps({**config, "lora_alpha": 2 * config["lora_alpha"]})
    )
    llm.load_lora("alpha", str(tmp_path / "alpha"))  # the same tensors, another scale
    assert cached("alpha") == 0
    llm.engine.check_idle()


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_speculation_verifies_under_the_requests_adapter(adapters, mode):
    """n-gram and draft proposals (the draft runs the base) are verified under each
    request's adapter: the tokens are those of the adapter without speculation."""
    folder, root, _ = adapters
    kw = {"spec_draft_model": str(folder)} if mode == "draft" else {}
    llm = LLM(
        str(folder),
        dtype="float32",
        speculative_mode=mode,
        spec_policy="always",
        lora_modules=(f"all={root / 'all'}", f"qv={root / 'qv'}"),
        **kw,
    )
    plain = LLM(
        str(folder), dtype="float32", lora_modules=(f"all={root / 'all'}", f"qv={root / 'qv'}")
    )
    prompts = [p * 3 for p in PROMPTS]  # repetitive: n-gram proposals find matches
    names = ["all", None, "qv"]
    got = llm.generate(prompts, greedy(16), use_tqdm=False, lora=names)
    want = plain.generate(prompts, greedy(16), use_tqdm=False, lora=names)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.engine.spec_proposed > 0
    llm.engine.check_idle()


def test_smollm2_adapter_equals_peft_unmerged_and_merged(smollm2_path, tmp_path):
    """The real SmolLM2 (its GGUF file, float32) with a peft adapter on q, v and down (random
    non-zero B): radixserve's greedy tokens and logprobs are transformers + peft's, the
    adapter unmerged and merged into the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    base.generation_config.eos_token_id = None
    torch.manual_seed(5)
    config = LoraConfig(
        r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, config).eval()
    model.save_pretrained(str(tmp_path / "ad"))
    llm = LLM(str(smollm2_path), dtype="float32", lora_modules=(f"ad={tmp_path / 'ad'}",))
    prompts = [llm.engine.tokenize(t) for t in ("The capital of France is", "def fib(n):")]
    unmerged = [hf_greedy_logprobs(model, ids, 8) for ids in prompts]
    merged_model = model.merge_and_unload()
    merged = [hf_greedy_logprobs(merged_model, ids, 8)[0] for ids in prompts]
    outs = llm.generate(prompts, greedy(8, logprobs=0), use_tqdm=False, lora="ad")
    base_outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    for out, (want, want_lp), want_merged in zip(outs, unmerged, merged, strict=True):
        got = out.outputs[0]
        assert got.token_ids == want == want_merged
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(want_lp, abs=2e-3)
    assert [o.outputs[0].token_ids for o in base_outs] != [u[0] for u in unmerged]
    llm.engine.check_idle()


def test_kv_tiers_keep_adapters_apart_across_a_restart(adapters, tmp_path):
    """Pages an adapter computed go to the host and disk tiers under its namespace: after
    a restart they serve that adapter again (a disk hit), never another adapter, whose
    tokens are those it computes alone."""
    import random

    folder, root, _ = adapters
    token_bytes = 512  # the tiny llama's KV a token in float32

    def make() -> LLM:
        return LLM(
            str(folder),
            dtype="float32",
            page_size=4,
            kv_cache_memory_gb=96 * token_bytes / 2**30,
            kv_host_gb=64 * token_bytes / 2**30,
            kv_disk_gb=0.01,
            kv_cache_dir=str(tmp_path / "kv"),
            lora_modules=(f"a={root / 'all'}", f"b={root / 'qv'}"),
        )

    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(70)]
    plain = LLM(str(folder), dtype="float32", lora_modules=(f"b={root / 'qv'}",))
    want_b = plain.generate([prompt], greedy(8), use_tqdm=False, lora="b")[0].outputs[0]
    first = make()
    want_a = first.generate([prompt], greedy(8), use_tqdm=False, lora="a")[0].outputs[0]
    first.engine.close()  # persists what the tree holds
    second = make()  # a restart
    b = second.generate([prompt], greedy(8), use_tqdm=False, lora="b")[0]
    assert b.num_cached_tokens == 0 and b.outputs[0].token_ids == want_b.token_ids
    a = second.generate([prompt], greedy(8), use_tqdm=False, lora="a")[0]
    assert a.num_cached_tokens >= 64 and a.outputs[0].token_ids == want_a.token_ids
    assert second.engine.prefix_cache.tiers.disk_hit_tokens >= 64
    second.engine.check_page_accounting()
    second.engine.close()
