"""Server start-up, two checkouts side by side: seconds from `graphdecode serve` (as a fresh process) to the first
200 on /v1/models, then to its exit after SIGTERM, the checkouts alternating round by round (so a drifting
machine hits both alike); the median and best of the rounds per checkout.

    python profiling/bench_server_startup.py --before /tmp/old --after . --rounds 5
    python profiling/bench_server_startup.py --after . --model DIR     # one checkout

The model is the built-in default (or --model); one CPU thread, as the tests start their servers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(tree: str, model: str | None, threads: int, timeout_s: float = 120.0) -> dict:
    """One start of the server from checkout `tree`: seconds to the first 200, and to exit after SIGTERM."""
    port = _free_port()
    cmd = [sys.executable, "-m", "graphdecode.server.openai_api", "--port", str(port), "--threads", str(threads),
           "--no-access-log", "--log-level", "warning"]
    if model:
        cmd += ["--model", model]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{tree}: the server exited with status {proc.returncode} before it answered")
            if time.perf_counter() - start > timeout_s:
                raise RuntimeError(f"{tree}: no answer in {timeout_s:.0f} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        up = time.perf_counter() - start
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        return {"ready_s": up, "exit_s": time.perf_counter() - stop}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
