"""Serving: AsyncLLM (the engine core in its own process) and the OpenAI-compatible HTTP server."""

from .async_llm import AsyncLLM, EngineDeadError, RequestFailedError

__all__ = ["AsyncLLM", "EngineDeadError", "RequestFailedError"]
