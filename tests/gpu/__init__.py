"""CUDA: marked `gpu` (skipped without a GPU; profiling/gpu_check runs them), and the rehearsal of gpu_check."""
