"""KV tiers in the engine (tiny random llama, float32): greedy tokens equal with tiers on and
off across demote/promote cycles, preemption and aborts around promotions, a restart on the
disk tier, corrupt and foreign records, a full disk tier. Every scenario ends with the
per-tier page accounting."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve import LLM
from radixserve.engine.config import EngineConfig
from tests.helpers import greedy

# The tiny llama's KV: 512 bytes a token (2 layers x K,V x 2 kv heads x 16 x float32).
TOKEN_BYTES = 512


def _gb(tokens: int) -> float:
    return tokens * TOKEN_BYTES / 2**30


def _llm(path, pool_tokens: int, page_size: int = 4, **kw) -> LLM:
    return LLM(
        str(path), dtype="float32", kv_cache_memory_gb=_gb(pool_tokens), page_size=page_size, **kw
    )


def _conversations(seed: int, sessions: int, first: int, turn: int, turns: int):
    rng = random.Random(seed)
    starts = [[rng.randrange(3, 500) for _ in range(first)] for _ in range(sessions)]
    adds = [[[rng.randrange(3, 500) for _ in range(turn)] for _ in range(turns)] for _ in starts]
    return starts, adds


def _chat(llm: LLM, starts, adds, max_tokens: int = 6) -> list[list[int]]:
    """Sessions take turns; each turn resends the whole conversation plus a new message."""
    convs = [list(s) for s in starts]
    outs: list[list[int]] = []
    for turn in range(len(adds[0]) + 1):
        for s, conv in enumerate(convs):
            if turn:
                conv.extend(adds[s][turn - 1])
            out = llm.generate([conv], greedy(max_tokens), use_tqdm=False)[0].token_ids
            llm.engine.check_page_accounting()
            outs.append(out)
            conv.extend(out)
    return outs


@pytest.mark.parametrize(
    ("page_size", "kv_cache_dtype"),
    [pytest.param(4, "auto", marks=pytest.mark.slow), (16, "auto"), (16, "int8")],
)
def test_multi_turn_same_tokens_tiers_on_and_off(tiny_llama, page_size, kv_cache_dtype):
    """Conversations about 3x the pool: without tiers every turn recomputes; with a host tier
    the history comes back from it (the pool demotes and promotes many times). An int8
    cache's pages come back with their scales."""
    starts, adds = _conversations(page_size, sessions=4, first=45, turn=13, turns=3)
    # 160 tokens; an int8 token: 2 layers x K,V x 2 kv heads x (16 codes + a float32 scale)
    pool = 160 if kv_cache_dtype == "auto" else 160 * 160 // TOKEN_BYTES
    kw = {"kv_cache_dtype": kv_cache_dtype}
    expected = _chat(
        _llm(tiny_llama, pool, page_size, disable_radix_cache=True, **kw), starts, adds
    )
    llm = _llm(tiny_llama, pool, page_size, kv_host_gb=_gb(2000), **kw)
    assert _chat(llm, starts, adds) == expected
    tiers = llm.engine.prefix_cache.tiers
    assert tiers.demoted_pages > 20 and tiers.promoted_pages > 20
    stats = llm.engine.stats()
    assert stats.cache_hit_tokens_host > 0 and stats.kv_host_pages_total > 0
    llm.engine.check_idle()
    assert llm.engine.prefix_cache.host.num_free == llm.engine.prefix_cache.host.num_slots


@pytest.mark.slow  # ~50 s on the loaded 2-core machine
def test_batched_with_preemption_and_aborts_around_promotions(tiny_llama):
    """Promotion is synchronous in the scheduler step (pages copied while admitting). Many
    requests at once over a pool of a few: admissions promote, decodes preempt, and an
    abort lands right after a promoting admission; survivors' tokens equal the solo ones."""
    rng = random.Random(7)
    base = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[*base[: 8 + 4 * i], *[rng.randrange(3, 500) for _ in range(6)]] for i in range(8)]
    params = greedy(10)
    off = _llm(tiny_llama, 120, disable_radix_cache=True)
    expected = [off.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    # conservativeness 0: admit what fits now, so decodes run out of pages and preempt
    llm = _llm(tiny_llama, 120, kv_host_gb=_gb(4000), schedule_conservativeness=0.0)
    engine = llm.engine
    for p in prompts:  # warm: everything ends up demoted as the others run
        llm.generate([p], params, use_tqdm=False)
    promoted_before = engine.prefix_cache.tiers.promoted_pages
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    engine.add_request("victim", prompts[3], params)
    outs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.token_ids)
        steps += 1
        if steps == 1:
            engine.abort("victim")  # admitted (with a promotion) in this very step
        engine.check_page_accounting()
    assert [outs[f"r{i}"] for i in range(8)] == expected
    assert engine.prefix_cache.tiers.promoted_pages > promoted_before
    assert engine.scheduler.stats.num_preemptions > 0
    engine.check_idle()


def _disk_llm(path, folder: Path, pool: int = 96, host: int = 64, disk_gb: float = 0.01):
    return _llm(path, pool, kv_host_gb=_gb(host), kv_disk_gb=disk_gb, kv_cache_dir=str(folder))


def test_restart_answers_from_disk_and_skips_corrupt_records(tiny_llama, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(70)] for _ in range(4)]
    params = greedy(8)
    off = _llm(tiny_llama, 96, disable_radix_cache=True)
    expected = [off.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    first = _disk_llm(tiny_llama, tmp_path)
    assert [first.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts] == expected
    first.engine.check_page_accounting()
    first.engine.close()  # persists what the tree holds

    second = _disk_llm(tiny_llama, tmp_path)  # a restart
    out = second.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.token_ids == expected[0]
    assert second.engine.prefix_cache.tiers.disk_hit_tokens >= 64
    assert out.num_cached_tokens >= 64
    stats = second.engine.stats()
    assert stats.cache_hit_tokens_disk >= 64 and stats.kv_disk_promoted_pages >= 16
    assert stats.kv_tier_bytes_moved >= 16 * 4 * TOKEN_BYTES and stats.kv_disk_records >= 68
    from radixserve.serving.metrics import Metrics

    text = Metrics(lambda: stats).render().decode()
    assert (
        f'radixserve_prefix_cache_tier_hits_total{{tier="disk"}} {float(stats.cache_hit_tokens_disk)}'
        in text
    )
    assert 'radixserve_kv_tier_pages_total{direction="promote_disk_to_pool"}' in text
    assert "radixserve_kv_tier_bytes_total" in text and "radixserve_kv_tier_seconds_total" in text
    second.engine.check_page_accounting()
    second.engine.close()

    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    records = sorted(folder.glob("*.kv"))
    assert len(records) >= 4 * 17
    for i, record in enumerate(records):  # flip a payload byte, truncate, or empty them
        data = bytearray(record.read_bytes())
        if i % 3 == 0:
            data[-1] ^= 0xFF
        elif i % 3 == 1:
            data = data[: len(data) // 2]
        else:
            data = data[:10]
        record.write_bytes(bytes(data))
    third = _disk_llm(tiny_llama, tmp_path)
    assert [third.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts] == expected
    disk = third.engine.kv_transfer.disk
    assert third.engine.prefix_cache.tiers.disk_hit_tokens == 0
    assert disk.num_corrupt >= 1
    third.engine.check_page_accounting()
    third.engine.close()


def test_another_model_never_reads_the_records(tiny_llama, tiny_models, tmp_path):
    """A second model (other weights, same shapes) on the same folder: its own identity
    folder; a record copied into it from the first model's fails the identity check."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(70)]
    params = greedy(8)
    a = _disk_llm(tiny_llama, tmp_path)
    a.generate([prompt], params, use_tqdm=False)
    a.engine.close()
    other = tiny_models["mistral"]
    expected = _llm(other, 96, disable_radix_cache=True).generate([prompt], params, use_tqdm=False)
    b = _disk_llm(other, tmp_path)
    b_folder = b.engine.kv_transfer.disk.folder
    a_folder = next(p for p in tmp_path.iterdir() if p.is_dir() and p != b_folder)
    for record in a_folder.glob("*.kv"):  # same prefix hashes: names the lookup would find
        (b_folder / record.name).write_bytes(record.read_bytes())
    b.engine.close()
    b = _disk_llm(other, tmp_path)
    assert b.engine.kv_transfer.disk.num_records > 0
    out = b.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == expected[0].token_ids
    assert b.engine.prefix_cache.tiers.disk_hit_tokens == 0
    assert b.engine.kv_transfer.disk.num_corrupt >= 1
    b.engine.check_page_accounting()
    b.engine.close()


def test_full_disk_tier_stays_within_its_limit(tiny_llama, tmp_path):
    """A disk tier of about 12 records under a workload of ~60 pages: the oldest records
    go, the folder never exceeds the limit, answers stay right."""
    record = 4096 + 4 * TOKEN_BYTES  # header + a page of 4 tokens
    starts, adds = _conversations(11, sessions=4, first=40, turn=8, turns=2)
    expected = _chat(_llm(tiny_llama, 64, disable_radix_cache=True), starts, adds)
    llm = _disk_llm(tiny_llama, tmp_path, pool=64, host=16, disk_gb=12 * record / 2**30)
    assert _chat(llm, starts, adds) == expected
    disk = llm.engine.kv_transfer.disk
    assert llm.engine.prefix_cache.tiers.spilled_pages > 12
    disk.drain()
    disk.check()  # index == files, within the limit
    assert 0 < disk.used_bytes <= disk.limit_bytes and disk.num_records <= 12
    llm.engine.close()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_host_gb": 0.1, "disable_radix_cache": True}, "radix cache"),
        ({"kv_host_gb": 0.1, "enable_overlap": True}, "serial loop"),
        ({"kv_host_gb": 0.1, "tensor_parallel_size": 2}, "tensor parallelism"),
        ({"kv_host_gb": 0.1, "simulated_device": True}, "simulated"),
        ({"kv_disk_gb": 1.0}, "kv_cache_dir"),
        ({"kv_cache_dir": "x", "disable_radix_cache": True}, "radix cache"),
        ({"kv_host_gb": -1.0}, ">= 0"),
    ],
)
def test_tier_flags_refused_where_unsupported(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_a_cache_folder_alone_turns_the_tiers_on_at_sizes_from_free_space(tmp_path, caplog):
    import shutil

    from radixserve.engine import config as cfg

    folder = tmp_path / "not" / "made" / "yet"
    with caplog.at_level("INFO", "radixserve.engine.config"):
        c = EngineConfig(kv_cache_memory_gb=0.5, kv_cache_dir=str(folder))
    assert c.tiers and c.kv_host_gb > 0 and c.kv_disk_gb > 0
    assert c.kv_host_gb <= cfg.KV_HOST_AUTO_KV_MULTIPLE * 0.5
    free_gb = shutil.disk_usage(tmp_path).free / 2**30
    assert c.kv_disk_gb <= min(cfg.KV_DISK_AUTO_SHARE * free_gb * 1.01, cfg.KV_DISK_AUTO_MAX_GB)
    assert "kv_cache_dir without sizes" in caplog.text and "kv_disk_gb" in caplog.text
    # sizes given are kept; one given, the other chosen
    given = EngineConfig(kv_host_gb=0.25, kv_disk_gb=2.0, kv_cache_dir=str(folder))
    assert (given.kv_host_gb, given.kv_disk_gb) == (0.25, 2.0)
    half = EngineConfig(kv_host_gb=0.25, kv_cache_dir=str(folder))
    assert half.kv_host_gb == 0.25 and half.kv_disk_gb > 0
    # the engine process gets the chosen sizes (its config is rebuilt from the fields)
    again = EngineConfig(**{f: getattr(c, f) for f in ("kv_host_gb", "kv_disk_gb", "kv_cache_dir")})
    assert (again.kv_host_gb, again.kv_disk_gb) == (c.kv_host_gb, c.kv_disk_gb)
