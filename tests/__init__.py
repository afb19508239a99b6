"""The test suite, by layer: unit/ (pure functions), host/ (the engine through LLM on a CPU),
device/ (the runner and device-side pieces, on a CPU), kernels/ (the C++/CUDA kernels' CPU
paths and builds), serving/ (the server, AsyncLLM, the CLI, benchmarks), gpu/ (CUDA; skipped
without it, and the rehearsal of profiling/gpu_check), architecture/ (the package's import
edges). conftest.py holds the fixtures every layer shares, helpers.py the plain helpers."""
