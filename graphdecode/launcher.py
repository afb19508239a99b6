"""What a launcher tells a rank: torchrun's env:// variables, and the rendezvous port across machines.

Read by the config (validating distributed_executor_backend "external_launcher") and by the device side
(device/tp_rank.py: where the ranks meet); nothing else of graphdecode is imported here.
"""

from __future__ import annotations

import os

DEFAULT_MASTER_PORT = 29501  # node 0's rendezvous port across machines when none is given (vLLM's default)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets


def launcher_env() -> dict:
    """torchrun's variables (LOCAL_WORLD_SIZE too, where set); ValueError naming the backend and what is missing
    outside a launcher."""
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise ValueError(f"distributed_executor_backend 'external_launcher' runs under torchrun (or another "
                         f"env:// launcher): {', '.join(missing)} not set in the environment")
    env = {name: os.environ[name] for name in (*LAUNCHER_ENV, "LOCAL_WORLD_SIZE") if name in os.environ}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name in env and not env[name].isdigit():
            raise ValueError(f"distributed_executor_backend 'external_launcher': {name} must be an integer, got "
                             f"{env[name]!r}")
    return env
