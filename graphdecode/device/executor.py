"""Executors: what the host hands each plan to, and all it knows of the device.

    pending = executor.execute(plan)   stage rows, prefill, launch the window, start the copy out
    result  = pending.result()         the window's outputs on the host (the one wait)
    executor.stats()                   the device side's counters
    executor.update_weights(weights)   new weights, in place, between windows (or update_weights_from_disk)
    executor.close()                   stop whatever the executor started

`LocalExecutor` runs one model runner in this process. `TensorParallelExecutor` owns every rank:
it starts the worker ranks of its machine (and meets those of other nodes, or of a launcher's job), sends each plan to them before its own runner (rank 0) applies it,
and turns a collective that failed because a worker died into TPWorkerError (closing the rest).
`make_executor` picks one from the config. `runner` (rank 0's) is there for tests and profiling;
the engine itself uses only the calls above.
"""

from __future__ import annotations

import contextlib

from ..models.parallel import TPGroup
from ..models.weight_update import checkpoint_tensors
from ..plan import StepPlan
from .pythonizer import PendingCopy
from .runner import ModelRunner
from .tp_worker import NewWeights


class LocalExecutor:
    def __init__(self, config, tp: TPGroup = TPGroup()):
        self.runner = ModelRunner(config, tp)

    def execute(self, plan: StepPlan) -> PendingCopy | None:
        return self.runner.execute(plan)

    def stats(self) -> dict:
        return self.runner.stats()

    def update_weights(self, weights) -> tuple[list[str], list[str]]:
        """New weights in place (ModelRunner.update_weights): (names written, names skipped)."""
        return self.runner.update_weights(weights)

    def update_weights_from_disk(self, model_path) -> tuple[list[str], list[str]]:
        """update_weights with a checkpoint directory's tensors, read here (with tensor parallelism, by rank 0 only,
        which sends them on: the other nodes need not see the path)."""
        return self.update_weights(checkpoint_tensors(model_path))

    def close(self) -> None:
        """Nothing to stop in one process."""


class TensorParallelExecutor(LocalExecutor):
    def __init__(self, config):
        from .tensor_parallel import TPExecutor

        self.ranks = TPExecutor(config)  # ranks 1..N-1, started and waited for
        try:
            super().__init__(config, self.ranks.tp)
        except BaseException:
            self.ranks.shutdown()
            raise

    def execute(self, plan: StepPlan) -> PendingCopy | None:
        with self._ranks_named():
            self.ranks.broadcast_plan(plan)
            return self.runner.execute(plan)

    @contextlib.contextmanager
    def _ranks_named(self):
        """A collective that failed because a rank died raises TPWorkerError naming it (the rest closed)."""
        try:
            yield
        except Exception as exc:
            dead = self.ranks.collective_failed(exc)
            if dead is None:
                raise
            self.close()
            raise dead from exc

    def update_weights(self, weights) -> tuple[list[str], list[str]]:
        """Every rank writes its part of every tensor; rank 0 checks them all first, so a refusal reaches no rank.
        (names any rank wrote, names every rank skipped: a pipeline stage skips the others' layers)."""
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        checked = self.runner.check_weights(pairs)
        with self._ranks_named():
            answers = self.ranks.gather_from_workers(NewWeights(pairs))[1:]
        failed = next((answer for answer in answers if isinstance(answer, str)), None)
        if failed is not None:
            raise ValueError(failed)
        results = [self.runner.write_weights(*checked), *answers]
        written = list(dict.fromkeys(key for keys, _ in results for key in keys))
        skipped = [key for key in results[0][1] if all(key in set(other) for _, other in results[1:])]
        return written, skipped

    @property
    def worker_pids(self) -> list[int]:
        return self.ranks.worker_pids

    def gather_from_workers(self, request: str) -> list:
        return self.ranks.gather_from_workers(request)

    def close(self) -> None:
        self.ranks.shutdown()


def make_executor(config) -> LocalExecutor:
    """One process; or every rank, this process rank 0. Under a launcher (torchrun), a process of another rank
    serves rank 0 here and exits when it is done (launched.py); on a node other than 0 an engine is refused (its
    ranks are served by `graphdecode serve --headless`)."""
    if config.world_size == 1:
        return LocalExecutor(config)
    if config.distributed_executor_backend == "external_launcher":
        from .launched import is_driver, serve_launched_rank

        if not is_driver():
            serve_launched_rank(config)
    elif config.node_rank != 0:
        raise ValueError(f"node_rank ({config.node_rank}): the engine runs on node 0; on node {config.node_rank} "
                         f"run `graphdecode serve MODEL --headless` with the same --nnodes, --master-addr and "
                         f"--master-port")
    return TensorParallelExecutor(config)
