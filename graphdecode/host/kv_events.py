"""KV-cache events for prefix-aware routers, in vLLM's wire format (`kv_events_config`, vLLM's option).

The page pool (host/page_pool.py) notes what its prefix cache gains and loses: a page keyed (`BlockStored`:
its key, its parent page's key, its tokens, the page size) and a key forgotten when its page is evicted or
re-used (`BlockRemoved`). After each engine step the engine hands that step's events to the publisher, which
sends them from a thread of its own as one batch: a ZMQ multipart message (topic, sequence number as 8 bytes
big-endian, payload) on a PUB socket, the payload msgpack of `KVEventBatch` as vLLM 0.32 encodes it (the batch
an array [ts, events, data_parallel_rank]; each event a map tagged by its class name under "type"). With a
`replay_endpoint`, a ROUTER socket answers a subscriber that missed batches: it sends the first sequence
number it wants (8 bytes big-endian) and gets every buffered batch from there, (seq, payload) each, then
(-1, b"") as the end.

A page's key is this engine's 16-byte blake2b of (parent key, tokens) (ExternalBlockHash is bytes or int in
vLLM): a router matches prompts by the events' token ids and follows the parent chain by key; the first page
of a prompt has no parent (None). Data-parallel replica r tags its batches with data_parallel_rank r and
offsets its endpoints' TCP ports by r, as vLLM does.

    kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}

An endpoint with a wildcard (`*`, `::`) or an ipc:// / inproc:// one is bound, any other is connected to.
pyzmq and msgspec are needed only when events are on (EngineConfig's check names them otherwise).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from itertools import count


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel replica's endpoint: its TCP port plus the replica's index (inproc: a suffix)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1].isdigit():
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _types():
    """vLLM's event structs (vllm/distributed/kv_events.py, 0.32), as msgspec encodes them."""
    import msgspec

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes]
        parent_block_hash: bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


class KVEventPublisher:
    """Publishes each step's page-pool events (PagePool.take_events) from a thread, in order, numbered from 0."""

    END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: dict, page_size: int, data_parallel_rank: int = 0, medium: str = "GPU"):
        import msgspec
        import zmq

        self.page_size, self.rank, self.medium = page_size, data_parallel_rank, medium
        self._stored, self._removed, self._cleared, self._batch = _types()
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = config["topic"].encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config["max_queue_size"])
        self._buffer: deque = deque(maxlen=config["buffer_steps"])
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config["hwm"])
        endpoint = offset_port(config["endpoint"], data_parallel_rank)
        self._pub.bind(endpoint) if _binds(endpoint) else self._pub.connect(endpoint)
        self._replay = None
        replay = offset_port(config["replay_endpoint"], data_parallel_rank)
        if replay is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay)
        self._seq = count()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="graphdecode-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[tuple]) -> None:
        """One step's events: ("stored", key, parent key or None, token ids, LoRARequest or None) / ("removed", key) /
        ("cleared",)."""
        if events:
            self._queue.put((time.time(), events))

    def _event(self, event: tuple):
        if event[0] == "stored":
            _, key, parent, tokens, lora = event  # vLLM's lora_id / lora_name: the adapter that computed the page
            return self._stored(block_hashes=[key], parent_block_hash=parent, token_ids=list(tokens),
                                block_size=self.page_size, lora_id=lora.lora_int_id if lora else None,
                                medium=self.medium, lora_name=lora.lora_name if lora else None)
        if event[0] == "removed":
            return self._removed(block_hashes=[event[1]], medium=self.medium)
        return self._cleared()

    def _run(self) -> None:
        while self._running or not self._queue.empty():
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, events = item
            payload = self._encode(self._batch(ts=ts, events=[self._event(e) for e in events],
                                               data_parallel_rank=self.rank))
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # a REQ client sends [identity, b"", start]
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END, b""))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
