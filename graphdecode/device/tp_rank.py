"""One tensor-parallel rank's torch.distributed setup, shared by the driver (tensor_parallel.py)
and the workers (tp_worker.py): NCCL on GPUs, gloo on CPUs, and a gloo group for the plans."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from ..models.parallel import TPGroup

INIT_TIMEOUT_S = 600  # model load on every rank
OP_TIMEOUT_S = 300  # one collective (gloo raises on a closed peer long before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_rank(rank: int, world_size: int, port: int, device: torch.device):
    """torch.distributed for one rank: (TPGroup for the model's collectives, gloo group for plans)."""
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(device, rank))
    dist.init_process_group(
        backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
    )
    plans = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=OP_TIMEOUT_S))
    return TPGroup(rank, world_size, dist.group.WORLD), plans
