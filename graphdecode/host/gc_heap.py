"""Keep the startup heap out of the cyclic garbage collector's full collections.

A full (generation 2) collection walks every live container object. A process that has
loaded torch, transformers and a model holds millions of them, all alive for good, so
each full collection stalled the process for 100-580 ms: measured during a
profiling/bench_serve.py run at 256 clients, the engine-core process (a window delayed
that long), the HTTP server (every stream delayed) and the benchmark's client process
each had one or two per run (BENCHMARKS.md section 9). `gc.freeze()` after start-up moves
everything alive then into a permanent generation that collections skip; objects made
later are collected as before. vLLM's server and engine core do the same after start-up.

For long-running processes we own (the engine core, the server); the offline
`LLM.generate` pauses the collector during the call instead (host/llm.py).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze what is alive; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
