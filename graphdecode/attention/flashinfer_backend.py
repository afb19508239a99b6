"""FlashInfer paged attention (CUDA). Filled in by the GPU-path work."""

from __future__ import annotations


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True
