"""The engine process: a plain busy loop — receive, schedule + forward (one step), send."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import msgspec
import zmq

from radixserve.core.errors import LoRAError, LoRANotFound
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine, EngineOverloaded
from radixserve.serving import protocol as p

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.25
IDLE_POLL_MS = 50


def _radix_summary(engine: Engine, query: p.RadixQuery) -> p.RadixSummary:
    """A bounded summary of the prefix cache, timed (it runs on the engine loop)."""
    started = time.perf_counter()
    try:
        s = engine.radix_summary(max_nodes=query.max_nodes, max_depth=query.max_depth)
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
    """``Engine.flush_cache`` as the answer to a ``FlushCache`` query."""
    r = engine.flush_cache()
    return p.CacheFlushed(
        query_id, r.idle, r.kv_pages_total, r.kv_pages_free, r.radix_nodes_before, r.error
    )


def lora_control(engine: Engine, msg: p.LoRAControl) -> p.LoRAAnswer:
    """``Engine.load_lora`` / ``unload_lora`` as the answer to a ``LoRAControl``: an
    adapter that cannot be served is an error answer, the engine runs on untouched."""
    try:
        if msg.path is None:
            engine.unload_lora(msg.name)
        else:
            engine.load_lora(msg.name, msg.path)
    except LoRANotFound as exc:
        return p.LoRAAnswer(msg.query_id, str(exc), not_found=True)
    except (LoRAError, ValueError) as exc:
        return p.LoRAAnswer(msg.query_id, str(exc))
    return p.LoRAAnswer(msg.query_id)


def decode_messages(raw: bytes, push: zmq.Socket) -> list[p.ToEngine]:
    """The messages of one frontend send. Should one of them not decode (the frontend
    checks every request, so this is a bug, not input), the others still do and a request
    that did not is rejected by id: nothing sent is left unanswered."""
    try:
        return p.to_engine_decoder.decode(raw)
    except msgspec.ValidationError:
        pass
    messages: list[p.ToEngine] = []
    for item in p.to_engine_items_decoder.decode(raw):
        try:
            messages.append(p.to_engine_item_decoder.decode(item))
        except msgspec.ValidationError as exc:
            loose = msgspec.msgpack.decode(item)
            inner = loose.get("request") if isinstance(loose, dict) else None
            request_id = inner.get("request_id") if isinstance(inner, dict) else None
            logger.error("undecodable message from the frontend: %s", exc)
            if isinstance(request_id, str) and loose.get("type") == "generate":
                push.send(p.encoder.encode(p.Rejected(request_id, f"bad request: {exc}")))
    return messages


def run_engine_process(config: EngineConfig, inbox: str, outbox: str) -> int:
    """Entry point of the engine process: load the model, then loop until SIGTERM."""
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the frontend decides when to stop
    return serve_engine(config, inbox, outbox, lambda: stopping)


def serve_engine(
    config: EngineConfig, inbox: str, outbox: str, stopping: Callable[[], bool]
) -> int:
    """Connect to the frontend's sockets, load the model, say ``Ready``, then receive,
    step and send until ``stopping()`` (or the engine's device is lost: exit code 1). The
    engine process runs this; so does an in-process engine's thread (``engine_host``)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(inbox)
    push = ctx.socket(zmq.PUSH)
    push.connect(outbox)
    try:
        engine = Engine(config, detokenize=False)  # the frontend detokenizes
    except BaseException:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        raise
    push.send(
        p.encoder.encode(
            p.Ready(
                engine.source.name,
                engine.vocab_size,
                engine.max_model_len,
                engine.inputs.defaults,
                engine.model_pooling,
                engine.model_config.hidden_size if engine.model_config is not None else 0,
                engine.matryoshka_dimensions,
            )
        )
    )
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    last_beat = 0.0
    exit_code = 0
    try:
        while not stopping():
            timeout = 0 if engine.has_unfinished() else IDLE_POLL_MS
            if poller.poll(timeout):
                while True:
                    try:
                        raw = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    for msg in decode_messages(raw, push):
                        _handle(engine, msg, push)
            deltas = engine.step() if engine.has_unfinished() else engine.check_device()
            now = time.monotonic()
            if deltas:
                msg = p.Outputs([wire_delta(d) for d in deltas], engine.stats())
                push.send(p.encoder.encode(msg))
                last_beat = now
            elif now - last_beat >= HEARTBEAT_S:
                push.send(p.encoder.encode(p.Heartbeat(engine.stats())))
                last_beat = now
            if engine.fatal_error is not None:  # e.g. a tensor-parallel rank died
                logger.error("%s", engine.fatal_error)
                exit_code = 1
                break
    finally:  # (an in-process engine's thread must let go of all of it, even on an error)
        try:
            engine.close()
        except Exception:
            logger.exception("closing the engine failed")
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
    if isinstance(msg, p.LoRAControl):
        push.send(p.encoder.encode(lora_control(engine, msg)))
        return
    request = msg.request  # built and checked by the frontend: submitted as it is
    try:
        engine.submit(request)
    except EngineOverloaded as exc:
        push.send(p.encoder.encode(p.Rejected(request.request_id, str(exc), overloaded=True)))
    except (ValueError, TypeError) as exc:
        push.send(p.encoder.encode(p.Rejected(request.request_id, str(exc))))


def wire_delta(d) -> p.Delta:
    return p.Delta(
        d.request_id,
        d.index,
        d.token_ids,
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
        embedding=None if d.embedding is None else d.embedding.astype("<f4").tobytes(),
    )


def main() -> None:
    """``python -m radixserve.serving.engine_process CONFIG_JSON INBOX OUTBOX`` (JSON, not pickle)."""
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
