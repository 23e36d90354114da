"""KV-cache events over ZMQ as vLLM publishes them (``--kv-events-endpoint``), so llm-d's
KV-cache indexer (its precise prefix-cache scorer) and Ray's KV-aware router can follow a
radixserve engine's radix tree unchanged.

The wire format is vLLM's (``vllm/distributed/kv_events.py``, 0.32): each batch is three
frames, the topic, an 8-byte big-endian sequence number (0, 1, ...) and a msgpack
``KVEventBatch``: the array ``[ts, events, data_parallel_rank]`` whose events are maps
tagged ``type`` (``core/kv_events.py`` makes them). With a replay endpoint, a ROUTER socket
answers a client's 8-byte start sequence number with every batch still buffered from it on
(``[client, "", topic, seq, payload]`` each) and then the end marker (``[client, "", "",
0xFF * 8, ""]``). A PUB endpoint with ``*`` or ``::`` (or ``ipc://``, ``inproc://``) is
bound; any other is connected to (llm-d's centralized mode: the indexer binds). Under data
parallelism engine ``r`` adds ``r`` to both ports, as vLLM does."""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PORT = re.compile(r"^(tcp://.*:)(\d+)$")


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` for data-parallel engine ``rank``: its TCP port plus ``rank`` (an
    ``ipc``/``inproc`` path gets ``_dp<rank>``)."""
    if rank == 0:
        return endpoint
    m = _PORT.match(endpoint)
    if m:
        return f"{m.group(1)}{int(m.group(2)) + rank}"
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"cannot tell the port of KV events endpoint {endpoint!r}")


def check_endpoint(endpoint: str, what: str) -> None:
    """``ValueError`` unless ``endpoint`` is a ZMQ address this publisher can use."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{what} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if endpoint.startswith("tcp://") and not _PORT.match(endpoint):
        raise ValueError(f"{what} {endpoint!r} has no port")


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """One engine's KV events out over ZMQ. ``publish`` only queues (the engine loop never
    waits on the network); a thread of its own encodes, sends and buffers the last
    ``buffer_steps`` batches for replay, and alone touches the sockets (it closes them).
    Invariants: batches go out in ``publish`` order, numbered 0, 1, ... with no gap, the
    first saying every block is cleared (a restarted engine starts empty); a slow or absent
    subscriber loses batches at the PUB socket's high-water mark (as with vLLM), and past
    ``max_queue`` queued batches new ones are dropped and counted (``dropped``): the engine
    never blocks on it."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue: int = 100_000,
    ) -> None:
        check_endpoint(endpoint, "--kv-events-endpoint")
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint, "--kv-events-replay-endpoint")
        self.endpoint = offset_endpoint(endpoint, data_parallel_rank)
        self.replay_endpoint = (
            None
            if replay_endpoint is None
            else offset_endpoint(replay_endpoint, data_parallel_rank)
        )
        self.rank = data_parallel_rank
        self.topic = topic.encode()
        self._queue: queue.Queue[tuple[float, list[dict[str, Any]]] | None] = queue.Queue(max_queue)
        self.dropped = 0  # batches the queue had no room for
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot use {self.endpoint!r}: {exc}") from None
        self._closing = False
        self.publish([{"type": "AllBlocksCleared"}])
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one batch of events (``KVEventLog.drain``), stamped now."""
        if events and not self._closing:
            try:
                self._queue.put_nowait((time.time(), events))
            except queue.Full:
                self.dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout_s``); the thread then closes the
        sockets. A thread still busy past that is left to finish (it is a daemon)."""
        if self._closing:
            return
        self._closing = True
        while True:
            try:
                self._queue.put(None, timeout=timeout_s)
                break
            except queue.Full:  # (make room for the end: drop the oldest batch)
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()
                    self.dropped += 1
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV events: the publisher did not stop in %.0f s", timeout_s)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._close_sockets()

    def _loop(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            except zmq.ZMQError:
                log.exception("KV events: a replay request failed")
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode([ts, events, self.rank])
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            except (zmq.ZMQError, TypeError, ValueError):
                log.exception("KV events: a batch could not be sent")
                continue
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
