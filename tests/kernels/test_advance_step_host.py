"""The CUDA kernels' per-row logic equals the torch reference, checked on CPU.

csrc/advance_step.cu keeps the per-row work in `__host__ __device__` functions that the
kernels call and that `graphdecode_advance_step_host` calls from a plain loop. Here
that host entry point (from the nvcc library where nvcc exists, and from a g++ build of
the same file where a C++ compiler exists) is compared exactly with
`advance_step_reference` on randomized decode windows: page crossings at every step,
done and padded rows, rows at and past the last page (the column clamp), bucket views
of larger buffers with a wider block table, page sizes 1/4/16/32, buckets of 1..300
rows; every buffer is compared whole, including kv_indices' untouched tail.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from graphdecode.device.advance_step import advance_step_reference
from graphdecode.kernels import build as kernel_build
from graphdecode.kernels import cuda as cuda_kernels
from graphdecode.kernels.advance_step_host import advance_step_host

BUFFERS = ("input_ids", "positions", "seq_lens", "slot_mapping", "kv_indptr", "kv_indices", "kv_last_page_len")
INPUTS = ("done", "block_table")
SENTINEL = -7
PAGE_IDS = 100_000
# row kinds and their weights
BOUNDARY, RANDOM, FULL, OVER, DONE, PADDED = range(6)
KIND_WEIGHTS = torch.tensor([4.0, 2.0, 1.0, 0.5, 1.0, 1.0])


@pytest.fixture(scope="module", params=["default", "c++"])
def lib(request, tmp_path_factory) -> ctypes.CDLL:
    """"default": what `kernel_build.host_library` gives (the nvcc library where nvcc exists);
    "c++": the g++ host-only build, when that is not already what "default" was."""
    src = kernel_build.source_dir()
    assert src is not None, "csrc/ sources not found"
    out = tmp_path_factory.mktemp(f"host-{request.param}")
    if request.param == "default":
        if kernel_build.find_nvcc() is None and kernel_build.find_cxx() is None:
            pytest.skip("neither nvcc nor a C++ compiler found")
        path = kernel_build.host_library(str(out), src)
    else:
        if kernel_build.find_cxx() is None:
            pytest.skip("no C++ compiler found")
        if kernel_build.find_nvcc() is None:
            pytest.skip("the default library is already the C++ build")
        path = kernel_build.build_host(str(out / kernel_build.HOST_LIB_NAME), src)
    return cuda_kernels.open_host_library(path)


# --- states ----------------------------------------------------------------------------------


def _randint(g, low: int, high: int) -> int:
    """Uniform in [low, high] (inclusive)."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def fill_rows(g, s, index, max_pages: int, page_size: int, steps: int, kinds=None) -> None:
    """(Re)initialize rows `index` of state `s` the way the host leaves them, each of a random kind."""
    capacity = max_pages * page_size
    width = s["block_table"].shape[1]
    if kinds is None:
        kinds = torch.multinomial(KIND_WEIGHTS, len(index), replacement=True, generator=g).tolist()
    for row, kind in zip(index, kinds):
        if kind == BOUNDARY:  # crosses into a new page at step j of the window (j = 0: before it)
            j = _randint(g, 0, steps + 1)
            length = _randint(g, 1, max(1, max_pages - 1)) * page_size + 1 - j
        elif kind in (RANDOM, DONE):
            length = _randint(g, 1, max(1, capacity - steps))
        elif kind == FULL:  # at or near the last page; may run past it during the window
            length = _randint(g, max(1, capacity - steps - 1), capacity)
        elif kind == OVER:  # already past the table: the column clamp
            length = capacity + _randint(g, 1, 2 * page_size + 3)
        else:  # PADDED
            length = 1
        length = max(1, length)
        table = torch.full((width,), -3, dtype=torch.int32)  # columns past max_pages: never read
        if kind == PADDED:
            table[:max_pages] = 0
        else:
            used = max_pages if kind in (FULL, OVER) else min(max_pages, -(-(length + steps) // page_size))
            table[:max_pages] = 0 if _randint(g, 0, 1) else torch.randint(1, PAGE_IDS, (max_pages,), generator=g)
            table[:used] = torch.randint(1, PAGE_IDS, (used,), generator=g, dtype=torch.int32)
        s["block_table"][row] = table
        s["done"][row] = kind in (DONE, PADDED)
        s["seq_lens"][row] = length
        s["positions"][row] = length - 1
        s["input_ids"][row] = _randint(g, 0, 50_000)


def make_state(g, rows: int, max_pages: int, page_size: int, steps: int, spare_rows: int, spare_cols: int,
               kinds=None) -> dict[str, torch.Tensor]:
    """Buffers of rows + spare_rows rows and a block table max_pages + spare_cols wide; the bucket
    is the first `rows` rows and max_pages columns, as DecodeState's [:B] views are."""
    total = rows + spare_rows
    s = {
        "done": torch.zeros(total, dtype=torch.bool),
        "block_table": torch.zeros(total, max_pages + spare_cols, dtype=torch.int32),
        "input_ids": torch.zeros(total, dtype=torch.int64),
        "positions": torch.zeros(total, dtype=torch.int64),
        "seq_lens": torch.zeros(total, dtype=torch.int32),
        "slot_mapping": torch.randint(-5, 5, (total,), generator=g),
        "kv_indptr": torch.randint(-5, 5, (total + 1,), generator=g, dtype=torch.int32),
        "kv_indices": torch.full((total * max_pages,), SENTINEL, dtype=torch.int32),
        "kv_last_page_len": torch.randint(-5, 5, (total,), generator=g, dtype=torch.int32),
    }
    fill_rows(g, s, range(total), max_pages, page_size, steps, kinds)
    return s


def bucket_views(s, rows: int, max_pages: int) -> list[torch.Tensor]:
    return [
        s["done"][:rows], s["block_table"][:rows, :max_pages], s["input_ids"][:rows], s["positions"][:rows],
        s["seq_lens"][:rows], s["slot_mapping"][:rows], s["kv_indptr"][: rows + 1],
        s["kv_indices"][: rows * max_pages], s["kv_last_page_len"][:rows],
    ]


def clone(s):
    return {name: t.clone() for name, t in s.items()}


# --- running both ----------------------------------------------------------------------------


class Pair:
    """The same state stepped by the torch reference and by the C host entry point."""

    def __init__(self, lib, state, rows: int, max_pages: int, page_size: int):
        self.lib, self.rows, self.max_pages, self.page_size = lib, rows, max_pages, page_size
        self.ref, self.host = state, clone(state)
        self.high = 0  # how far into kv_indices anything may have been written

    def step(self, sampled: torch.Tensor | None, advance: bool) -> None:
        """sampled=None: pass each state's own input_ids view (aliased, as the window's first call does)."""
        before = clone(self.ref)
        for state, op in ((self.ref, advance_step_reference), (self.host, self._host_op)):
            views = bucket_views(state, self.rows, self.max_pages)
            op(views[2] if sampled is None else sampled.clone(), *views, self.page_size, advance)
        self.check(before)

    def _host_op(self, *args):
        advance_step_host(*args, lib=self.lib)

    def check(self, before) -> None:
        for name in BUFFERS + INPUTS:
            assert torch.equal(self.ref[name], self.host[name]), name
        for name in INPUTS:
            assert torch.equal(self.host[name], before[name]), f"{name} was modified"
        rows, max_pages = self.rows, self.max_pages
        for name in BUFFERS:  # rows past the bucket are never touched
            end = rows * max_pages if name == "kv_indices" else rows + 1 if name == "kv_indptr" else rows
            assert torch.equal(self.host[name][end:], before[name][end:]), f"{name} past the bucket"
        indptr = self.host["kv_indptr"][: rows + 1]
        assert indptr[0] == 0 and bool((indptr[1:] >= indptr[:-1]).all())
        self.high = max(self.high, min(int(indptr[-1]), rows * max_pages))
        assert bool(self.host["kv_indices"][self.high :].eq(SENTINEL).all()), "kv_indices past kv_indptr[B]"

    def mark_done(self, g, fraction: float) -> None:
        """Rows finishing mid-window (the sampler sets their done flag; nothing else changes)."""
        newly = torch.rand(self.rows, generator=g) < fraction
        for state in (self.ref, self.host):
            state["done"][: self.rows] |= newly

    def admit(self, g, count: int, steps: int) -> None:
        """Between windows the host refills some rows (admissions, grown tables, padding)."""
        index = torch.randperm(self.rows, generator=g)[:count].tolist()
        fill_rows(g, self.ref, index, self.max_pages, self.page_size, steps)
        for name in INPUTS + BUFFERS:
            self.host[name].copy_(self.ref[name])


def run_window(pair: Pair, g, steps: int, finish_fraction: float = 0.05) -> None:
    pair.step(None, advance=False)  # the window's first call: sampled is input_ids itself
    for _ in range(steps):
        pair.step(torch.randint(0, 50_000, (pair.rows,), generator=g), advance=True)
        pair.mark_done(g, finish_fraction)


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    page_size = (1, 4, 16, 32)[seed % 4]
    rows = (1, 2, 3)[seed // 4] if seed < 12 else _randint(g, 1, 300)
    max_pages = _randint(g, 1, {1: 64, 4: 16, 16: 8, 32: 6}[page_size])
    steps = _randint(g, 1, 8)
    spare_rows, spare_cols = _randint(g, 0, 40), _randint(g, 0, 5)
    return g, rows, max_pages, page_size, steps, spare_rows, spare_cols


# --- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(48))
def test_random_windows_equal_the_reference(lib, seed):
    g, rows, max_pages, page_size, steps, spare_rows, spare_cols = _case(seed)
    state = make_state(g, rows, max_pages, page_size, steps, spare_rows, spare_cols)
    pair = Pair(lib, state, rows, max_pages, page_size)
    run_window(pair, g, steps)
    pair.admit(g, count=max(1, rows // 4), steps=steps)
    run_window(pair, g, steps)


@pytest.mark.parametrize("page_size", [1, 4, 16, 32])
def test_every_step_crosses_a_page_boundary(lib, page_size):
    """Lengths m*P + 1 - j for every j of the window: at each step some rows open a new page."""
    g = torch.Generator().manual_seed(100 + page_size)
    steps, max_pages, rows = 8, 6, 96
    state = make_state(g, rows, max_pages, page_size, steps, 8, 3, kinds=[BOUNDARY] * (rows + 8))
    pair = Pair(lib, state, rows, max_pages, page_size)
    pages = lambda: -(-pair.host["seq_lens"][:rows] // page_size)  # noqa: E731
    pair.step(None, advance=False)
    for _ in range(steps):
        before = pages()
        pair.step(torch.randint(0, 50_000, (rows,), generator=g), advance=True)
        assert bool((pages() > before).any())  # a crossing at this step


@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_rows_at_and_past_the_last_page(lib, page_size):
    """Full tables, lengths near capacity and past it (column clamped to max_pages - 1): the page
    counts exceed B * max_pages and the writes stop there."""
    g = torch.Generator().manual_seed(200 + page_size)
    rows, max_pages, steps = 37, 3, 8
    pair = Pair(lib, make_state(g, rows, max_pages, page_size, steps, 5, 2, kinds=[OVER] * 42), rows, max_pages,
                page_size)
    run_window(pair, g, steps, finish_fraction=0.0)
    assert int(pair.host["kv_indptr"][rows]) > rows * max_pages
    pair = Pair(lib, make_state(g, rows, max_pages, page_size, steps, 5, 2, kinds=[FULL] * 42), rows, max_pages,
                page_size)
    run_window(pair, g, steps, finish_fraction=0.0)


def test_inert_rows_attend_the_scratch_page(lib):
    g = torch.Generator().manual_seed(300)
    rows, max_pages, page_size = 50, 4, 16
    kinds = [DONE, PADDED] * 25 + [RANDOM] * 4
    pair = Pair(lib, make_state(g, rows, max_pages, page_size, 4, 4, 1, kinds=kinds), rows, max_pages, page_size)
    run_window(pair, g, 4)
    host = pair.host
    assert torch.equal(host["kv_indptr"][: rows + 1], torch.arange(rows + 1, dtype=torch.int32))
    assert bool(host["kv_indices"][:rows].eq(0).all())
    assert bool(host["slot_mapping"][:rows].eq(0).all()) and bool(host["kv_last_page_len"][:rows].eq(1).all())


def test_advance_false_recomputes_without_advancing(lib):
    g = torch.Generator().manual_seed(400)
    rows, max_pages, page_size = 64, 8, 16
    pair = Pair(lib, make_state(g, rows, max_pages, page_size, 2, 0, 0), rows, max_pages, page_size)
    lengths = pair.host["seq_lens"].clone()
    pair.step(torch.randint(0, 50_000, (rows,), generator=g), advance=False)
    pair.step(None, advance=False)
    assert torch.equal(pair.host["seq_lens"], lengths)


def test_no_row_limit_on_the_host(lib):
    """The CUDA launcher scans in one block (B <= 1024); the host loop takes any B."""
    g = torch.Generator().manual_seed(500)
    rows, max_pages, page_size = 1500, 2, 16
    pair = Pair(lib, make_state(g, rows, max_pages, page_size, 3, 0, 0), rows, max_pages, page_size)
    run_window(pair, g, 3)


@pytest.mark.parametrize(
    "num_rows, max_pages, page_size, table_stride",
    [(0, 4, 16, 4), (2, 0, 16, 4), (2, 4, 0, 4), (2, 4, 16, 3), (-1, 4, 16, 4)],
)
def test_host_entry_point_rejects_bad_sizes_before_touching_memory(lib, num_rows, max_pages, page_size,
                                                                   table_stride):
    null = None
    err = lib.graphdecode_advance_step_host(null, null, null, table_stride, null, null, null, null, null, null, null,
                                            num_rows, max_pages, page_size, 1)
    assert err == 1  # cudaErrorInvalidValue, as the CUDA launcher answers


def test_wrapper_validates_its_tensors(lib):
    g = torch.Generator().manual_seed(600)
    rows, max_pages, page_size = 4, 3, 16
    s = make_state(g, rows, max_pages, page_size, 1, 0, 0)

    def call(**replace):
        args = dict(zip(("done", "block_table", *BUFFERS), bucket_views(s, rows, max_pages)))
        args.update(replace)
        sampled = args.pop("sampled", torch.zeros(rows, dtype=torch.int64))
        advance_step_host(sampled, *args.values(), page_size, True, lib=lib)

    call()  # the unmodified arguments are fine
    bad = [
        dict(sampled=torch.zeros(rows, dtype=torch.int32)),
        dict(done=torch.zeros(rows, dtype=torch.uint8)),
        dict(block_table=s["block_table"].long()),
        dict(block_table=s["block_table"].t().contiguous().t()),  # column stride != 1
        dict(positions=torch.zeros(2 * rows, dtype=torch.int64)[::2]),  # not contiguous
        dict(seq_lens=torch.ones(rows + 1, dtype=torch.int32)),  # wrong length
        dict(kv_indptr=torch.zeros(rows, dtype=torch.int32)),
        dict(kv_indices=torch.zeros(rows * max_pages + 1, dtype=torch.int32)),
    ]
    for replace in bad:
        with pytest.raises(ValueError):
            call(**replace)
    with pytest.raises(ValueError):  # page_size 0: rejected by the entry point itself
        advance_step_host(torch.zeros(rows, dtype=torch.int64), *bucket_views(s, rows, max_pages), 0, True, lib=lib)


def test_cxx_build_has_the_host_entry_point_only(tmp_path):
    if kernel_build.find_cxx() is None:
        pytest.skip("no C++ compiler found")
    path = kernel_build.build_host(str(tmp_path / kernel_build.HOST_LIB_NAME), kernel_build.source_dir())
    raw = ctypes.CDLL(path)
    assert hasattr(raw, "graphdecode_advance_step_host") and not hasattr(raw, "graphdecode_advance_step")
    assert not kernel_build.is_current(path, kernel_build.source_dir())  # no stamp: never taken for the CUDA library
    assert cuda_kernels.open_host_library(path).graphdecode_kernels_abi_version() == cuda_kernels.ABI_VERSION
    with pytest.raises(RuntimeError, match="no CUDA launcher"):
        cuda_kernels.open_library(path)
