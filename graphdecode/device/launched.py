"""Ranks a launcher started: `torchrun --nnodes N --nproc-per-node M script.py`, every process running the
same script, which builds `LLM(..., tensor_parallel_size=N * M, distributed_executor_backend=
"external_launcher")`.

The process of RANK 0 is the engine (its LLM returns and drives, as with any other backend). In every other
process, building the LLM joins the ranks (torch.distributed's env:// rendezvous: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE), takes the engine's config from rank 0 and serves its plans; when rank 0 closes its LLM
(or its process ends), the call exits the process with status 0, so the script's code after building the
LLM runs on rank 0 alone. A rank that loses the others (rank 0 died) exits with status 1 after a line
on stderr, and torchrun ends the job.
"""

from __future__ import annotations

from ..launcher import launcher_env
from .tp_rank import placement_for
from .tp_worker import serve_rank


def is_driver() -> bool:
    """This process is the launched job's rank 0."""
    return int(launcher_env()["RANK"]) == 0


def serve_launched_rank(config) -> None:
    """Serve rank 0's plans as this process's RANK, then exit the process (status 0)."""
    rank = int(launcher_env()["RANK"])
    serve_rank(rank, placement_for(config), config.cpu_threads, config.torch_device)
    raise SystemExit(0)
