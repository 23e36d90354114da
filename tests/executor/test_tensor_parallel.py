"""Tensor parallelism: the shard layout, the parallel model against the whole one (ranks as
threads), and TP=2 engines over gloo (worker processes) against TP=1 and transformers."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.executor.attention import TorchNativeAttention
from radixserve.executor.forward_batch import ForwardBatch
from radixserve.executor.kv_cache import KVCache
from radixserve.executor.loader.dummy import dummy_weights
from radixserve.executor.loader.safetensors_loader import read_hf_config
from radixserve.executor.loader.sharded import ShardLayout
from radixserve.executor.model_config import ModelConfig
from radixserve.executor.models.llama import LlamaForCausalLM
from tests.conftest import build_tiny_model
from tests.helpers import generate_ids, greedy, hf_greedy

pytestmark = pytest.mark.slow  # starts process groups (pytest -m "not slow" leaves it out)

NEW_TOKENS = 16


def _config(heads: int, kv_heads: int, **kw) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=101,
        hidden_size=8 * heads,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
    )
    base.update(kw)
    return ModelConfig(**base)


# -- layout --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "kv_heads", "n", "expected"),
    [
        (4, 2, 2, [[0], [1]]),  # kv heads split
        (4, 1, 2, [[0], [0]]),  # one kv head: replicated
        (4, 2, 4, [[0], [0], [1], [1]]),  # fewer kv heads than ranks: replicated
        (12, 3, 2, [[0, 0, 1], [1, 2, 2]]),  # a kv group straddles ranks: per-pair copies
        (8, 8, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # multi-head attention
    ],
)
def test_kv_heads_per_rank(heads, kv_heads, n, expected):
    layouts = [ShardLayout(_config(heads, kv_heads), r, n) for r in range(n)]
    assert [lay.kv_head_ids for lay in layouts] == expected
    group = heads // kv_heads
    for lay in layouts:  # local query head j reads local kv head j // kv_group: the same one
        for j in range(lay.heads):
            assert lay.kv_head_ids[j // lay.kv_group] == (lay.head_start + j) // group


def test_a_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        ShardLayout(_config(4, 2), 0, 3)


class _ThreadGroup:
    """The collectives of a group whose ranks are threads of this process (sums in rank
    order, so every rank gets the same bits)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def rank_view(self, rank: int) -> _RankGroup:
        return _RankGroup(self, rank)


class _RankGroup:
    def __init__(self, shared: _ThreadGroup, rank: int) -> None:
        self.shared, self.rank, self.world_size = shared, rank, shared.world_size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        s = self.shared
        s.slots[self.rank] = tensor.clone()
        s.barrier.wait()
        parts = list(s.slots)
        s.barrier.wait()
        return parts  # type: ignore[return-value]

    def all_reduce(self, tensor: torch.Tensor) -> None:
        parts = self._exchange(tensor)
        tensor.copy_(torch.stack(parts).sum(0))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._exchange(tensor)


def _prefill_batch(lengths: list[int], page_size: int) -> ForwardBatch:
    """Fresh prompts of the given lengths, pages allocated in order."""
    pages_each = [-(-n // page_size) for n in lengths]
    table = np.zeros((len(lengths), max(pages_each)), dtype=np.int64)
    next_page = 0
    for i, n in enumerate(pages_each):
        table[i, :n] = np.arange(next_page, next_page + n)
        next_page += n
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    token_req = np.repeat(np.arange(len(lengths)), lengths)
    slots = table[token_req, positions // page_size] * page_size + positions % page_size
    rng = np.random.default_rng(0)
    return ForwardBatch(
        input_ids=rng.integers(0, 100, size=int(qsl[-1])).astype(np.int64),
        positions=positions,
        slot_mapping=slots,
        q_lens=np.array(lengths, dtype=np.int64),
        seq_lens=np.array(lengths, dtype=np.int64),
        query_start_loc=qsl,
        page_tables=table,
        logits_indices=qsl[1:] - 1,
        page_size=page_size,
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "n", "extra"),
    [
        (4, 2, 2, {}),
        (4, 2, 4, {"qk_norm": True, "head_dim": 16}),  # kv heads replicated, q/k norm
        (12, 3, 2, {"attention_bias": True, "tie_word_embeddings": True}),  # straddling groups
        (6, 2, 3, {"vocab_size": 100, "intermediate_size": 70}),  # uneven MLP and vocab
    ],
)
def test_parallel_model_equals_the_whole_model(heads, kv_heads, n, extra):
    """Every rank's forward (threads here) returns the whole model's hidden states and
    logits, for layouts the engine tests do not reach (N = 3, 4; replicated kv heads)."""
    config = _config(heads, kv_heads, **extra)
    torch.manual_seed(0)
    full = dummy_weights(config, torch.float32, seed=1)
    for _name, t in full.items():  # non-trivial norms and biases
        if t.dim() == 1:
            t.uniform_(0.5, 1.5)
    page_size = 4
    batch = _prefill_batch([5, 9, 1], page_size)
    num_pages = int(batch.page_tables.max()) + 1
    ids, pos = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.positions)
    rows = torch.from_numpy(batch.logits_indices)

    def run(model, kv_heads_local: int, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = KVCache(2, num_pages, page_size, kv_heads_local, config.head_dim, torch.float32)
        attention = TorchNativeAttention(cache, q_heads, config.head_dim)
        hidden = model.forward(ids, pos, attention, attention.prepare(batch))
        return hidden, model.compute_logits(hidden[rows])

    whole = LlamaForCausalLM(config, {k: v.clone() for k, v in full.items()}, torch.float32)
    ref_hidden, ref_logits = run(whole, kv_heads, heads)
    group = _ThreadGroup(n)
    results: list = [None] * n

    def rank_main(rank: int) -> None:
        layout = ShardLayout(config, rank, n)
        shard = {name: layout.shard_tensor(name, t) for name, t in full.items()}
        model = LlamaForCausalLM(
            layout.local_config(),
            shard,
            torch.float32,
            tp=layout.tensor_parallel(group.rank_view(rank)),
        )
        results[rank] = run(model, layout.kv_heads, layout.heads)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for hidden, logits in results:
        torch.testing.assert_close(hidden, ref_hidden, rtol=1e-4, atol=1e-4)
        assert logits.shape == ref_logits.shape
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


# -- TP=2 engines (worker processes, gloo) ------------------------------------------------------
def _prompts(seed: int, vocab: int) -> list[list[int]]:
    """Prompts sharing a prefix in pairs (radix hits), long enough to be chunked."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for n in (1, 7, 33, 50, 20, 61):
        tail = [rng.randrange(3, vocab) for _ in range(n)]
        out += [tail, shared + tail]
    return out


ARCHS = {
    # GQA, an untied LM head and a vocabulary of 509 (not divisible by 2)
    "llama": {"vocab_size": 509},
    "qwen2": {"tie_word_embeddings": True},  # q/k/v bias, tied embeddings
    "qwen3": {},  # q/k norm, head_dim 32
    "gemma3": {},  # four norms, sliding layers (window 12), two rotary bases, GeGLU
    "phi3": {},  # fused qkv and gate_up cut per rank, LongRoPE
}


@pytest.fixture(scope="module", params=list(ARCHS))
def tp_case(request, tmp_path_factory):
    """One TP=2 engine per model, shared by the tests below: chunked prefill (64-token
    budget), 4-token pages and a pool that forces preemption when all prompts run at once."""
    arch = request.param
    path = build_tiny_model(tmp_path_factory.mktemp(f"tp-{arch}"), arch, **ARCHS[arch])
    vocab = ARCHS[arch].get("vocab_size", 512)
    prompts = _prompts(len(arch), vocab)
    config = ModelConfig.from_hf_dict(read_hf_config(path))
    # (k, v) x layers x 4 tokens x 1 kv head per rank x head_dim, float32
    page_bytes = 2 * config.num_hidden_layers * 4 * config.head_dim * 4
    kwargs = dict(
        dtype="float32",
        page_size=4,
        max_num_batched_tokens=64,
        kv_cache_memory_gb=40 * page_bytes / 2**30,  # 40 pages per rank: the longest needs 30
        schedule_conservativeness=0.0,
    )
    llm = LLM(str(path), tensor_parallel_size=2, **kwargs)
    yield arch, path, prompts, llm
    llm.engine.close()
    for proc in llm.engine.tp.procs.values():
        assert proc.returncode == 0


def test_tp2_greedy_equals_tp1_and_transformers(tp_case):
    _arch, path, prompts, llm = tp_case
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    single = LLM(str(path), dtype="float32", page_size=4, max_num_batched_tokens=64)
    assert generate_ids(single, prompts, greedy(NEW_TOKENS)) == expected
    engine = llm.engine
    assert engine.model.config.num_attention_heads == engine.model_config.num_attention_heads // 2
    # one at a time on a warm tree: every second prompt extends the one before it (a hit)
    hits = engine.prefix_cache.hit_tokens
    alone = [llm.generate([p], greedy(NEW_TOKENS), use_tqdm=False)[0] for p in prompts]
    assert [out.outputs[0].token_ids for out in alone] == expected
    assert engine.prefix_cache.hit_tokens - hits >= 5 * 40  # the shared 40-token prefix
    engine.check_idle()
    # all at once: chunked prefill, and the small pool preempts
    preempted = engine.scheduler.stats.num_preemptions
    assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected  # checks page accounting
    assert engine.scheduler.stats.num_preemptions > preempted


def test_tp2_logprobs_equal_tp1(tp_case):
    """Sampled-row and prompt logprobs (gathered logits, in chunks) match TP=1."""
    _arch, path, prompts, llm = tp_case
    single = LLM(str(path), dtype="float32", page_size=4, max_num_batched_tokens=64)
    params = SamplingParams(
        temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
    )
    a = single.generate(prompts[2:5], params, use_tqdm=False)
    b = llm.generate(prompts[2:5], params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert lx.token_id == ly.token_id
            assert lx.logprob == pytest.approx(ly.logprob, abs=1e-4)
            assert [t for t, _ in lx.top] == [t for t, _ in ly.top]
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            assert px.logprob == pytest.approx(py.logprob, abs=1e-4)
    llm.engine.check_idle()


def test_gguf_shards_equal_tp1(tmp_path):
    """A GGUF file (llama q/k rows permuted in the file) sharded per tensor on load."""
    from tests.executor.test_quant import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "F32")
    prompts = [[(7 * i + 3 * j) % 250 for j in range(5 + 9 * i)] for i in range(4)]
    single = LLM(str(path), dtype="float32")
    expected = generate_ids(single, prompts, greedy(NEW_TOKENS))
    tp = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        assert generate_ids(tp, prompts, greedy(NEW_TOKENS)) == expected
    finally:
        tp.engine.close()


def test_a_size_that_does_not_divide_the_heads_fails_at_start(tiny_llama):
    with pytest.raises(ValueError, match="does not divide"):
        LLM(str(tiny_llama), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="not a multiple of nnodes"):
        LLM(str(tiny_llama), tensor_parallel_size=3, nnodes=2, master_port=1)


def test_a_killed_rank_fails_the_requests_and_stops_the_engine(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=2)
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * 20, greedy(200))
    for _ in range(3):
        engine.step()
    worker = engine.tp.procs[1]
    worker.kill()
    worker.wait()
    finals = {}
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        for delta in engine.step():
            if delta.finished:
                finals[delta.request_id] = delta
    assert sorted(finals) == ["r0", "r1", "r2"]
    for delta in finals.values():
        assert delta.finish_reason == "error"
        assert "tensor-parallel rank 1 exited" in delta.error
    assert engine.fatal_error is not None
    with pytest.raises(RuntimeError, match="engine stopped"):
        engine.add_request("late", [5, 6], greedy(4))
    engine.close()


_RANK0 = """
import sys
import time

from radixserve import LLM
from tests.helpers import greedy

llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2, distributed_timeout_s=8.0)
llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)
print(llm.engine.tp.procs[1].pid, flush=True)
time.sleep(600)
"""


def test_workers_exit_when_rank0_goes_silent_or_dies(tiny_llama):
    """A stopped rank 0 (no heartbeat): the worker times out and exits; a killed one: the
    worker sees its connections close (or its parent gone) and exits. (The timeout is 8 s:
    with 3 s, a slow machine's rank 0 once took longer than that to send its first step
    after rank 1 was ready, and rank 1 left before the test began.)"""
    for how in ("stop", "kill"):  # one pair at a time: two at once missed their timeout
        rank0 = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_RANK0), str(tiny_llama)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        )
        try:
            worker_pid = int(rank0.stdout.readline())
            start = time.monotonic()
            os.kill(rank0.pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            while _alive(worker_pid) and time.monotonic() - start < 30:
                time.sleep(0.2)
            assert not _alive(worker_pid), f"rank 1 still running 30 s after rank 0 {how}"
        finally:
            rank0.kill()
            rank0.wait()


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # not our child: raises
    except ChildProcessError:
        waited = 0
    if waited:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def test_two_nodes_on_one_machine(tiny_llama):
    """``--nnodes 2``: node 1 is `radixserve serve --node-rank 1`, running its rank only."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "-tp",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            str(port),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    try:
        prompts = [[5, 6, 7, 8], [9] * 30]
        single = LLM(str(tiny_llama), dtype="float32")
        expected = generate_ids(single, prompts, greedy(NEW_TOKENS))
        llm = LLM(
            str(tiny_llama),
            dtype="float32",
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=0,
            master_port=port,
        )
        assert llm.engine.tp.procs == {}  # rank 1 lives on "node 1"
        assert generate_ids(llm, prompts, greedy(NEW_TOKENS)) == expected
        llm.engine.close()
        assert node1.wait(30) == 0
    finally:
        node1.kill()
        node1.wait()


def test_parallel_flags_reach_the_engine_config():
    from radixserve.cli import build_parser, engine_kwargs
    from radixserve.engine.config import EngineConfig

    flags = "-tp 4 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500"
    args = build_parser().parse_args(["serve", "--device", "cpu", *flags.split()])
    c = EngineConfig(**engine_kwargs(args))
    assert (c.tensor_parallel_size, c.nnodes, c.node_rank) == (4, 2, 1)
    assert (c.master_addr, c.master_port, c.distributed_timeout_s) == ("10.0.0.1", 29500, 300.0)
    with pytest.raises(ValueError, match="needs master_port"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, device="cpu")
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1, device="cpu")
