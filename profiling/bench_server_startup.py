"""Server start-up, two checkouts side by side: seconds from `graphdecode serve` (as a fresh process) to the first
200 on /health, then to its exit after SIGTERM, the checkouts alternating round by round (so a drifting
machine hits both alike), after one start of each that is not counted (it may build the kernel library); the
median and best of the rounds per checkout.

    python profiling/bench_server_startup.py --before /tmp/old --after . --rounds 5
    python profiling/bench_server_startup.py --after . --model DIR     # one checkout

The model is the built-in default (or --model); one CPU thread, as the tests start their servers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdecode.server.launch import start_server, stop_server  # noqa: E402


def start_once(tree: str, model: str | None, threads: int, timeout_s: float = 120.0) -> dict:
    """One start of the server from checkout `tree` (run from /tmp, so that `-m` imports the tree's package):
    seconds to the first 200 on /health, and to exit after SIGTERM."""
    args = ["--threads", str(threads), "--no-access-log", "--log-level", "warning"] + (["--model", model] if model
                                                                                      else [])
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        proc, _ = start_server(args, os.path.join(work, "server.log"), timeout_s, env=env, poll_s=0.02, cwd="/tmp")
        up = time.perf_counter() - start
        stop = time.perf_counter()
        stop_server(proc)
        return {"ready_s": up, "exit_s": time.perf_counter() - stop}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="the baseline checkout (omit: only --after)")
    parser.add_argument("--after", default=".")
    parser.add_argument("--model", help="model directory (default: the built-in default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    trees = {"before": args.before, "after": args.after} if args.before else {"after": args.after}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for tree in trees.values():  # not counted: a checkout's first start may build its kernel library
        start_once(tree, args.model, args.threads)
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(start_once(tree, args.model, args.threads))
    result = {}
    for name, points in runs.items():
        ready = [p["ready_s"] for p in points]
        result[name] = {"tree": trees[name], "ready_median_s": statistics.median(ready), "ready_best_s": min(ready),
                        "exit_median_s": statistics.median(p["exit_s"] for p in points), "rounds": points}
        print(f"{name:>6} ({trees[name]}): ready median {result[name]['ready_median_s']:.2f} s, best "
              f"{result[name]['ready_best_s']:.2f} s; exit after SIGTERM median {result[name]['exit_median_s']:.2f} s")
    if args.before:
        result["after_vs_before"] = result["after"]["ready_median_s"] / result["before"]["ready_median_s"]
        print(f"after / before (median ready): {result['after_vs_before']:.2f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
