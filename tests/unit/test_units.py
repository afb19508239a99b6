"""Unit tests of the pieces under the engine: advance_step, pages, config parsing, staging."""

from __future__ import annotations

import os

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.device.advance_step import advance_step_reference
from graphdecode.host.page_pool import PagePool
from graphdecode.models.model_config import parse_model_config


def _state(rows, max_pages):
    return dict(
        input_ids=torch.zeros(rows, dtype=torch.int64),
        positions=torch.zeros(rows, dtype=torch.int64),
        seq_lens=torch.ones(rows, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        kv_indptr=torch.zeros(rows + 1, dtype=torch.int32),
        kv_indices=torch.full((rows * max_pages,), 77, dtype=torch.int32),
        kv_last_page_len=torch.zeros(rows, dtype=torch.int32),
    )


def test_advance_step_reference_semantics():
    page = 4
    block_table = torch.tensor([[5, 6, 7], [8, 9, 0], [0, 0, 0], [3, 0, 0]], dtype=torch.int32)
    s = _state(4, 3)
    s["positions"][:] = torch.tensor([3, 5, 0, 1])  # row 0 crosses into its second page on advance
    s["seq_lens"][:] = torch.tensor([4, 6, 1, 2], dtype=torch.int32)
    s["input_ids"][:] = torch.tensor([10, 11, 12, 13])
    done = torch.tensor([False, False, True, True])  # row 2 padded, row 3 finished
    sampled = torch.tensor([100, 101, 102, 103])
    advance_step_reference(sampled, done, block_table, **s, page_size=page, advance=True)
    assert s["input_ids"].tolist() == [100, 101, 12, 13]
    assert s["positions"].tolist() == [4, 6, 0, 1]
    assert s["seq_lens"].tolist() == [5, 7, 1, 2]
    # row 0: pos 4 -> page index 1 -> page 6, offset 0; row 1: pos 6 -> page 9, offset 2; inert rows -> slot 0
    assert s["slot_mapping"].tolist() == [6 * 4 + 0, 9 * 4 + 2, 0, 0]
    assert s["kv_indptr"].tolist() == [0, 2, 4, 5, 6]
    assert s["kv_indices"][:6].tolist() == [5, 6, 8, 9, 0, 0]
    assert s["kv_indices"][6:].tolist() == [77] * 6  # past kv_indptr[B]: untouched
    assert s["kv_last_page_len"].tolist() == [1, 3, 1, 1]

    # advance=False only recomputes the metadata
    before = {k: v.clone() for k, v in s.items()}
    advance_step_reference(sampled, done, block_table, **s, page_size=page, advance=False)
    for k in ("input_ids", "positions", "seq_lens", "slot_mapping", "kv_indptr", "kv_indices"):
        assert torch.equal(s[k], before[k]), k


def test_advance_step_custom_op_runs_reference_on_cpu():
    block_table = torch.tensor([[1, 2]], dtype=torch.int32)
    s = _state(1, 2)
    s["positions"][:] = 15
    s["seq_lens"][:] = 16
    torch.ops.graphdecode.advance_step(
        torch.tensor([9]), torch.tensor([False]), block_table, *s.values(), 16, True
    )
    assert s["positions"].item() == 16 and s["slot_mapping"].item() == 2 * 16
    assert s["kv_indptr"].tolist() == [0, 2] and s["kv_last_page_len"].item() == 1


def test_page_pool_refcounts():
    alloc = PagePool(6)
    assert alloc.num_free == 5  # page 0 is the scratch page
    a = alloc.allocate(3)
    assert 0 not in a
    alloc.share(a[:2])
    alloc.free(a)
    assert alloc.num_free == 3  # the two shared pages are still held
    alloc.free(a[:2])
    assert alloc.num_free == 5
    with pytest.raises(RuntimeError):
        alloc.allocate(6)
    with pytest.raises(RuntimeError):
        alloc.free([a[0]])


def test_config_4x_and_5x_layouts_agree():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64)
    v5 = parse_model_config(dict(base, dtype="bfloat16", rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    v4 = parse_model_config(dict(base, torch_dtype="bfloat16", rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert v4 == v5
    assert v5.dtype == torch.bfloat16 and v5.rope.rope_type == "llama3" and v5.num_kv_heads == 2
    assert v5.head_dim == 4
    qwen = parse_model_config(dict(base, model_type="qwen2", sliding_window=4096, use_sliding_window=False))
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.sliding_window is None


def test_host_writes_nothing_between_unchanged_windows(tiny_models):
    """One long request: after admission, windows that change nothing stage no rows at all."""
    llm = LLM(tiny_models["llama_head_dim"], num_decode_steps=2, page_size=128, max_model_len=256, max_batch_size=4)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5]}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    flushes = []
    while engine.has_unfinished():
        before = engine.runner.staging.num_flushes
        engine.step()
        flushes.append(engine.runner.staging.num_flushes - before)
    stats = llm.stats()
    assert stats["windows"] >= 29
    # one flush for the admission, one to clear the row once launched work covers the last token,
    # none in the ~29 windows between
    assert flushes[0] == 1 and sum(flushes) == 2
    assert stats["staged_rows"] == 2


def test_batch_encoding_matches_transformers(text_model):
    """Text prompts are encoded through the Rust tokenizer directly: same ids as transformers."""
    llm = LLM(text_model, max_model_len=128, max_batch_size=2)
    texts = ["The capital of France is", "  leading spaces", "ünïcödé 日本", "x"]
    assert llm.engine.inputs.tokenize_all(texts) == [(t, ids) for t, ids in zip(texts, llm.tokenizer(texts)["input_ids"])]
    assert llm.engine.inputs._fast_encode is True


def test_keep_freed_host_memory_sets_both_malloc_thresholds():
    """CPU runners make glibc keep freed blocks (trim and mmap thresholds), so windows do not
    page-fault their buffers in again every step; off glibc it is a no-op."""
    from graphdecode.device import host_memory

    calls = []

    class FakeLibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    assert host_memory.keep_freed_host_memory(FakeLibc()) is True
    assert calls == [(host_memory.M_TRIM_THRESHOLD, 1 << 30), (host_memory.M_MMAP_THRESHOLD, 32 << 20)]

    class Refusing(FakeLibc):
        def mallopt(self, param, value):
            return 0

    assert host_memory.keep_freed_host_memory(Refusing()) is False
    import platform

    if platform.libc_ver()[0] == "glibc":  # the real one accepts them (32 MiB is its largest mmap threshold)
        assert host_memory.keep_freed_host_memory() is True


def test_cpu_runner_keeps_freed_host_memory(tiny_models, monkeypatch):
    from graphdecode import LLM
    from graphdecode.device import runner

    called = []
    monkeypatch.setattr(runner, "keep_freed_host_memory", lambda: called.append(True) or True)
    LLM(tiny_models["llama_gqa_llama3"], max_model_len=64)
    assert called == [True]


def test_freeze_startup_heap_keeps_the_heap_out_of_collections_but_collects_new_garbage():
    import gc
    import weakref

    from graphdecode.host.gc_heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    long_lived = [{"i": i} for i in range(50_000)]
    before_freeze = cycle()  # garbage made during start-up is collected, not frozen
    try:
        frozen = freeze_startup_heap()
        assert before_freeze() is None
        assert frozen >= len(long_lived)
        # frozen objects stay out of collections; another thread of this process (a test's engine worker) may still
        # free some of them by reference count, so the count can only shrink
        assert len(long_lived) <= gc.get_freeze_count() <= frozen
        after_freeze = cycle()  # what is made later is collected as before
        gc.collect()
        assert after_freeze() is None
    finally:
        gc.unfreeze()


def test_engine_core_freezes_its_heap_before_it_reports_ready(tiny_models, monkeypatch):
    import multiprocessing
    import threading

    from graphdecode.server import engine_core

    events = []
    monkeypatch.setattr(engine_core, "freeze_startup_heap", lambda: events.append("frozen") or 0)
    core_in, requests = multiprocessing.Pipe(duplex=False)
    outputs, core_out = multiprocessing.Pipe(duplex=False)
    thread = threading.Thread(target=engine_core.run_engine_core,
                              args=([(core_in, core_out)], tiny_models["llama_gqa_llama3"], {"max_model_len": 64}))
    thread.start()
    try:
        kind, _ = outputs.recv()
        events.append(kind)
    finally:
        requests.send([("shutdown",)])
        thread.join(60)
    assert events == ["frozen", "ready"]


def test_advance_without_csr_runs_only_the_per_row_step():
    """A backend that reads block tables directly (the CPU kernel) skips the CSR scan: the
    per-row fields equal the full step's, the CSR metadata is left as it was."""
    from graphdecode.device.decode_state import DecodeState

    def state():
        s = DecodeState(8, 6, 2, 4, 2, "cpu")
        g = torch.Generator().manual_seed(0)
        s.block_table.copy_(torch.randperm(48, generator=g).add(1).int().view(8, 6))
        s.positions.copy_(torch.tensor([0, 3, 15, 16, 31, 40, 7, 2]))
        s.seq_lens.copy_(s.positions.int() + 1)
        s.done[6] = True
        s.kv_indptr.fill_(-7)
        return s

    full, light = state(), state()
    sampled = torch.arange(100, 108)
    for s, csr in ((full, True), (light, False)):
        s.advance(8, sampled, 8, advance=True, csr=csr)
    for name in ("input_ids", "positions", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(full, name), getattr(light, name)), name
    assert (light.kv_indptr == -7).all() and not (full.kv_indptr == -7).all()


def test_stats_say_whether_a_compiled_start_was_warm(tiny_models, tmp_path):
    """A process whose compiles all find their code in the on-disk cache is a warm start; the
    first process on an empty cache is not; an eager engine says None."""
    import json
    import subprocess
    import sys

    code = ("import json, sys, torch; torch.set_num_threads(1); from graphdecode import LLM; "
            "s = LLM(sys.argv[1], compile=True, max_model_len=64, buckets=[2]).stats(); "
            "print(json.dumps([s['compile_seconds'], s['compile_warm_start']]))")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # empty: the first is cold

    def start():
        proc = subprocess.run([sys.executable, "-c", code, tiny_models["llama_head_dim"]], env=env,
                              capture_output=True, text=True, check=False, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    (cold_s, cold), (_, warm) = start(), start()
    assert cold_s > 0 and cold is False and warm is True
    assert LLM(tiny_models["llama_head_dim"], max_model_len=64, buckets=[2]).stats()["compile_warm_start"] is None
