"""Load and faults against a live `graphdecode serve`: what a hostile client, a crashing or frozen
engine core and an impatient operator do to it, measured.

The script starts the server itself (a subprocess; `--repo DIR` serves another checkout, to
measure before and after a change side by side) and runs these stages (`--stages`):

* load: N streaming clients at once (greedy, distinct prompts cycled), a share of them
  (`--drop`) hanging up after their first chunks; every completed stream's text is checked
  against the same request run alone afterwards; counts 5xx, hangs and mismatches, and
  whether /metrics' running and waiting gauges are back at 0 within 5 s;
* fuzz: every numeric field of /v1/completions with 2**31, 2**32 + 1, 2**63, 10**30, -1,
  -2**63, 1e308, NaN-ish strings, wrong types: 4xx / 5xx / hangs, and whether the server
  still serves and /health is 200 afterwards;
* compile: over-budget constraints (`[a-z]{1,2000}`, the report's; a 5,000-character
  maxLength schema; a regex whose DFA blows up, `(a|b)*a(a|b){17}`): each one's status and
  seconds, the peak RSS of the server's process tree above its baseline while they run,
  and a plain request's latency meanwhile;
* sigterm: SIGTERM while a constraint compiles: seconds to exit, exit status;
* kill_core: `kill -9` of the engine core: seconds until the server exits, its status, and
  whether its log names the cause;
* stop_core: SIGSTOP of the engine core: seconds until /health is 503; SIGCONT: seconds until
  it is 200 again.

    python profiling/bench_faults.py --model DIR --clients 128 --drop 0.3
    python profiling/bench_faults.py --model DIR --repo /tmp/old-checkout --out profiling/out/faults_before.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx

from graphdecode.bench.common import git_commit, write_json
from graphdecode.device.tp_rank import free_port

NAME = "faults"
REGEX_OVER = "[a-z]{1,2000}"
EXPLODING = "(a|b)*a(a|b){17}"
SCHEMA_OVER = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5000}}, "required": ["a"]}
HOSTILE = [2**31, 2**32 + 1, 2**63, 10**30, -1, -(2**63), 1e308, "x", None, True, [1], {"a": 1}]
NUMERIC_FIELDS = ["max_tokens", "min_tokens", "n", "top_k", "top_p", "min_p", "temperature", "seed", "logprobs",
                  "presence_penalty", "frequency_penalty", "repetition_penalty", "priority",
                  "truncate_prompt_tokens", "best_of"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time",
           "The three primary colors are", "In 1969, astronauts", "A good breakfast has", "The sun rises in the",
           "Python lists are", "The tallest mountain is", "Photosynthesis converts", "A haiku about rain:",
           "The speed of light is", "Cats like to", "The opposite of hot is", "My favourite number is"]


# ------------------------------------------------------------------ the server
class Server:
    def __init__(self, args, extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(args.out_dir, f"server-{self.port}.log")
        env = dict(os.environ)
        if args.repo:
            env["PYTHONPATH"] = args.repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "graphdecode.server.openai_api", "--port", str(self.port), "--model", args.model,
               "--served-model-name", NAME, "--no-access-log", "--log-level", "warning",
               "--max-model-len", str(args.max_model_len), "--max-batch-size", str(args.max_batch_size),
               *args.server_args, *extra]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=args.repo or None)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not come up")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def core_pid(self) -> int | None:
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for pid in f.read().split():
                    with open(f"/proc/{pid}/cmdline", "rb") as cmd:
                        if b"engine_core" in cmd.read():
                            return int(pid)
        return None

    def tree_rss(self) -> int:
        """RSS of the server and its children (the engine core, compile workers), bytes."""
        total, pids = 0, [self.proc.pid]
        while pids:
            pid = pids.pop()
            try:
                with open(f"/proc/{pid}/status") as f:
                    total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        pids += [int(p) for p in f.read().split()]
            except (OSError, StopIteration):
                continue
        return total

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _body(**extra) -> dict:
    return {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, **extra}


def _gauges(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{")[0].split(" ")[0]
        if name.endswith(("num_requests_running", "num_requests_waiting")):
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


# ------------------------------------------------------------------ stages
async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, drop_after: int | None):
    """(text or None if dropped, status, hung)."""
    body = _body(prompt=prompt, max_tokens=max_tokens, stream=True, ignore_eos=True)
    text, chunks = "", 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                await response.aread()
                return None, response.status_code, False
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return None, 200, False  # hang up mid-stream
            return text, 200, False
    except httpx.TimeoutException:
        return None, 0, True


def stage_load(args) -> dict:
    server = Server(args)
    try:
        rng = random.Random(0)
        jobs = [(PROMPTS[i % len(PROMPTS)], rng.randint(1, 3) if rng.random() < args.drop else None)
                for i in range(args.clients)]

        async def run():
            limits = httpx.Limits(max_connections=args.clients + 8)
            async with httpx.AsyncClient(limits=limits) as client:
                return await asyncio.gather(*[_stream(client, server.url, p, args.max_tokens, d) for p, d in jobs])

        started = time.perf_counter()
        results = asyncio.run(run())
        seconds = time.perf_counter() - started
        deadline, gauges = time.monotonic() + 5, {}
        while time.monotonic() < deadline:
            gauges = _gauges(server.url)
            if not any(gauges.values()):
                break
            time.sleep(0.2)
        references = {}
        for prompt in sorted({p for p, d in jobs if d is None}):
            response = httpx.post(f"{server.url}/v1/completions", json=_body(
                prompt=prompt, max_tokens=args.max_tokens, ignore_eos=True), timeout=120)
            references[prompt] = response.json()["choices"][0]["text"]
        completed = [(p, r[0]) for (p, d), r in zip(jobs, results) if d is None and r[0] is not None]
        return {
            "clients": args.clients, "dropped": sum(d is not None for _, d in jobs), "seconds": round(seconds, 2),
            "completed": len(completed), "mismatches": sum(text != references[p] for p, text in completed),
            "errors_5xx": sum(r[1] >= 500 for r in results), "hangs": sum(r[2] for r in results),
            "gauges_back_to_zero": not any(gauges.values()), "gauges": gauges,
        }
    finally:
        server.stop()


def stage_fuzz(args) -> dict:
    server = Server(args)
    counts = {"2xx": 0, "4xx": 0, "5xx": 0, "hangs": 0, "other": 0}
    unnamed = []
    try:
        with httpx.Client(timeout=30) as client:
            for field in NUMERIC_FIELDS:
                for value in HOSTILE:
                    try:
                        response = client.post(f"{server.url}/v1/completions", json=_body(**{field: value}))
                    except httpx.TimeoutException:
                        counts["hangs"] += 1
                        continue
                    except httpx.HTTPError:
                        counts["other"] += 1
                        continue
                    code = response.status_code
                    key = "2xx" if code < 300 else "4xx" if code < 500 else "5xx"
                    counts[key] += 1
                    if key == "4xx" and field not in json.dumps(response.json()):
                        unnamed.append((field, repr(value)))
            alive = server.proc.poll() is None
            served = alive and client.post(f"{server.url}/v1/completions", json=_body()).status_code == 200
            health = alive and client.get(f"{server.url}/health").status_code == 200
        return {**counts, "cases": len(NUMERIC_FIELDS) * len(HOSTILE), "4xx_not_naming_the_field": len(unnamed),
                "served_after": served, "health_after": health, "server_alive": alive}
    finally:
        server.stop()


def _timed_post(url: str, body: dict, timeout: float) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        code = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout).status_code
    except httpx.TimeoutException:
        code = 0
    return code, round(time.perf_counter() - started, 2)


def stage_compile(args) -> dict:
    server = Server(args)
    try:
        assert httpx.post(f"{server.url}/v1/completions", json=_body(), timeout=60).status_code == 200
        baseline = server.tree_rss()
        peak, sampling = [baseline], threading.Event()

        def sample():
            while not sampling.is_set():
                peak[0] = max(peak[0], server.tree_rss())
                time.sleep(0.1)

        sampler = threading.Thread(target=sample)
        sampler.start()
        plain_latency = []
        cases = {"regex_2000": {"guided_regex": REGEX_OVER},
                 "schema_maxlength_5000": {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": SCHEMA_OVER}}},
                 "exploding_dfa": {"guided_regex": EXPLODING}}
        out = {}
        for name, extra in cases.items():
            if name not in args.compile_cases:
                continue
            result = {}
            thread = threading.Thread(target=lambda: result.update(
                code_seconds=_timed_post(server.url, _body(max_tokens=4, **extra), args.compile_timeout)))
            thread.start()
            while thread.is_alive():
                plain_latency.append(_timed_post(server.url, _body(max_tokens=2), 60)[1])
                time.sleep(0.2)
            thread.join()
            out[name] = {"status": result["code_seconds"][0], "seconds": result["code_seconds"][1]}
        sampling.set()
        sampler.join()
        out["server_tree_rss_baseline_mb"] = baseline >> 20
        out["server_tree_rss_peak_above_baseline_mb"] = (peak[0] - baseline) >> 20
        out["plain_request_seconds_max"] = max(plain_latency) if plain_latency else None
        out["alive_after"] = server.proc.poll() is None
        return out
    finally:
        server.stop()


def stage_sigterm(args) -> dict:
    server = Server(args)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        code_seconds=_timed_post(server.url, _body(guided_regex=EXPLODING + "b"), args.compile_timeout)))
    thread.start()
    time.sleep(1.5)
    started = time.perf_counter()
    code = server.stop(timeout=120)
    seconds = time.perf_counter() - started
    thread.join(30)
    return {"exit_seconds": round(seconds, 2), "exit_status": code,
            "compiling_request_status": result.get("code_seconds", (None,))[0]}


def stage_kill_core(args) -> dict:
    server = Server(args)
    try:
        core = server.core_pid()
        started = time.perf_counter()
        os.kill(core, signal.SIGKILL)
        try:
            code = server.proc.wait(30)
            seconds = round(time.perf_counter() - started, 2)
        except subprocess.TimeoutExpired:
            code, seconds = None, None  # still up after 30 s
        log = server.log()
        return {"exit_status": code, "seconds_to_exit": seconds,
                "log_names_the_cause": "SIGKILL" in log or "signal 9" in log or "-9" in log}
    finally:
        server.stop(timeout=10)


def stage_stop_core(args) -> dict:
    server = Server(args, args.stop_core_args)
    try:
        core = server.core_pid()

        def health() -> int:
            try:
                return httpx.get(f"{server.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                return 0

        started = time.perf_counter()
        os.kill(core, signal.SIGSTOP)
        to_503 = None
        while time.perf_counter() - started < args.stop_seconds:
            if health() == 503:
                to_503 = round(time.perf_counter() - started, 2)
                break
            time.sleep(0.2)
        os.kill(core, signal.SIGCONT)
        started = time.perf_counter()
        to_200 = None
        while time.perf_counter() - started < 30:
            if health() == 200:
                to_200 = round(time.perf_counter() - started, 2)
                break
            time.sleep(0.2)
        served = _timed_post(server.url, _body(), 60)[0] == 200
        return {"seconds_to_503": to_503, "seconds_back_to_200": to_200, "served_after": served}
    finally:
        server.stop()


STAGES = {"load": stage_load, "fuzz": stage_fuzz, "compile": stage_compile, "sigterm": stage_sigterm,
          "kill_core": stage_kill_core, "stop_core": stage_stop_core}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model directory to serve")
    parser.add_argument("--repo", default=None, help="serve this checkout instead (PYTHONPATH), for before/after")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated: " + ", ".join(STAGES))
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--drop", type=float, default=0.3, help="share of streaming clients hanging up mid-stream")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--compile-timeout", type=float, default=180.0, help="client timeout of a constraint request")
    parser.add_argument("--compile-cases", default="regex_2000,schema_maxlength_5000,exploding_dfa",
                        help="the compile stage's cases (an unbounded server may need ~12 GB for the schema)")
    parser.add_argument("--stop-seconds", type=float, default=20.0, help="how long the core stays stopped")
    parser.add_argument("--server-args", default="", help="more `serve` arguments, one string")
    parser.add_argument("--stop-core-args", default="", help="`serve` arguments for the stop_core stage only")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.server_args = args.server_args.split()
    args.compile_cases = args.compile_cases.split(",")
    args.stop_core_args = args.stop_core_args.split()
    args.out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else "/tmp"
    os.makedirs(args.out_dir, exist_ok=True)
    results = {"commit": git_commit() if args.repo is None else None, "repo": args.repo, "model": args.model,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name in args.stages.split(","):
        print(f"[bench_faults] {name} ...", file=sys.stderr, flush=True)
        try:
            results[name] = STAGES[name](args)
        except Exception as exc:  # noqa: BLE001 - a stage that cannot run is reported, the others still run
            results[name] = {"failed": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps({name: results[name]}), flush=True)
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
