"""One tensor-parallel rank's torch.distributed setup, shared by the driver (tensor_parallel.py), the
workers (tp_worker.py) and the ranks a launcher started (launched.py): NCCL on GPUs, gloo on CPUs, and
a gloo group for the plans.

Where the ranks are (`Placement`): on one machine (the default), rank 0 listens on a free loopback port
and spawns ranks 1..N-1; across `nnodes` machines, node n holds ranks n * L .. n * L + L - 1 (L =
tensor_parallel_size / nnodes), node 0's rank 0 listens at master_addr:master_port, and a GPU rank takes
the CUDA device of its local index; under Ray (ray_ranks.py) ranks 1..N-1 are actors meeting rank 0 at this
node's address; under torchrun (distributed_executor_backend "external_launcher")
the launcher's environment says it all (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

Timeouts: the driver waits COLLECTIVE_TIMEOUT_S (GRAPHDECODE_COLLECTIVE_TIMEOUT_S) for any one
collective, so a rank that stops answering is an error in bounded time; a worker waits for its next
plan without limit, since an engine with nothing to do sends none (a worker whose driver is gone learns
it from its closed connection at once, or, on the driver's machine, from its lifeline pipe).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

from ..launcher import launcher_env
from ..models.parallel import TPGroup
from ..models.pipeline import PipelineStage, partition_layers

INIT_TIMEOUT_S = 600  # model load on every rank, and the other nodes' ranks joining
COLLECTIVE_TIMEOUT_ENV = "GRAPHDECODE_COLLECTIVE_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0  # the driver's wait for one collective (gloo raises on a closed peer at once)
WORKER_IDLE_TIMEOUT = datetime.timedelta(days=3650)  # a worker's wait for its next plan: an idle engine sends none


class TPWorkerError(RuntimeError):
    """A tensor-parallel (or pipeline) rank died or was lost; the engine cannot go on."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout_s() -> float:
    text = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1e8:
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV} must be a number of seconds > 0, got {text!r}")
    return value


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the ranks of one engine run and meet. init_method: torch.distributed's ("tcp://addr:port" or
    "env://"); per_node: ranks on each machine (a rank's local index is rank % per_node)."""

    world_size: int
    per_node: int
    init_method: str
    node_rank: int = 0
    launched: bool = False  # torchrun started every rank: none is spawned here
    ray: bool = False  # ranks 1..N-1 are Ray actors (ray_ranks.py), each with its own GPU as its device 0

    @property
    def local_ranks(self) -> range:
        """The ranks of this machine."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @property
    def remote_ranks(self) -> list[int]:
        """The ranks neither in this process nor spawned by it."""
        if self.launched or self.ray:
            return list(range(1, self.world_size))
        return [r for r in range(self.world_size) if r not in self.local_ranks]

    def describe(self, ranks) -> str:
        ranks = list(ranks)
        if self.launched or self.ray:
            where = "of the launcher's job" if self.launched else "(Ray actors)"
            return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} {where}"
        nodes = sorted({r // self.per_node for r in ranks})
        return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} on node{'s' if len(nodes) > 1 else ''} " \
               f"{_ranks(nodes)}"


def _ranks(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def placement_for(config) -> Placement:
    """The engine's ranks as its config (and, under a launcher, the environment) places them."""
    world = config.world_size
    if config.distributed_executor_backend == "external_launcher":
        env = launcher_env()
        return Placement(world, int(env.get("LOCAL_WORLD_SIZE", world)), "env://", launched=True)
    if config.distributed_executor_backend == "ray":  # the actors meet rank 0 at this node's address
        import ray

        address = ray.util.get_node_ip_address()
        return Placement(world, world, f"tcp://{address}:{config.master_port or free_port()}", ray=True)
    if config.nnodes == 1:
        return Placement(world, world, f"tcp://127.0.0.1:{config.master_port or free_port()}")
    addr = f"[{config.master_addr}]" if ":" in config.master_addr else config.master_addr  # IPv6 literal
    return Placement(world, world // config.nnodes, f"tcp://{addr}:{config.master_port}", config.node_rank)


def init_rank(rank: int, place: Placement, device: torch.device, driver: bool):
    """torch.distributed for one rank: the gloo group for plans (then `parallel_groups`, once every rank holds the
    driver's config). The driver bounds every wait on the plans group; a worker waits for its next plan as long
    as the engine idles."""
    if device.type == "cuda":
        torch.cuda.set_device(torch.device("cuda", 0 if place.ray and rank else rank % place.per_node))
    dist.init_process_group(
        backend_for(device), init_method=place.init_method, rank=rank, world_size=place.world_size,
        timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S),
    )
    wait = datetime.timedelta(seconds=collective_timeout_s()) if driver else WORKER_IDLE_TIMEOUT
    return dist.new_group(backend="gloo", timeout=wait)


def parallel_groups(rank: int, config) -> TPGroup:
    """Global rank `rank`'s TPGroup: its tensor rank in its pipeline stage's group, and the stage (the layers it
    holds, its neighbours: models/pipeline.py). Every rank creates every stage's group, in order."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if pp == 1:
        return TPGroup(rank, tp, dist.group.WORLD)
    groups = [dist.new_group(ranks=list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    index, tensor_rank = divmod(rank, tp)
    layers = partition_layers(config.model_config.decoder_layers, pp, config.pp_layer_partition)
    stage = PipelineStage(index, pp, layers[index], prev_rank=rank - tp if index else -1,
                          next_rank=rank + tp if index < pp - 1 else -1, logits_rank=(pp - 1) * tp,
                          every_embedding=config.speculative_method == "mtp" or (
                              config.eagle3_config is not None and not config.eagle3_config.own_embedding))
    return TPGroup(tensor_rank, tp, groups[index], stage)
