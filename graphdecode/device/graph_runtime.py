"""How WindowGraphs captures and replays a window: CUDA graphs, or their CPU twin.

Both give WindowGraphs the same three things: a context for warm-up windows, `capture(fn)`
returning a replayable graph and the memory it took, and the graphs' `replay()`.

* CudaGraphs: `torch.cuda.CUDAGraph`s captured into one shared memory pool, warm-ups on a
  side stream ordered after the current one (what capture needs for its one-time
  allocations), memory measured as the pool's growth.
* CpuGraphTwin: the same protocol on a CPU. Capture records the window callable and executes
  nothing (a CUDA capture executes nothing either); replay calls it again over the same
  static buffers, as a graph replays its kernels over the addresses it captured. It is not
  faster than eager windows; it exists so that every path WindowGraphs takes on a GPU
  (capture largest first, lazy capture of a new variant while rows are live, the warm-up
  window and its save/restore of the window's writes, replay with new inputs) runs in the
  CPU test suite. `LLM(..., cuda_graphs=True)` on a CPU device selects it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CudaGraphs:
    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()  # shared by every graph
        self._warmup_stream = torch.cuda.Stream()

    @contextlib.contextmanager
    def warm_up(self):
        """Run the body on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream()
        self._warmup_stream.wait_stream(current)
        with torch.cuda.stream(self._warmup_stream):
            yield
        current.wait_stream(self._warmup_stream)

    def capture(self, fn: Callable[[], None]) -> tuple[torch.cuda.CUDAGraph, int]:
        """Capture `fn` into a graph of the shared pool -> (graph, bytes the pool grew by)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so the reserved-memory delta below is the graph pool's growth
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        torch.cuda.synchronize()
        return graph, max(0, torch.cuda.memory_reserved() - before)


class NoHostCopies(TorchDispatchMode):
    """Refuses a Python value copied into a tensor inside a window (`t[0] = 0`: `aten.lift_fresh`
    makes a host tensor of the 0, then `aten.copy_` writes it).

    On CUDA that copy is from pageable host memory, which graph capture refuses; on a CPU nothing
    shows it. (A lifted value that feeds `fill_`, as `t[a:b] = 0` does, is read on the host at
    capture and is fine.) The twin's first replay of each window runs under this mode, so the CPU
    suite finds such writes before a GPU does; ops inside custom ops' CPU kernels are below it."""

    def __init__(self):
        super().__init__()
        self._lifted: list[torch.Tensor] = []  # held for the replay, so their ids stay theirs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.lift_fresh.default:
            self._lifted.append(out)
        elif func is torch.ops.aten.copy_.default and any(args[1] is t for t in self._lifted):
            raise RuntimeError(
                "a Python value is copied into a tensor inside a captured window (e.g. `t[0] = 0`): on CUDA "
                "that copy is from host memory, which graph capture refuses; write it with a device op "
                "(`t[:1].zero_()`, fill_, torch.where with a scalar)")
        return out


class RecordedWindow:
    """The CPU twin of a captured graph: the window callable, called again at each replay (the
    first under NoHostCopies)."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        if self.replays > 1:
            self._fn()
            return
        with NoHostCopies():
            self._fn()


class CpuGraphTwin:
    pool = None

    def warm_up(self):
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], None]) -> tuple[RecordedWindow, int]:
        return RecordedWindow(fn), 0


def graph_runtime(device: torch.device) -> CudaGraphs | CpuGraphTwin:
    return CudaGraphs() if device.type == "cuda" else CpuGraphTwin()
