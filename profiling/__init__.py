"""The benchmark and check scripts: run them as `python profiling/<name>.py` or, from the
repository root, `python -m profiling.<name>` (graphdecode installed, or on PYTHONPATH)."""
