"""nvtx ranges for profilers (the `nvtx` package: no-ops unless a profiler listens).

Imported through here so that a machine whose Python lacks the package (a bare GPU
image, say) still runs the engine, just without named ranges.
"""

from __future__ import annotations

from contextlib import nullcontext

try:
    from nvtx import annotate
except ImportError:  # pragma: no cover - the package is a declared dependency

    def annotate(message=None, **kwargs):  # noqa: ARG001 - same signature as nvtx.annotate
        return nullcontext()


__all__ = ["annotate"]
