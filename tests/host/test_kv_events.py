"""KV-cache events (kv_events_config, vLLM's wire format over ZMQ): a subscriber decoding with vLLM 0.32's
structs sees every page the prefix cache keyed, with its tokens and parent chain, and every key it forgot, in
order; replay returns the batches from any sequence number; the config is checked by name."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from graphdecode import LLM, SamplingParams
from graphdecode.device.tp_rank import free_port
from graphdecode.host.kv_events import offset_port
from tests.helpers import random_prompts, token_prompts


# the subscriber's side, declared as vLLM 0.32 declares its events (vllm/distributed/kv_events.py)
class Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(Event):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode


def replay_from(port: int, first: int) -> list[tuple[int, bytes]]:
    """(seq, payload) of every buffered batch from `first` on, through the replay socket (a DEALER speaks to
    its ROUTER as vLLM's REQ subscriber does: [b"", start] out, [b"", seq, payload] back, then seq -1)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", first.to_bytes(8, "big")))
    got = []
    try:
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return got
            got.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end-of-replay marker")
    finally:
        dealer.close(linger=0)


def test_a_subscriber_sees_what_the_prefix_cache_stores_and_forgets(tiny_models):
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    # 12 pages: each prompt keeps 2 full pages cached, so the later prompts evict the earlier ones'
    llm = LLM(tiny_models["llama_gqa_llama3"], page_size=16, num_pages=12, max_batch_size=2, max_model_len=128,
              num_decode_steps=2, kv_events_config=config)
    try:
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner); replay covers any loss
        prompts = [p["prompt_token_ids"] for p in token_prompts(random_prompts(6, [40]))]
        for prompt in prompts:
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4))
        cached = set(llm.engine.pool._page_of_key)
        time.sleep(0.3)  # the publisher's thread sends the last step's batch
        everything = replay_from(replay, 0)
        later = replay_from(replay, 2)
    finally:
        llm.close()
    live = []
    while sub.poll(300):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        live.append((int.from_bytes(seq, "big"), payload))
    sub.close(linger=0)

    assert [s for s, _ in everything] == list(range(len(everything))) and len(everything) > 2
    assert later == everything[2:]
    assert live and set(live) <= set(everything)  # what the subscriber heard is what was published
    stored, removed, held = {}, [], set()
    for _, payload in everything:
        batch = DECODE(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == 16 and event.medium == "CPU" and len(event.block_hashes) == 1
                assert event.parent_block_hash is None or event.parent_block_hash in held
                stored[event.block_hashes[0]] = (event.parent_block_hash, event.token_ids)
                held.add(event.block_hashes[0])
            elif isinstance(event, BlockRemoved):
                assert event.block_hashes[0] in held  # only what was stored is removed
                held.discard(event.block_hashes[0])
                removed.append(event.block_hashes[0])
    assert held == cached  # the events replayed give the cache as it is
    assert removed  # the small pool evicted
    for prompt in prompts:  # each prompt's two full pages, chained
        first = next(h for h, (parent, tokens) in stored.items() if parent is None and tokens == prompt[:16])
        assert any(parent == first and tokens == prompt[16:32] for parent, tokens in stored.values())


def test_the_events_config_is_checked_by_name(tiny_models):
    path = tiny_models["llama_gqa_llama3"]
    cases = [
        ({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint_typo": "x"}, "unknown key 'endpoint_typo'"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kv_events_config.publisher"),
        ({"enable_kv_cache_events": "yes"}, "kv_events_config.enable_kv_cache_events"),
        ({"enable_kv_cache_events": True, "publisher": "zmq", "buffer_steps": 0}, "kv_events_config.buffer_steps"),
        ({"enable_kv_cache_events": True, "publisher": "zmq", "hwm": 2**63}, "kv_events_config.hwm"),
        ({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "x" * 10**6}, "kv_events_config.endpoint"),
        ("on", "kv_events_config must be a dict"),
    ]
    for given, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(path, kv_events_config=given)
    with pytest.raises(ValueError, match="data_parallel_rank"):  # it offsets the events' ports
        LLM(path, data_parallel_rank=2**16)
    off = LLM(path, max_model_len=64, kv_events_config={"enable_kv_cache_events": True})  # vLLM's default: "null"
    assert off.engine.kv_events is None and off.engine.pool.events is None


def test_a_replica_offsets_its_ports():
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("inproc://cache", 1) == "inproc://cache_dp1"
