"""The device side: a plan in, the window launched, the outputs copied back.

The executor (executor.py: one process; tensor_parallel.py + tp_worker.py: every rank) applies
each plan with its runner (runner.py): staging (row_staging.py) copies changed rows into the
decode state (decode_state.py), prefill samples first tokens, and the window (window.py, or
speculative.py) runs k decode steps (the model forward, sampler.py with token_mask.py and
structured_tables.py, advance_step.py), captured per bucket by graphs.py (graph_runtime.py:
CUDA graphs or their CPU twin; window_writes.py: what a window may write; bounds.py: the
bounds-checked mode); the outputs come back through an async copy (pythonizer.py).
"""
