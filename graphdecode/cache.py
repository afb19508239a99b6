"""The cache directory: built-in models, presets, converted checkpoints, CUDA kernels.

`$GRAPHDECODE_CACHE`, else ~/.cache/graphdecode. `cached_model_dir` builds a model
directory once: into a temporary folder beside it, renamed into place when complete,
so a crash or a concurrent build never leaves a half-written model behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def cache_root() -> str:
    return os.environ.get("GRAPHDECODE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "graphdecode"))


def cached_model_dir(name: str, build: Callable[[str], None]) -> str:
    """cache_root()/name, calling build(tmp_dir) first if it holds no model.safetensors yet."""
    path = os.path.join(cache_root(), name)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".building-")
    try:
        build(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
