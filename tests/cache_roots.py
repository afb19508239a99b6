"""A fresh GRAPHDECODE_CACHE for a test that needs an empty one, without rebuilding the CPU kernels.

A server started on an empty cache root compiles its structured-output automata for real (no disk
hits), but it would also rebuild the CPU kernels (graphdecode/kernels/cpu.py: g++ -O3 of csrc/, about
25 s on 2 cores, whenever the installed package holds no build of the current sources) before it
answers /health. `fresh_cache` gives the new root the current root's kernels/ folder, so what is
built there once is reused; everything else in it (structured/, models, drafts) starts empty."""

from __future__ import annotations

import os

from graphdecode.cache import cache_root


def fresh_cache(path) -> str:
    """Make `path` an empty cache root whose kernels/ is the current root's (a symlink); return it."""
    shared = os.path.join(cache_root(), "kernels")
    os.makedirs(shared, exist_ok=True)
    os.makedirs(path, exist_ok=True)
    os.symlink(shared, os.path.join(path, "kernels"))
    return str(path)
