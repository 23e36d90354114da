"""The engine process: a plain busy loop — receive, schedule + forward (one step), send."""

from __future__ import annotations

import logging
import signal
import time

import zmq

from radixserve.api import protocol as p
from radixserve.core.radix_summary import summarize
from radixserve.core.sampling_params import SamplingParams
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.scheduler.scheduler import EngineOverloaded

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
IDLE_POLL_MS = 50


def _stats(engine: Engine) -> p.EngineStats:
    s = engine.scheduler
    cache = engine.prefix_cache
    return p.EngineStats(
        running=len(s.running),
        waiting=len(s.waiting),
        kv_pages_total=engine.pool.num_pages,
        kv_pages_free=engine.pool.num_free,
        cache_hit_tokens=cache.hit_tokens if cache else 0,
        cache_queried_tokens=cache.queried_tokens if cache else 0,
        preemptions=s.stats.num_preemptions,
        steps=engine.num_steps,
        kv_pages_evictable=cache.evictable_pages if cache else 0,
        kv_pages_protected=cache.protected_pages if cache else 0,
        radix_nodes=cache.num_nodes if cache else 0,
    )


def _radix_summary(engine: Engine, query: p.RadixQuery) -> p.RadixSummary:
    """A bounded summary of the prefix cache, timed (it runs on the engine loop)."""
    started = time.perf_counter()
    cache = engine.prefix_cache
    if cache is None:
        return p.RadixSummary(query.query_id, [], 0, 0, 0, 0, 0, engine.pool.page_size, False, 0.0)
    try:
        s = summarize(cache, max_nodes=query.max_nodes, max_depth=query.max_depth)
    except ValueError as exc:
        return p.RadixSummary(query.query_id, [], 0, 0, 0, 0, 0, 0, False, 0.0, str(exc))
    cost_ms = (time.perf_counter() - started) * 1e3
    return p.RadixSummary(
        query.query_id,
        s.nodes,
        s.namespaces,
        s.total_nodes,
        s.total_tokens,
        s.evictable_pages,
        s.protected_pages,
        s.page_size,
        s.truncated,
        cost_ms,
    )


def flush_cache(engine: Engine, query_id: int) -> p.CacheFlushed:
    """The debug flush: at idle, check the page accounting, then empty the radix tree and
    count the free pages (all of them, unless some leaked). Busy: nothing is touched."""
    pool, cache = engine.pool, engine.prefix_cache
    nodes = cache.num_nodes if cache is not None else 0
    if engine.has_unfinished():
        return p.CacheFlushed(query_id, False, pool.num_pages, pool.num_free, nodes)
    error = None
    try:
        engine.check_page_accounting()
        if cache is not None and cache.protected_pages:
            error = f"{cache.protected_pages} radix pages still locked at idle"
    except AssertionError as exc:
        error = f"page accounting: {exc}"
    if cache is not None:
        cache.reset()
    pool.flush()
    return p.CacheFlushed(query_id, True, pool.num_pages, pool.num_free, nodes, error)


def run_engine_process(config: EngineConfig, inbox: str, outbox: str) -> int:
    """Entry point of the engine process: load the model, then loop until SIGTERM."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when to stop
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(inbox)
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    engine = Engine(config, detokenize=False)  # the frontend detokenizes
    push.send(
        p.encoder.encode(p.Ready(engine.source.name, engine.vocab_size, engine.max_model_len))
    )
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_beat = 0.0
    exit_code = 0
    while not stopping:
        timeout = 0 if engine.has_unfinished() else IDLE_POLL_MS
        if poller.poll(timeout):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                for msg in p.to_engine_decoder.decode(raw):
                    _handle(engine, msg, push)
        deltas = engine.step() if engine.has_unfinished() else engine.check_device()
        now = time.monotonic()
        if deltas:
            msg = p.Outputs([wire_delta(d) for d in deltas], _stats(engine))
            push.send(p.encoder.encode(msg))
            last_beat = now
        elif now - last_beat >= HEARTBEAT_S:
            push.send(p.encoder.encode(p.Heartbeat(_stats(engine))))
            last_beat = now
        if engine.fatal_error is not None:  # e.g. a tensor-parallel rank died
            logger.error("%s", engine.fatal_error)
            exit_code = 1
            break
    engine.close()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()
    return exit_code


def _handle(engine: Engine, msg: p.ToEngine, push: zmq.Socket) -> None:
    if isinstance(msg, p.AbortRequest):
        engine.abort(msg.request_id, msg.index)
        return
    if isinstance(msg, p.RadixQuery):
        push.send(p.encoder.encode(_radix_summary(engine, msg)))
        return
    if isinstance(msg, p.FlushCache):
        push.send(p.encoder.encode(flush_cache(engine, msg.query_id)))
        return
    try:
        params = SamplingParams(**msg.params)
        engine.add_request(
            msg.request_id,
            msg.prompt_token_ids,
            params,
            cache_salt=msg.cache_salt,
            priority=msg.priority,
        )
    except EngineOverloaded as exc:
        push.send(p.encoder.encode(p.Rejected(msg.request_id, str(exc), overloaded=True)))
    except (ValueError, TypeError) as exc:
        push.send(p.encoder.encode(p.Rejected(msg.request_id, str(exc))))


def wire_delta(d) -> p.Delta:
    return p.Delta(
        d.request_id,
        d.index,
        d.new_token_ids,
        d.text,
        d.finished,
        d.finish_reason,
        d.error,
        d.num_prompt_tokens,
        d.num_cached_tokens,
        [(lp.token_id, lp.logprob, lp.top) for lp in d.logprobs] if d.logprobs else None,
        d.queue_time_s,
        [(lp.token_id, lp.logprob, lp.top) for lp in d.prompt_logprobs]
        if d.prompt_logprobs
        else None,
    )


def main() -> None:
    """``python -m radixserve.api.engine_process CONFIG_JSON INBOX OUTBOX`` (JSON, not pickle)."""
    import dataclasses
    import json
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    raw, inbox, outbox = sys.argv[1:4]
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in json.loads(raw).items() if k in fields})
    sys.exit(run_engine_process(config, inbox, outbox))


if __name__ == "__main__":
    main()
