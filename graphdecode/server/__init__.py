"""Serving: AsyncLLM (the engine core in its own process) and the OpenAI-compatible HTTP server.

The public names load on first use (PEP 562): `server.args` (what `graphdecode --help` reads)
does not import the engine.
"""

import importlib

__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'graphdecode.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(".async_llm", __name__), name)
    globals()[name] = value
    return value
