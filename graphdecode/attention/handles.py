"""Integer handles for attention backends, so a torch.library custom op can name one.

A custom op cannot take a Python object: a backend registers itself at construction
and passes its handle to the op, which looks it up in a weak registry (an engine that
goes away takes its entry with it). The FlashInfer ops and the CPU paged-attention op
use it alike: each op writes the layer's new K/V into the backend's cache by slot and
then attends, so the cache (owned by the backend, never an op argument) never goes
through functionalization, which could copy it.
"""

from __future__ import annotations

import itertools
import weakref

_BACKENDS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> backend
_HANDLES = itertools.count(1)


def register_backend(backend) -> int:
    handle = next(_HANDLES)
    _BACKENDS[handle] = backend
    return handle


def backend_for(handle: int):
    backend = _BACKENDS.get(handle)
    if backend is None:
        raise RuntimeError(f"graphdecode: no live attention backend with handle {handle}")
    return backend
