"""torch.compile for the decode forward: fullgraph, static shapes, one entry per bucket.

With dynamic=False every bucket size is its own compiled entry of the same code
object, and dynamo stops compiling a code object after `recompile_limit` entries
(8 by default) and falls back to eager: the default 9 buckets would already cross
it. The limit is raised (never lowered) to leave room for every bucket.
"""

from __future__ import annotations

import torch
import torch._dynamo.config as dynamo_config

_ENTRIES_PER_BUCKET = 2  # slack: e.g. a guard on a Python int that differs between eager and captured windows


def compile_decode_logits(fn, num_buckets: int):
    needed = _ENTRIES_PER_BUCKET * num_buckets + 8
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if getattr(dynamo_config, name) < needed:
        setattr(dynamo_config, name, needed)
    return torch.compile(fn, fullgraph=True, dynamic=False)
