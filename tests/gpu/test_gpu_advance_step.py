"""CUDA advance_step (csrc/advance_step.cu) equals the torch reference exactly: page
crossings, padded and done rows, every bucket size up to 1024, eager and inside a
captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphdecode.device.advance_step import advance_step_reference

pytestmark = pytest.mark.gpu

BUFFERS = ("input_ids", "positions", "seq_lens", "slot_mapping", "kv_indptr", "kv_indices", "kv_last_page_len")


@pytest.fixture(scope="module", autouse=True)
def cuda_kernel():
    from graphdecode.device.advance_step import use_cuda_kernel

    assert use_cuda_kernel(), "the CUDA advance_step library could not be built or loaded"


def random_state(rows, max_pages, page_size, steps, seed, live_fraction=0.75, boundary=False):
    """CPU tensors for `rows` rows; every live row has room for `steps` more tokens."""
    g = torch.Generator().manual_seed(seed)
    capacity = max_pages * page_size
    if boundary:  # lengths on and around page boundaries
        choices = torch.tensor([1, page_size - 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 1])
        choices = choices[(choices >= 1) & (choices <= capacity - steps)]
        seq_lens = choices[torch.randint(len(choices), (rows,), generator=g)]
    else:
        seq_lens = torch.randint(1, capacity - steps + 1, (rows,), generator=g)
    live = torch.rand(rows, generator=g) < live_fraction
    padded = torch.rand(rows, generator=g) < 0.1  # inert rows the way the host leaves them
    done = ~live | padded
    block_table = torch.randint(1, 100_000, (rows, max_pages), generator=g, dtype=torch.int32)
    block_table[padded] = 0
    seq_lens = torch.where(padded, 1, seq_lens)
    return {
        "done": done,
        "block_table": block_table,
        "input_ids": torch.randint(0, 50_000, (rows,), generator=g),
        "positions": (seq_lens - 1).long(),
        "seq_lens": seq_lens.int(),
        "slot_mapping": torch.randint(-5, 5, (rows,), generator=g),
        "kv_indptr": torch.randint(-5, 5, (rows + 1,), generator=g, dtype=torch.int32),
        "kv_indices": torch.full((rows * max_pages,), -7, dtype=torch.int32),  # sentinel: untouched tail
        "kv_last_page_len": torch.randint(-5, 5, (rows,), generator=g, dtype=torch.int32),
    }


def step(s, sampled, page_size, advance, op):
    op(sampled, s["done"], s["block_table"], *(s[name] for name in BUFFERS), page_size, advance)


def assert_same(cpu, gpu):
    for name in BUFFERS:
        assert torch.equal(cpu[name], gpu[name].cpu()), name


def run_both(rows, max_pages, page_size, steps, seed, **kwargs):
    cpu = random_state(rows, max_pages, page_size, steps, seed, **kwargs)
    gpu = {name: t.cuda() for name, t in cpu.items()}
    g = torch.Generator().manual_seed(seed + 1)
    step(cpu, cpu["input_ids"], page_size, False, advance_step_reference)
    step(gpu, gpu["input_ids"], page_size, False, torch.ops.graphdecode.advance_step)
    assert_same(cpu, gpu)
    for _ in range(steps):
        sampled = torch.randint(0, 50_000, (rows,), generator=g)
        step(cpu, sampled, page_size, True, advance_step_reference)
        step(gpu, sampled.cuda(), page_size, True, torch.ops.graphdecode.advance_step)
        assert_same(cpu, gpu)
    return cpu


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 256, 1024])
@pytest.mark.parametrize("page_size, max_pages", [(16, 8), (1, 40), (32, 3)])
def test_cuda_advance_step_equals_reference(rows, page_size, max_pages):
    final = run_both(rows, max_pages, page_size, steps=min(2 * page_size + 3, 20), seed=rows * 31 + page_size)
    assert final["kv_indptr"][0] == 0


@pytest.mark.parametrize("page_size", [4, 16])
def test_page_crossings_and_inert_rows(page_size):
    steps = 2 * page_size + 2  # every live row crosses at least two page boundaries
    final = run_both(48, 6, page_size, steps=steps, seed=7, live_fraction=0.6, boundary=True)
    inert = final["done"]
    assert inert.any() and (~inert).any()
    assert final["slot_mapping"][inert].eq(0).all()  # padded and done rows write the scratch slot
    assert final["kv_last_page_len"][inert].eq(1).all()


def test_bucket_views_of_a_larger_state():
    """The window passes [:B] views of B_max-row buffers; only the bucket's rows change."""
    rows, bucket, max_pages, page_size = 32, 8, 5, 16
    cpu = random_state(rows, max_pages, page_size, 4, seed=3)
    gpu = {name: t.cuda() for name, t in cpu.items()}
    views = lambda s: [s["done"][:bucket], s["block_table"][:bucket], s["input_ids"][:bucket],  # noqa: E731
                       s["positions"][:bucket], s["seq_lens"][:bucket], s["slot_mapping"][:bucket],
                       s["kv_indptr"][: bucket + 1], s["kv_indices"][: bucket * max_pages],
                       s["kv_last_page_len"][:bucket]]
    sampled = torch.arange(bucket)
    advance_step_reference(sampled, *views(cpu), page_size, True)
    torch.ops.graphdecode.advance_step(sampled.cuda(), *views(gpu), page_size, True)
    assert_same(cpu, gpu)


def test_captured_in_a_cuda_graph():
    rows, max_pages, page_size, steps = 64, 8, 16, 6
    cpu = random_state(rows, max_pages, page_size, 3 * steps, seed=11)
    gpu = {name: t.cuda() for name, t in cpu.items()}
    sampled = torch.zeros(rows, dtype=torch.int64, device="cuda")  # [B] static input of the graph
    step(gpu, gpu["input_ids"], page_size, False, torch.ops.graphdecode.advance_step)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step(gpu, sampled, page_size, True, torch.ops.graphdecode.advance_step)
    step(cpu, cpu["input_ids"], page_size, False, advance_step_reference)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # capture executed nothing: every replay is `steps` real steps
        values = torch.randint(0, 50_000, (rows,), generator=g)
        sampled.copy_(values)
        graph.replay()
        for _ in range(steps):
            step(cpu, values, page_size, True, advance_step_reference)
        torch.cuda.synchronize()
        assert_same(cpu, gpu)
