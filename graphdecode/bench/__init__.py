"""Benchmark tooling: the bucket sweep `graphdecode bench` runs (sweep.py), what the profiling
scripts share (common.py: machine info, prompts, JSON), the serving benchmark's client pool
(clients.py) and the random-weight model presets (presets.py, preset_configs/)."""
