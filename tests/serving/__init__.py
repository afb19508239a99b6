"""Serving: the OpenAI server live on loopback, AsyncLLM, metrics, the CLI, operations options, benchmarks."""
