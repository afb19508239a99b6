"""WindowGraphs: the one owner of decode-window execution and its CUDA graphs.

Buckets, the size -> bucket map, one graph per (bucket, sampler variant) holding k
whole decode steps, one shared memory pool, capture largest bucket first. On CPU (or
with cuda_graphs=False) the same `decode_window` runs eagerly.

A variant is (sampler mode, logprobs on/off). GREEDY and SAMPLE graphs are captured
up front; FILTERED and logprobs variants are captured the first time a window needs
them. Capturing needs a warm-up run, which would advance live rows, so the decode
state is snapshotted before and restored after it.
"""

from __future__ import annotations

import time

import torch

from .sampler import SamplerMode
from .window import decode_window


class WindowGraphs:
    def __init__(self, logits_fn, sampler, backend, state, *, buckets, steps, page_size, max_logprobs, use_graphs):
        self.logits_fn = logits_fn  # (input_ids, positions, ctx) -> logits; eager or torch.compile'd
        self.sampler = sampler
        self.backend = backend
        self.state = state
        self.buckets = tuple(sorted(buckets))
        self.steps = steps
        self.page_size = page_size
        self.max_logprobs = max_logprobs
        self.use_graphs = use_graphs
        self._bucket_of = []  # size -> smallest bucket holding it
        for size in range(self.buckets[-1] + 1):
            self._bucket_of.append(next(b for b in self.buckets if b >= size))
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    def bucket_for(self, num_rows: int) -> int:
        return self._bucket_of[num_rows]

    def run(self, bucket: int, steps: int, mode: SamplerMode, num_logprobs: int, max_kv_pages: int) -> None:
        if steps == 0:
            return
        if not self.use_graphs or steps != self.steps:
            self._eager(bucket, steps, mode, num_logprobs, max_kv_pages)
            return
        key = (bucket, int(mode), num_logprobs)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key)
        graph.replay()

    def capture_all(self) -> None:
        """Capture the common variants for every bucket, largest first, into one pool."""
        for bucket in reversed(self.buckets):
            for mode in (SamplerMode.GREEDY, SamplerMode.SAMPLE):
                if (bucket, int(mode), 0) not in self.graphs:
                    self._capture((bucket, int(mode), 0))

    def _eager(self, bucket, steps, mode, num_logprobs, max_kv_pages) -> None:
        decode_window(
            self.logits_fn, self.sampler, self.backend, self.state, bucket, steps,
            self.page_size, SamplerMode(mode), num_logprobs, max_kv_pages,
        )

    def _capture(self, key) -> torch.cuda.CUDAGraph:
        bucket, mode, num_logprobs = key
        width = self.state.max_pages  # static width: graphs must cover any length
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        self.backend.plan_decode(bucket, self.state.decode_metadata(bucket, width))
        saved = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._eager(bucket, self.steps, mode, num_logprobs, width)  # warm-up (and compile)
        torch.cuda.current_stream().wait_stream(side)
        self.state.restore(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._eager(bucket, self.steps, mode, num_logprobs, width)
        if self._pool is None:
            self._pool = graph.pool()
        torch.cuda.synchronize()
        self.graphs[key] = graph
        self.capture_seconds += time.perf_counter() - start
        self.graph_memory_bytes += torch.cuda.memory_reserved() - before
        return graph
