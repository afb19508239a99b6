"""A headless node: the tensor-parallel ranks of one machine other than the engine's (`graphdecode serve MODEL
--headless --nnodes N --node-rank R --master-addr A --master-port P -tp T`, vLLM's flags).

Node R holds ranks R * L .. R * L + L - 1 (L = T x PP / N, with PP pipeline stages: -pp). They are spawned here, join node 0's rank 0 at A:P,
take the engine's config from it (this node's own options matter only for the rendezvous, the model
directory's presence and the thread count: the KV pool, buckets and every other option are the driver's),
and apply its plans until it shuts down. The node then exits 0; if a rank fails or the driver is lost,
it exits with that rank's non-zero status, after a line naming the rank on stderr. Ctrl+C or SIGTERM stops
its ranks (each watches a pipe from this process).
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import wait as wait_for_any

from .tensor_parallel import SpawnedRanks
from .tp_rank import placement_for

log = logging.getLogger("graphdecode")


def run_headless(config) -> int:
    """Run this node's ranks until the engine ends; the exit status (0: every rank left cleanly)."""
    if config.world_size == 1 or config.nnodes == 1:
        raise ValueError("--headless: a headless node serves ranks of an engine spread over machines: give "
                         "--nnodes > 1 and --tensor-parallel-size or --pipeline-parallel-size > 1")
    if config.node_rank == 0:
        raise ValueError("node_rank: node 0 runs the engine itself; a headless node is one of 1..nnodes - 1")
    place = placement_for(config)
    ranks = SpawnedRanks(place.local_ranks, place, config)
    print(f"graphdecode: headless node {config.node_rank}: tensor-parallel ranks {list(place.local_ranks)} "
          f"joining {place.init_method}", file=sys.stderr, flush=True)
    status = 0
    try:
        pending = list(ranks.procs)
        while pending:
            for sentinel in wait_for_any([p.sentinel for p in pending]):
                proc = next(p for p in pending if p.sentinel == sentinel)
                proc.join()
                pending.remove(proc)
                if proc.exitcode and not status:
                    status = proc.exitcode
                    rank = ranks.ranks[ranks.procs.index(proc)]
                    print(f"graphdecode: headless node {config.node_rank}: rank {rank} exited with code "
                          f"{proc.exitcode}", file=sys.stderr, flush=True)
    finally:
        ranks.stop(timeout=5.0)
    return status
