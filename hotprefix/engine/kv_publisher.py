"""The ZMQ side of KV events, as vLLM's ZmqEventPublisher behaves on the wire.

A PUB socket sends each batch as one multipart message `[topic, sequence, payload]`:
the sequence 8 bytes big-endian, from 0 in each process and one more per batch; the
payload the msgpack of the batch (engine/kv_events.py). A ROUTER socket (the replay
endpoint, when configured) answers a request `[identity, "", start sequence]` with every
batch still buffered (the last `buffer_steps`) from that sequence on, each as
`[identity, "", sequence, payload]`, then the end marker `[identity, "", 0xff..ff, ""]`.
An endpoint with `*`, `::`, ipc:// or inproc:// is bound, any other connected (vLLM's rule).

The engine thread only queues a batch and wakes the publisher thread (`publish` never
waits); the publisher thread encodes, sends and answers replays. When the queue is full
the batch is dropped and the next one starts with AllBlocksCleared and every block
announced again (the engine side's `resync`), so a subscriber is never left with a hole
it cannot see.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any

import msgpack
import zmq

from hotprefix.config import ConfigError, KVEventsConfig

log = logging.getLogger(__name__)

REPLAY_MAX_BYTES = 1024  # the largest frame a replay socket reads (a request is a sequence number of 8 bytes)
END_SEQ = (2**64 - 1).to_bytes(8, "big")  # vLLM's (-1).to_bytes(8, "big", signed=True)


def binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds this endpoint (else it connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """The sockets and the thread that owns them. Raises ConfigError at start when an
    endpoint cannot be bound or connected (the flag names it)."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        self.cfg = cfg
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue[list[Any] | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context()
        self._wake_addr = f"inproc://hotprefix-kv-events-{id(self):x}"
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.queued = 0  # batches queued: the last one's sequence is queued - 1 (the engine thread's count)
        self.sent = 0  # batches sent (the publisher thread's)
        self.dropped = 0  # batches dropped on a full queue
        self._thread = threading.Thread(target=self._run, name="hotprefix-kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._ctx.term()
            raise ConfigError(f"--kv-events-config: cannot open {cfg.endpoint}"
                              f"{' or ' + cfg.replay_endpoint if cfg.replay_endpoint else ''}: {self._error}")
        self._wake = self._ctx.socket(zmq.PUSH)  # the publishing thread's (one thread steps an engine)
        self._wake.connect(self._wake_addr)

    def publish(self, batch: list[Any]) -> bool:
        """Queue a batch for sending; False (counted) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            return False
        self.queued += 1
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # the thread has wake-ups queued already
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._wake.send(b"")
        self._thread.join(timeout)
        self._wake.close(linger=0)
        self._ctx.term()

    # -- the publisher thread -------------------------------------------------------------
    def _open(self) -> tuple[zmq.Socket, zmq.Socket | None, zmq.Socket]:
        wake = self._ctx.socket(zmq.PULL)
        wake.bind(self._wake_addr)
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.cfg.hwm)
        pub.bind(self.cfg.endpoint) if binds(self.cfg.endpoint) else pub.connect(self.cfg.endpoint)
        replay = None
        if self.cfg.replay_endpoint:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAX_BYTES)  # a peer sending more is disconnected, not read
            replay.bind(self.cfg.replay_endpoint)
        return pub, replay, wake

    def _run(self) -> None:
        try:
            pub, replay, wake = self._open()
        except zmq.ZMQError as e:
            self._error = e
            self._started.set()
            return
        self._started.set()
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    while wake.poll(0):
                        wake.recv()
                    if not self._send_queued(pub):
                        return
                if replay is not None and replay in ready:  # (after sending: a replay has what was queued)
                    self._answer(replay)
        finally:
            for s in (pub, replay, wake):
                if s is not None:
                    s.close(linger=200)

    def _send_queued(self, pub: zmq.Socket) -> bool:
        """Send every queued batch; False once the end marker (None) is reached."""
        while True:
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return True
            if batch is None:
                return False
            payload = msgpack.packb(batch)
            seq = self.sent
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.sent += 1

    def _answer(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
