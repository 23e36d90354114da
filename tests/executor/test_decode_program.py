"""The one-call decode program (executor/decode_program.py) against the op-by-op forward."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM
from radixserve.executor import decode_program, native
from radixserve.executor.models.llama import LlamaForCausalLM
from radixserve.executor.routed_experts import routed_experts_for
from tests.conftest import build_tiny_model
from tests.executor.test_gguf_codes import (
    LAYER_TENSORS,
    MIXED,
    NEW_TOKENS,
    TIE_MARGIN,
    _hf_top,
    write_gguf,
)
from tests.executor.test_gguf_codes import PROMPTS as HF_PROMPTS
from tests.helpers import greedy, hf_greedy

PROMPTS = [[5, 17, 101, 9], [200, 3], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def _run_both(
    monkeypatch, llm: LLM, together: bool = False, lora: list[str | None] | None = None
) -> dict[str, int]:
    """Generates the prompts (each alone: decode steps of one row; or ``together``: steps
    of up to four rows, fewer as the shorter requests finish) with every pure decode step
    run twice, through the program and op by op (the second writes the same KV again), and
    asserts the hidden states are equal bit for bit. Returns the step counts."""
    seen = {"decode": 0, "program": 0, "rows": 0}
    cls = type(llm.engine.runner.model)
    forward = cls.forward

    def both(self, input_ids, positions, attention, meta):
        program = decode_program.program_for(self, attention, meta)
        used = program is not None and program.accepts(input_ids, positions, meta, self.lora_step)
        out = forward(self, input_ids, positions, attention, meta)
        d = meta.decode
        if d is not None and d.whole_batch and d.one_per_request:  # (an int8 cache's prompts
            seen["decode"] += 1  # are rows of the decode kernel too: not decode steps)
        if used:
            seen["program"] += 1
            seen["rows"] = max(seen["rows"], input_ids.shape[0])
            self._program = None  # built for this backend: the op-by-op path
            try:
                plain = forward(self, input_ids, positions, attention, meta)
            finally:
                self._program = program
            assert torch.equal(out, plain), (out.float() - plain.float()).abs().max()
        return out

    with monkeypatch.context() as patch:
        patch.setattr(cls, "forward", both)
        if together:  # different lengths: the batch shrinks as requests finish
            params = [greedy(6 + 3 * i, logprobs=2) for i in range(len(PROMPTS))]
            llm.generate(PROMPTS, params, use_tqdm=False, lora=lora)
            llm.engine.check_idle()
        else:
            for prompt in PROMPTS:
                llm.generate([prompt], greedy(9, logprobs=2), use_tqdm=False)
                llm.engine.check_idle()  # every page back
    return seen


@pytest.mark.parametrize("types", ["Q4_1", "Q8_0", "mixed"])
def test_program_equals_op_by_op(tmp_path, monkeypatch, types):
    """A tiny GGUF file run by ``auto`` (int4 panels, int8 group panels, or both in one
    model, tied Q8_0 head): every decode step, of one row and of several, goes through the
    program, and its hidden states equal the op-by-op forward's exactly."""
    table = MIXED if types == "mixed" else {name: types for name in LAYER_TENSORS}
    path = write_gguf(tmp_path / f"tiny-{types}.gguf", table, tied="Q8_0")
    _check_both_ways(monkeypatch, LLM(str(path)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_program_equals_op_by_op_on_requantized_int4(tiny_models, monkeypatch, arch):
    """A tiny Hugging Face model requantized to int4 panels: Llama all native; Qwen2 with
    its q/k/v biases added in the program; Gemma 3
    (sliding-window layers, both rotary bases, four norms a layer, per-head q/k norms,
    GeGLU) with its scaled embedding in PyTorch before the native call. Every decode step,
    of one row and of several (past the window), is the program's and equals the op-by-op
    forward exactly."""
    _check_both_ways(monkeypatch, LLM(str(tiny_models[arch]), quantization="int4"))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_program_equals_op_by_op_with_an_int8_kv_cache(tiny_models, monkeypatch, arch):
    """``kv_cache_dtype="int8"``: the program writes the step's keys and values as int8
    codes and scales (the C writer the op-by-op path uses too) and decodes over them
    (``paged_decode_i8_bf16``), sliding windows included; equal to op by op exactly."""
    llm = LLM(str(tiny_models[arch]), quantization="int4", kv_cache_dtype="int8")
    assert llm.engine.runner.kv_cache.quantized
    _check_both_ways(monkeypatch, llm)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe", "mixtral", "olmoe"])
def test_program_equals_op_by_op_with_qk_norms_and_experts(tmp_path, monkeypatch, arch):
    """Requantized to int4: Qwen3's per-head q/k norms, OLMoE's over the whole projection,
    and the routed experts of Qwen3-MoE (a dense layer among sparse ones), Mixtral and
    OLMoE run in the program (one ``OP_MOE`` a sparse layer) and equal the op-by-op
    forward exactly, which runs the same op through ``RoutedExperts``."""
    if decode_program.load_decode_program() is None or native.load_int4_panels() is None:
        pytest.skip("the native kernels are not built on this machine")
    overrides = {"clip_qkv": None} if arch == "olmoe" else {}  # (a clamp the program lacks)
    folder = build_tiny_model(tmp_path / arch, arch, **overrides)
    llm = LLM(str(folder), quantization="int4")
    model = llm.engine.runner.model
    sparse = [lay.moe for lay in model.layers if lay.moe is not None]
    assert (model.config.moe is not None) == bool(sparse)
    try:
        assert all(routed_experts_for(moe) is not None for moe in sparse)
    except AssertionError:
        llm.engine.close()
        raise
    _check_both_ways(monkeypatch, llm)


def _check_both_ways(monkeypatch, llm: LLM) -> None:
    """Every decode step of ``llm``, of one row and of several, goes through the program
    and equals the op-by-op forward (``_run_both``); the engine is closed after."""
    try:
        if decode_program.load_decode_program() is None or native.load_int4_panels() is None:
            pytest.skip("the native kernels are not built on this machine")
        alone = _run_both(monkeypatch, llm)
        together = _run_both(monkeypatch, llm, together=True)
    finally:
        llm.engine.close()
    # 8 decode steps a prompt, and the one-token prompt's own step (a decode step too)
    assert alone["program"] == alone["decode"] == len(PROMPTS) * 8 + 1
    assert alone["rows"] == 1
    # the longest request's decode steps, the first of them with every request in
    assert together["program"] == together["decode"] == 6 + 3 * (len(PROMPTS) - 1) - 1
    assert together["rows"] == len(PROMPTS)


def _random_peft(folder, model, seed: int, modules: tuple[str, ...], rank: int) -> str:
    """A PEFT adapter folder of random weights (non-zero B) for ``model``'s shapes."""
    import json

    from safetensors.torch import save_file

    from radixserve.executor.lora import GROUPS, LoRAShapes

    shapes = LoRAShapes.of(model.config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for group, names in GROUPS.items():
            for name in names:
                if name not in modules:
                    continue
                _, rows = shapes.out_slices(group)[name]
                part = "self_attn" if group in ("qkv", "o") else "mlp"
                p = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[p + ".lora_A.weight"] = torch.randn(
                    rank, shapes.in_size(group), generator=g
                )
                tensors[p + ".lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.2
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_program_with_lora_adapters_equals_op_by_op(tiny_models, tmp_path, monkeypatch, arch):
    """Decode steps whose rows are on three LoRA adapters and the base run in the program
    (an ``OP_LORA`` after every projection, ``native/lora.c`` reading the step's
    descriptor) and equal the op-by-op forward exactly, which calls the same kernel."""
    if native.load_lora() is None:
        pytest.skip("the native kernels are not built on this machine")
    llm = LLM(str(tiny_models[arch]), quantization="int4")
    model = llm.engine.runner.model
    all_ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for i, (modules, rank) in enumerate(
        [(all_, 8), (("q_proj", "v_proj"), 5), (("gate_proj", "down_proj", "o_proj"), 16)]
    ):
        llm.load_lora(f"a{i}", _random_peft(tmp_path / f"a{i}", model, i, modules, rank))
    try:
        seen = _run_both(monkeypatch, llm, together=True, lora=["a0", None, "a1", "a2"])
        assert seen["program"] == seen["decode"] > 0 and seen["rows"] == len(PROMPTS)
        # and the adapters change what the base would say
        outs = llm.generate(PROMPTS, greedy(6), use_tqdm=False, lora=["a0", "a1", "a2", "a0"])
        base = llm.generate(PROMPTS, greedy(6), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in base]
    finally:
        llm.engine.close()


def test_program_greedy_and_logprobs_unchanged(tmp_path, monkeypatch):
    """Tokens and logprobs of greedy generations, each prompt alone and all together,
    with the program and without it (``build`` refusing every model) are the same."""
    path = write_gguf(tmp_path / "tiny-Q4_0.gguf", {n: "Q4_0" for n in LAYER_TENSORS}, tied="Q8_0")
    llm = LLM(str(path))
    try:
        runs = []
        for refuse in (False, True):
            if refuse:
                monkeypatch.setattr(decode_program, "build", lambda model, attention: None)
            llm.engine.runner.model._program_for = None  # look again
            outs = [
                llm.generate([p], greedy(9, logprobs=3), use_tqdm=False)[0].outputs[0]
                for p in PROMPTS
            ]
            outs += [
                r.outputs[0] for r in llm.generate(PROMPTS, greedy(9, logprobs=3), use_tqdm=False)
            ]
            llm.engine.check_idle()
            used = llm.engine.runner.model._program is not None
            runs.append(
                (
                    used,
                    [
                        (o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs])
                        for o in outs
                    ],
                )
            )
    finally:
        llm.engine.close()
    (used_fast, fast), (used_plain, plain) = runs
    if decode_program.load_decode_program() is None:
        pytest.skip("the native kernels are not built on this machine")
    assert used_fast and not used_plain
    assert fast == plain


def test_steps_beyond_capacity_run_op_by_op(tmp_path, monkeypatch):
    """A program built for two rows: decode steps of up to two rows are its, steps of more
    run op by op, and each equals the op-by-op forward."""
    monkeypatch.setattr(decode_program, "MAX_ROWS", 2)
    path = write_gguf(tmp_path / "tiny-Q8_0.gguf", {n: "Q8_0" for n in LAYER_TENSORS}, tied="Q8_0")
    llm = LLM(str(path))
    try:
        if decode_program.load_decode_program() is None:
            pytest.skip("the native kernels are not built on this machine")
        seen = _run_both(monkeypatch, llm, together=True)
        assert llm.engine.runner.model._program.capacity == 2
    finally:
        llm.engine.close()
    # 15 tokens for the longest: 14 decode steps, of 4, 3, 2 and 1 rows (5 + 3 + 3 + 3)
    assert seen["decode"] == 14 and seen["program"] == 6 and seen["rows"] == 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_program_not_built_for_bfloat16_layers(tiny_models, arch):
    """A model whose dense layers are bfloat16 ``Linear``s (oneDNN; Qwen2's q/k/v with their
    biases) runs op by op."""
    llm = LLM(str(tiny_models[arch]), quantization="none")
    try:
        out = llm.generate([[5, 6, 7], [8, 9]], greedy(4), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)
        llm.engine.check_idle()
        model = llm.engine.runner.model
        assert model._program_for is not None and model._program is None
    finally:
        llm.engine.close()


def test_program_rebuilt_when_the_layers_change(tmp_path, monkeypatch):
    """Replacing a layer's linear after the program was built makes the next step build
    a new one (the old one points at the old weights)."""
    path = write_gguf(tmp_path / "tiny-Q4_1.gguf", {n: "Q4_1" for n in LAYER_TENSORS}, tied="Q8_0")
    llm = LLM(str(path))
    try:
        llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
        model = llm.engine.runner.model
        first = model._program
        if first is None:
            pytest.skip("the native kernels are not built on this machine")
        layer = model.layers[0]
        q, scale, zero = layer.down.codes()
        layer.down = type(layer.down)(q, scale, zero, layer.down.group_size)
        assert not first.matches(model)
        llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
        llm.engine.check_idle()
        assert model._program is not None and model._program is not first
        assert model._program.matches(model)
    finally:
        llm.engine.close()


def test_program_refuses_an_id_or_position_out_of_range(tmp_path, monkeypatch):
    """A token id beyond the vocabulary or a position beyond the rotary tables: the
    program raises instead of reading past a table."""
    path = write_gguf(tmp_path / "tiny-Q4_1.gguf", {n: "Q4_1" for n in LAYER_TENSORS}, tied="Q8_0")
    llm = LLM(str(path))
    steps = []
    forward = LlamaForCausalLM.forward

    def keep(self, input_ids, positions, attention, meta):
        if input_ids.shape[0] == 1:
            steps.append((input_ids.clone(), positions.clone(), meta))
        return forward(self, input_ids, positions, attention, meta)

    monkeypatch.setattr(LlamaForCausalLM, "forward", keep)
    try:
        llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
        llm.engine.check_idle()
        program = llm.engine.runner.model._program
        if program is None:
            pytest.skip("the native kernels are not built on this machine")
        ids, positions, meta = steps[-1]
        vocab = llm.engine.runner.model.config.vocab_size
        tables = llm.engine.runner.model.rotary.cos.shape[0]
        with pytest.raises(RuntimeError, match="op 0 refused"):
            program.run(torch.tensor([vocab]), positions, meta)
        with pytest.raises(RuntimeError, match="op 1 refused"):  # the rotary rows' gather
            program.run(ids, torch.tensor([tables]), meta)
    finally:
        llm.engine.close()


@pytest.mark.parametrize("types", ["Q4_1", "mixed"])
def test_batch1_greedy_equals_transformers(tmp_path, types):
    """Each prompt alone (every decode step through the program): greedy continuations
    equal transformers' (float32, the file's dequantized weights) up to the first near-tie
    of transformers' logits (``TIE_MARGIN``, as ``test_tiny_file_greedy_equals_transformers``,
    whose prompts decode together and so never reach the program); at least half the
    tokens are compared."""
    table = MIXED if types == "mixed" else {name: types for name in LAYER_TENSORS}
    path = write_gguf(tmp_path / f"tiny-{types}.gguf", table, tied="Q8_0")
    llm = LLM(str(path))
    try:
        ours = []
        for prompt in HF_PROMPTS:
            ours.append(
                llm.generate([prompt], greedy(NEW_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
            )
            llm.engine.check_idle()
        if llm.engine.runner.model._program is None:
            pytest.skip("the native kernels are not built on this machine")
    finally:
        llm.engine.close()
    theirs = hf_greedy(tmp_path, HF_PROMPTS, NEW_TOKENS, gguf_file=path.name)
    tops = _hf_top(tmp_path, path.name, [p + t for p, t in zip(HF_PROMPTS, theirs, strict=True)])
    compared = 0
    for prompt, mine, want, (_, lead) in zip(HF_PROMPTS, ours, theirs, tops, strict=True):
        gaps = lead[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]
        ties = (gaps < TIE_MARGIN).nonzero()
        cut = int(ties[0]) if len(ties) else NEW_TOKENS
        assert mine[:cut] == want[:cut], (cut, mine, want, gaps)
        compared += cut
    assert compared >= len(HF_PROMPTS) * NEW_TOKENS // 2, compared


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_program_holds_no_reference_cycle(tiny_models, arch):
    """A model and its program are freed by reference counting alone (a cycle would keep
    a closed engine's KV cache until the garbage collector ran)."""
    import gc
    import weakref

    llm = LLM(str(tiny_models[arch]), quantization="int4")
    llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    llm.engine.check_idle()
    model = llm.engine.runner.model
    if model._program is None:
        llm.engine.close()
        pytest.skip("the native kernels are not built on this machine")
    program = weakref.ref(model._program)
    gc.disable()
    try:
        model._program = None
        assert program() is None
    finally:
        gc.enable()
        llm.engine.close()
