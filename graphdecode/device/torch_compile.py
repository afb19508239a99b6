"""torch.compile for the decode forward: one compile for every bucket, cached on disk.

The forward is compiled with `dynamic=True`: the batch dimension (and the KV width
the torch reference gathers in eager windows) is symbolic, so one compiled entry
serves every bucket of two rows or more. Dynamo specialises a dimension of size 1,
so bucket 1 gets an entry of its own: two compiles in all, however many buckets (a
static-shape compile per bucket would cost minutes of cold start for a 16-layer model
on a GPU). Compilation is lazy, the first time a window of that
shape runs; the engine triggers it at construction (the warm-up before each graph
capture on CUDA, `WindowGraphs.warm_up` otherwise), so requests never pay for it.

The compile cache lives under the graphdecode cache root: inductor's FX graph cache
and AOTAutograd cache go to `<cache root>/inductor` (unless TORCHINDUCTOR_CACHE_DIR
is already set), so a second process skips code generation and the C++/Triton
compile, and only re-traces with dynamo.

`CompiledForward` wraps the compiled callable and adds the wall time of every call
that compiled to `compile_seconds`, so stats() reports compiling apart from capturing.
"""

from __future__ import annotations

import os
import time

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..cache import cache_root

_ENTRIES = 8  # bucket 1, buckets >= 2, and slack for a guard on a Python value that differs between windows


def inductor_cache_dir() -> str:
    """Where inductor keeps its caches for this process (set before the first compile).

    A TORCHINDUCTOR_CACHE_DIR the user chose wins. Importing torch._dynamo writes
    inductor's own default there, so that value counts as unset.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None or os.path.abspath(path) == os.path.abspath(default_cache_dir()):
        path = os.path.join(cache_root(), "inductor")
        os.makedirs(path, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # inductor reads it at each compile
    return path


def _counters():
    """dynamo's counters (torch._dynamo is imported at the first compiled forward: 0.8 s that an engine
    without compile, and every process that only talks to one, does not pay)."""
    from torch._dynamo.utils import counters

    return counters


def _compiled_graphs() -> int:
    return _counters()["stats"]["unique_graphs"]


class CompiledForward:
    """`fn` compiled once with dynamic shapes; times the calls that compiled."""

    instances = 0  # compiled forwards made in this process

    def __init__(self, fn, backend: str = "inductor"):
        # dynamo's limit counts the entries of one code object across the process, and every model
        # (each engine, each family built on models/decoder.py) shares its forward's code objects:
        # room for _ENTRIES more per compiled forward, raised, never lowered
        import torch._dynamo.config as dynamo_config

        CompiledForward.instances += 1
        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        needed = _ENTRIES * CompiledForward.instances
        if getattr(dynamo_config, name) < needed:
            setattr(dynamo_config, name, needed)
        self.cache_dir = inductor_cache_dir()
        self._compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
        self.compile_seconds = 0.0
        self.compiles = 0
        self.cache_hits = 0  # compiles whose inductor graph came from the on-disk cache (a warm start)
        self.cache_misses = 0

    @property
    def warm_start(self) -> bool | None:
        """True when every compile so far found its code in the on-disk cache; None before any."""
        return None if not self.compiles else self.cache_misses == 0

    def __call__(self, input_ids, positions, ctx):
        _mark_batch_dims(input_ids, positions, ctx)
        before = _compiled_graphs()
        counters = _counters()
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        start = time.perf_counter()
        # outside the CPU graph twin's checking dispatch mode (graph_runtime.NoHostCopies), which dynamo refuses
        # to run under; compiled code lifts no Python value at run time anyway
        with _disable_current_modes():
            out = self._compiled(input_ids, positions, ctx)
        if _compiled_graphs() != before:
            self.compile_seconds += time.perf_counter() - start
            self.compiles += _compiled_graphs() - before
            self.cache_hits += counters["inductor"]["fxgraph_cache_hit"] - hits
            self.cache_misses += counters["inductor"]["fxgraph_cache_miss"] - misses
        return out


def _mark_batch_dims(input_ids, positions, ctx) -> None:
    """Make the bucket's row count (and the torch reference's KV width) symbolic.

    Only these dimensions: everything else (hidden sizes, Python floats such as the
    attention scale) stays static, so the compiled code is as specialised as a
    static compile but for the batch. A dimension of size 1 is left alone (dynamo
    would specialise it anyway).
    """
    dims = [(input_ids, 0), (positions, 0)]
    if ctx.decode is not None:
        meta = ctx.decode
        dims += [(meta.seq_lens, 0), (meta.slot_mapping, 0), (meta.block_table, 0), (meta.block_table, 1),
                 (meta.kv_indptr, 0), (meta.kv_indices, 0), (meta.kv_last_page_len, 0)]
        if meta.state_slots is not None:  # a hybrid's recurrent-state slots
            dims.append((meta.state_slots, 0))
    if ctx.verify is not None:  # a speculative window's verify forward: B rows of Q queries
        meta = ctx.verify
        dims += [(meta.block_table, 0), (meta.block_table, 1), (meta.query_positions, 0), (meta.slot_mapping, 0),
                 (meta.live, 0)]
        if meta.state_slots is not None:
            dims.append((meta.state_slots, 0))
    for tensor, dim in dims:
        if tensor.shape[dim] > 1:
            torch._dynamo.mark_dynamic(tensor, dim)
