"""Ranks as Ray actors: distributed_executor_backend="ray" (vLLM's), for clusters that already run Ray (KubeRay,
Ray Serve).

The engine's process is rank 0, as with every backend; ranks 1..N-1 are Ray actors in one placement group (a
bundle per rank: its cpu_threads CPUs, or one GPU and a CPU; packed onto as few nodes as hold them), placed on
the Ray cluster this process is connected to (`ray.init()` first, or RAY_ADDRESS; without either, a local
one is started). Each actor runs tp_worker.serve_rank: it joins rank 0 at this node's address, takes its config
and applies its plans until the engine shuts down. A rank whose actor dies (its process killed, its node lost)
is a TPWorkerError naming it, found before each step or when a collective fails; shutdown waits for the actors
to leave, then kills them and removes the placement group.
"""

from __future__ import annotations

from .tp_rank import INIT_TIMEOUT_S, Placement, TPWorkerError
from .tp_worker import serve_rank


class _Rank:
    """The actor: one rank's process."""

    def serve(self, rank: int, place: Placement, cpu_threads: int, device) -> int:
        serve_rank(rank, place, cpu_threads, device)
        return rank

    def pid(self) -> int:
        import os

        return os.getpid()


class RayRanks:
    """SpawnedRanks' interface (check, stop, procs' pids) over Ray actors."""

    def __init__(self, ranks, place: Placement, config):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=True)
        self.ranks = list(ranks)
        gpu = config.torch_device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": config.cpu_threads}
        self.group = placement_group([bundle] * len(self.ranks), strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=INIT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(self.group)
            raise TPWorkerError(f"Ray could not place tensor-parallel ranks {self.ranks} ({bundle} each) within "
                                f"{INIT_TIMEOUT_S} s: the cluster has {ray.available_resources()} available")
        actor = ray.remote(_Rank)
        self.actors = [actor.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, i)).remote()
                       for i in range(len(self.ranks))]
        self.pids = ray.get([a.pid.remote() for a in self.actors])
        self.done = [a.serve.remote(rank, place, config.cpu_threads, config.torch_device)
                     for a, rank in zip(self.actors, self.ranks)]

    @property
    def procs(self) -> list:
        return []  # not this process's children: worker_pids stays empty

    def check(self) -> None:
        """TPWorkerError naming the first rank whose actor has ended (died, or left its loop)."""
        import ray

        ended, _ = ray.wait(self.done, num_returns=len(self.done), timeout=0)
        for ref in ended:
            rank = self.ranks[self.done.index(ref)]
            try:
                ray.get(ref)
                how = "left"
            except Exception as e:  # noqa: BLE001 - Ray's errors for a dead actor vary by cause
                how = f"died ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
            raise TPWorkerError(f"tensor-parallel rank {rank} (Ray actor, pid {self.pids[self.ranks.index(rank)]}) "
                                f"{how}")

    def stop(self, timeout: float) -> None:
        import ray

        ray.wait(self.done, num_returns=len(self.done), timeout=timeout)
        for a in self.actors:
            ray.kill(a)
        ray.util.remove_placement_group(self.group)
