"""Serving: AsyncLLM (the engine core in its own process) and the OpenAI-compatible HTTP server."""

from .async_llm import AsyncLLM, EngineDeadError

__all__ = ["AsyncLLM", "EngineDeadError"]
