"""WindowGraphs: the one owner of decode-window execution and its CUDA graphs.

The buckets, one graph per (bucket, sampler variant) holding k
whole decode steps (forward, sample, done flags, advance_step), one memory pool
shared by every graph, captured largest bucket first so smaller graphs reuse its
blocks. With cuda_graphs=False the same `decode_window` runs eagerly; with graphs on a
CPU device the capture and replay go through the CPU twin (graph_runtime.py), so this
file's every path runs in the CPU suite.

A variant is a SamplerVariant (mode, logprobs on/off, stop-id masking for min_tokens,
the penalty path on/off).
Plain GREEDY and SAMPLE graphs are captured up front; other variants the first time a
window needs them, which
can be while live rows sit in the decode state. Capture needs a warm-up run (it
compiles the forward and lets libraries make their one-time allocations); that run
really executes and would advance live rows, so everything a window may write
(window_writes.py: the decode state, the MoE counters) is saved before it and
restored after. Its K/V writes land at or beyond each row's current
position (or on the scratch page) and the real window rewrites those slots before
reading them. The capture itself only records, it executes nothing.

Every bucket's attention is planned once, here, before anything runs it
(`backend.plan_decode`); a replay is one `graph.replay()` with no host sync.

With a compiled forward, the warm-up before a capture is where it compiles (once
for bucket 1 and once for all larger buckets: see torch_compile.py); without graphs,
`warm_up()` runs those two shapes at construction instead. `capture_seconds` counts
warm-up and capture time net of compiling, which the compiled forward reports itself.
"""

from __future__ import annotations

import dataclasses
import time

from .graph_runtime import graph_runtime
from .pipeline_window import pipelined_window
from .sampler import GREEDY, SamplerMode, SamplerVariant
from .speculative import speculative_window
from .window import decode_window
from .window_writes import WindowWrites


class WindowGraphs:
    def __init__(self, logits_fn, sampler, backend, state, *, buckets, num_decode_steps, page_size, use_graphs,
                 writes: WindowWrites, drafter=None, commit_states=None, pipeline=None):
        self.logits_fn = logits_fn  # (input_ids, positions, ctx) -> logits; eager or torch.compile'd
        self.sampler = sampler
        self.backend = backend
        self.state = state
        self.writes = writes  # what a window may write: saved and restored around warm-up windows
        self.buckets = tuple(sorted(buckets))
        self.num_decode_steps = num_decode_steps
        self.page_size = page_size
        self.use_graphs = use_graphs
        self.drafter = drafter  # where speculative windows' drafts come from (drafters.py)
        self.commit_states = commit_states  # a hybrid's: recurrent states over each round's accepted positions
        self.pipeline = pipeline  # (model, micro-batches): a pipeline stage's windows overlap (pipeline_window.py)
        # CUDA graphs on a GPU, their CPU twin on a CPU (graph_runtime.py): the same logic below
        self.runtime = graph_runtime(state.input_ids.device) if use_graphs else None
        self.graphs: dict[tuple[int, SamplerVariant], object] = {}  # CUDAGraph or RecordedWindow
        self.capture_order: list[tuple[int, SamplerVariant]] = []
        self.capture_seconds = 0.0  # warm-up + capture, compile time excluded
        self.graph_memory_bytes = 0
        for bucket in self.buckets:
            backend.plan_decode(bucket, state.decode_metadata(bucket, state.max_pages))
            if state.spec_tokens:
                backend.plan_verify(bucket, state.spec_tokens + 1, state.max_rows, state.verify_pages)

    def run(self, bucket: int, variant: SamplerVariant, kv_width: int, ragged: bool = False) -> None:
        """One window of k decode steps. kv_width: pages per row an eager torch-reference
        window gathers (graphs gather every column)."""
        if not self.use_graphs:
            self._window(bucket, variant, kv_width, ragged)
            return
        graph = self.graphs.get((bucket, variant))
        if graph is None:
            graph = self._capture((bucket, variant))
        graph.replay()

    def capture_all(self) -> None:
        """Capture the common variants for every bucket, largest first, into one pool."""
        for bucket in reversed(self.buckets):
            variants = [GREEDY, SamplerVariant(SamplerMode.SAMPLE)]
            if self.state.spec_tokens:
                variants += [dataclasses.replace(v, speculative=True) for v in variants]
            for variant in variants:
                if (bucket, variant) not in self.graphs:
                    self._capture((bucket, variant))

    @property
    def compiled(self) -> bool:
        """Whether the forward is a torch.compile'd one (its shapes must stay static-ish)."""
        return hasattr(self.logits_fn, "compile_seconds")

    @property
    def compile_seconds(self) -> float:
        return getattr(self.logits_fn, "compile_seconds", 0.0)

    def warm_up(self) -> None:
        """Without graphs: run bucket 1 and the smallest larger bucket once, so a compiled
        forward compiles now rather than in a user's first windows (the state is restored)."""
        saved = self.writes.snapshot()
        # the width real windows pass: every column where pages are read in place, else >= 2 (runner._kv_width)
        width = self.state.max_pages if self.backend.reads_pages_in_place else min(2, self.state.max_pages)
        for bucket in self.buckets[:2]:
            self._window(bucket, GREEDY, width)
        self.writes.restore(saved)

    def _window(self, bucket, variant, kv_width, ragged: bool = False) -> None:
        if variant.speculative:
            speculative_window(
                self.logits_fn, self.sampler, self.backend, self.state, bucket, self.num_decode_steps,
                self.page_size, variant, kv_width, self.drafter, self.commit_states,
            )
            return
        if self.pipeline is not None and bucket >= self.pipeline[1]:  # a micro-batch of at least one row each
            model, micro = self.pipeline
            pipelined_window(model, self.sampler, self.backend, self.state, bucket, self.num_decode_steps,
                             self.page_size, variant, kv_width, micro)
            return
        decode_window(
            self.logits_fn, self.sampler, self.backend, self.state, bucket, self.num_decode_steps,
            self.page_size, variant, kv_width, ragged, self.drafter,
        )

    def _capture(self, key):
        """Warm up (a real window, its writes saved and restored: rows may be live), then capture."""
        bucket, variant = key
        width = self.state.max_pages  # static width: one graph serves every length
        start, compiled_before = time.perf_counter(), self.compile_seconds
        saved = self.writes.snapshot()
        with self.runtime.warm_up():
            self._window(bucket, variant, width)
        self.writes.restore(saved)
        del saved
        graph, memory = self.runtime.capture(lambda: self._window(bucket, variant, width))
        self.graph_memory_bytes += memory
        self.graphs[key] = graph
        self.capture_order.append(key)
        self.capture_seconds += time.perf_counter() - start - (self.compile_seconds - compiled_before)
        return graph
