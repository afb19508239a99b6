"""Serving benchmark: N concurrent streaming clients against `graphdecode serve`, beside the engine in-process.

For each N in --clients (default 1, 16, 64, 256), N clients each stream one completion
(--prompt-len random token ids sent as their text, which the server and the in-process
engine both tokenize, or as the ids with --prompt-kind ids; --max-tokens tokens, greedy,
ignore_eos) with the `openai`
async client (one client object per simulated user, each with its own kept-alive
connection) from this process, against a server this script starts as a subprocess
(`python -m graphdecode.server.openai_api`, the micro preset unless --model). The same
prompts also run in this process on an in-process engine with the same options. The
two runs alternate (--repeats times each per N, the fastest kept), so a busy machine
drifts both alike. vLLM's serving-benchmark metrics:

* output tokens/s: completion tokens / (first request sent -> last stream ended);
  in-process: the same tokens / (requests added -> last step);
* TTFT: request sent -> first content chunk; ITL: gaps between successive content chunks
  (a content chunk carries new tokens, up to k, or the finish; its text may be "" while
  a partial UTF-8 sequence or a possible stop string is held back, as with vLLM), pooled
  over all requests; p50 / p99; the server's own view (its /metrics histograms: outputs
  arriving from the engine core, per request) beside them;
* one window's time: the in-process engine's step durations in the same workload (a step
  = one window of k decode steps, plus any prefill), mean / p50 / p99. Window times vary
  within a run (on CPU they grow with the context), so p99 ITL is set against both the
  mean and the p99 step;
* CPU seconds of the three processes during the served run (server, engine core, client
  = this process), to see who competes for the cores.

Goals (reported, not asserted): served tokens/s >= 0.9 x in-process at the largest N,
p99 ITL at 64 clients <= 1.5 x one window's time.

    python profiling/bench_serve.py                                 # micro preset, CPU
    python profiling/bench_serve.py --clients 1,16,64,256 --max-tokens 128 --out profiling/out/bench_serve
    python profiling/bench_serve.py --client raw                    # httpx + json.loads, not the openai client
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import subprocess
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.clients import MODEL_NAME, ClientPool
from graphdecode.bench.common import (
    add_compile_arg,
    compile_option,
    machine_info,
    random_prompt_ids,
    resolve_model,
    write_json,
)
from graphdecode.host.gc_heap import freeze_startup_heap
from graphdecode.models import load_model_config
from graphdecode.server.launch import start_server, stop_server


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------ in-process
def run_in_process(llm: LLM, prompts: list, max_tokens: int) -> dict:
    """The prompts added at once, the engine stepped to the end; every step timed."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = llm.stats()
    start = time.perf_counter()
    requests = [engine.add_request(p if isinstance(p, str) else {"prompt_token_ids": p}, params) for p in prompts]
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    windows = llm.stats()["windows"] - before["windows"]
    tokens = sum(r.seqs[0].num_output_tokens for r in requests)
    for r in requests:
        engine.requests.pop(r.request_id, None)
    busy = [s for s in steps if s > 0]
    return {"clients": len(prompts), "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "windows": windows, "window_mean_s": sum(busy) / max(windows, 1),
            "window_p50_s": _percentile(busy, 0.5), "window_p99_s": _percentile(busy, 0.99)}


# ------------------------------------------------------------------ served
def start(model_dir: str, args, engine_args: dict, log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = ["--model", model_dir, "--served-model-name", MODEL_NAME, "--threads", str(args.threads), "--no-access-log",
           "--log-level", "warning", "-k", str(engine_args["num_decode_steps"]),
           "--max-batch-size", str(engine_args["max_batch_size"]), "--max-model-len", str(engine_args["max_model_len"])]
    if args.device:
        cmd += ["--device", args.device]
    if "compile" in engine_args:
        cmd += ["--compile", "on" if engine_args["compile"] else "off"]
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return start_server(cmd, log_path, env=env)


def text_prompts(tokenizer, prompts: list[list[int]]) -> tuple[list[str], list[int]]:
    """The random token ids as text (what users send), and each one's length once the
    server or the in-process engine tokenizes it (both do, the same way)."""
    texts = [tokenizer.decode(ids) for ids in prompts]
    return texts, [len(ids) for ids in tokenizer(texts)["input_ids"]]


def _server_metrics(url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}  # every family has it
            if not labels:
                out[sample.name] = sample.value
            elif sample.name.endswith("_bucket") and set(labels) == {"le"}:
                out[f"{sample.name}:{labels['le']}"] = sample.value
    return out


def _quantile_bound(before: dict, after: dict, name: str, q: float) -> float | None:
    """The upper bound of the histogram bucket holding the q-quantile of what was observed in between."""
    prefix = f"graphdecode:{name}_seconds_bucket:"
    buckets = sorted((float(key[len(prefix):]), after[key] - before.get(key, 0)) for key in after
                     if key.startswith(prefix))
    total = buckets[-1][1] if buckets else 0
    for bound, count in buckets:
        if total and count >= q * total:
            return bound
    return None


def _mean_delta(before: dict, after: dict, name: str) -> float | None:
    key = f"graphdecode:{name}_seconds"
    count = after.get(f"{key}_count", 0) - before.get(f"{key}_count", 0)
    return (after.get(f"{key}_sum", 0) - before.get(f"{key}_sum", 0)) / count if count else None


async def run_served(clients: ClientPool, url: str, proc: subprocess.Popen | None, args, prompts: list) -> dict:
    pid = proc.pid if proc is not None else None
    core = _children(pid) if pid is not None else []

    def cpu():
        return (_cpu_seconds(pid) if pid else 0.0, sum(map(_cpu_seconds, core)),
                _self_cpu() + sum(map(_cpu_seconds, clients.pids)))

    cpu_before, metrics_before = cpu(), _server_metrics(url)
    runs = await clients.run(prompts, args.max_tokens)
    cpu_after, metrics_after = cpu(), _server_metrics(url)
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    ttft = [r["times"][0] - r["start"] for r in runs if r["times"]]
    itl = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:])]
    return {
        "clients": len(prompts), "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
        "ttft_p50_s": _percentile(ttft, 0.5), "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_p50_s": _percentile(itl, 0.5), "itl_p99_s": _percentile(itl, 0.99),
        "content_chunks": sum(len(r["times"]) for r in runs),
        # where the time goes: the client issuing requests, the server answering them,
        # and the server's own view of TTFT / ITL (outputs arriving from the core)
        "requests_sent_over_s": max(r["start"] for r in runs) - min(r["start"] for r in runs),
        "headers_p50_s": _percentile([r["headers"] - r["start"] for r in runs], 0.5),
        "headers_p99_s": _percentile([r["headers"] - r["start"] for r in runs], 0.99),
        "server_ttft_mean_s": _mean_delta(metrics_before, metrics_after, "time_to_first_token"),
        "server_itl_mean_s": _mean_delta(metrics_before, metrics_after, "inter_token_latency"),
        "server_itl_p99_at_most_s": _quantile_bound(metrics_before, metrics_after, "inter_token_latency", 0.99),
        "engine_windows": (metrics_after.get("graphdecode:windows_total", 0)
                           - metrics_before.get("graphdecode:windows_total", 0)),
        "cpu_s": {"server": cpu_after[0] - cpu_before[0], "engine_core": cpu_after[1] - cpu_before[1],
                  "client": cpu_after[2] - cpu_before[2]},
    }


class Pinning:
    """--pin: the engine that is measured gets CPU 0 to itself (the engine core process in a
    served run, this process in an in-process run); the server and the client share the
    other CPUs. Both engines then run on one dedicated core, as a deployment would place
    them, and the HTTP side cannot take the engine's core away."""

    def __init__(self, enabled: bool, proc: subprocess.Popen | None):
        cpus = sorted(os.sched_getaffinity(0)) if enabled else []
        self.enabled = len(cpus) >= 2
        if enabled and not self.enabled:
            print("--pin: fewer than 2 CPUs available, not pinning", flush=True)
        self.engine, self.others = set(cpus[:1]), set(cpus[1:])
        self.proc = proc
        self.original = os.sched_getaffinity(0) if self.enabled else None

    def restore(self) -> None:
        """This process back to the CPUs it had (the server ends with the run)."""
        if self.enabled:
            os.sched_setaffinity(0, self.original)

    def in_process(self) -> None:
        if self.enabled:
            os.sched_setaffinity(0, self.engine)

    def served(self, client_pids=()) -> None:
        if not self.enabled:
            return
        os.sched_setaffinity(0, self.others)
        for pid in client_pids:
            os.sched_setaffinity(pid, self.others)
        if self.proc is not None:
            os.sched_setaffinity(self.proc.pid, self.others)
            for core in _children(self.proc.pid):
                os.sched_setaffinity(core, self.engine)


async def run_all(url: str, proc: subprocess.Popen | None, llm: LLM | None, args,
                  prompts: list) -> list[dict]:
    """Per N: in-process and served runs, alternating, the fastest of each kept."""
    points = []
    pin = Pinning(args.pin, proc)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(pin.restore)
        clients = await stack.enter_async_context(ClientPool(url, args.client, max(args.clients), args.client_procs))
        await clients.run(prompts, 2 * args.k)  # warm-up: every client opens its connection
        if llm is not None:
            run_in_process(llm, prompts, 2 * args.k)  # warm-up: every bucket once
        # The simulated users share this process with torch and the in-process engine, which a
        # real client does not have; full collections walking them stalled every user for
        # 200-580 ms once or twice per run. Freeze what set-up made (both modes benefit).
        freeze_startup_heap()
        for n in args.clients:
            served = in_process = None
            for _ in range(args.repeats):
                if llm is not None:
                    pin.in_process()
                    run = run_in_process(llm, prompts[:n], args.max_tokens)
                    if in_process is None or run["wall_s"] < in_process["wall_s"]:
                        in_process = run
                pin.served(clients.pids)
                run = await run_served(clients, url, proc, args, prompts[:n])
                if served is None or run["wall_s"] < served["wall_s"]:
                    served = run
            point = {"clients": n, "served": served, "in_process": in_process}
            if in_process is not None:
                point["served_over_in_process"] = served["tokens_per_s"] / in_process["tokens_per_s"]
                if served["itl_p99_s"] is not None:
                    point["itl_p99_over_window_mean"] = served["itl_p99_s"] / in_process["window_mean_s"]
                    point["itl_p99_over_window_p99"] = served["itl_p99_s"] / in_process["window_p99_s"]
            points.append(point)
            _print_point(point)
    return points


def _ms(value) -> str:
    return f"{1e3 * value:.1f}" if value is not None else "-"


def _print_header(args, model_name: str, lengths: list[int]) -> None:
    print(f"{model_name}, {args.prompt_kind} prompts of {sum(lengths) / len(lengths):.1f} tokens on average, "
          f"{args.max_tokens} out, k={args.k}, client={args.client}; times in ms")
    print(f"{'clients':>7} {'served tok/s':>12} {'in-proc tok/s':>13} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'win mean':>8} {'win p99':>8} {'ITL99/win':>9}  "
          f"cpu s (server/core/client)", flush=True)


def _print_point(pt: dict) -> None:
    s, ip = pt["served"], pt["in_process"] or {}
    cpu = s["cpu_s"]
    over = (f"{pt['itl_p99_over_window_mean']:.2f}/{pt['itl_p99_over_window_p99']:.2f}"
            if "itl_p99_over_window_p99" in pt else "-")
    print(f"{s['clients']:>7} {s['tokens_per_s']:>12.0f} {ip.get('tokens_per_s', 0):>13.0f} "
          f"{pt.get('served_over_in_process', 0):>6.2f} {_ms(s['ttft_p50_s']):>9} {_ms(s['ttft_p99_s']):>9} "
          f"{_ms(s['itl_p50_s']):>8} {_ms(s['itl_p99_s']):>8} {_ms(ip.get('window_mean_s')):>8} "
          f"{_ms(ip.get('window_p99_s')):>8} {over:>9}  {cpu['server']:.2f}/{cpu['engine_core']:.2f}/{cpu['client']:.2f}",
          flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory")
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--clients", default="1,16,64,256", help="comma-separated numbers of concurrent clients")
    p.add_argument("--prompt-len", type=int, default=32, help="random token ids per prompt (as text: see --prompt-kind)")
    p.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                   help="send the prompts as text (tokenized by the server / in-process engine; ids when the model has no "
                        "tokenizer) or as token ids "
                        "(the openai client then spends ~1.4 ms per request transforming the id list)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=8, help="decode steps per window")
    p.add_argument("--repeats", type=int, default=2, help="runs per point and mode; the fastest is kept")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine (both modes)")
    p.add_argument("--client", choices=["openai", "raw"], default="openai",
                   help="openai: the openai async client; raw: httpx streaming + json.loads (less client CPU)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="spread the clients over this many worker processes (machines with cores to spare)")
    p.add_argument("--pin", action="store_true",
                   help="give the measured engine CPU 0 to itself, the server and client the other CPUs (Linux)")
    p.add_argument("--skip-in-process", action="store_true", help="only the served runs")
    add_compile_arg(p)
    p.add_argument("--url", default=None,
                   help="benchmark a server already running there (started with the same engine options and "
                        f"--served-model-name {MODEL_NAME}) instead of starting one")
    p.add_argument("--out", default="profiling/out/bench_serve", help="output prefix (.json; .log: the server's)")
    args = p.parse_args(argv)
    args.clients = [int(x) for x in args.clients.split(",")]

    torch.set_num_threads(args.threads)
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    vocab = load_model_config(model_dir).vocab_size
    prompts = random_prompt_ids(max(args.clients), args.prompt_len, vocab, seed=7)
    lengths = [len(p) for p in prompts]
    if args.prompt_kind == "text":
        from graphdecode.host.engine import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        if tokenizer is None:
            print(f"{model_name} has no tokenizer: its prompts go as token ids", flush=True)
            args.prompt_kind = "ids"
        else:
            prompts, lengths = text_prompts(tokenizer, prompts)
    engine_args = dict(num_decode_steps=args.k, max_batch_size=max(args.clients),
                       max_model_len=max(lengths) + args.max_tokens + 8, cpu_threads=args.threads,
                       **compile_option(args))
    if args.device:
        engine_args["device"] = args.device
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    proc, url = (None, args.url) if args.url else start(model_dir, args, engine_args, f"{args.out}.log")
    exit_status = None
    try:
        llm = None if args.skip_in_process else LLM(model_dir, **engine_args)
        _print_header(args, model_name, lengths)
        points = asyncio.run(run_all(url, proc, llm, args, prompts))
    finally:
        if proc is not None:
            exit_status = stop_server(proc)

    by_n = {pt["clients"]: pt for pt in points}
    goals = {}
    largest = max(args.clients)
    if "served_over_in_process" in by_n[largest]:
        goals[f"served / in-process tokens/s at {largest} clients (>= 0.9)"] = by_n[largest]["served_over_in_process"]
    if 64 in by_n and "itl_p99_over_window_mean" in by_n[64]:
        goals["p99 ITL / mean window at 64 clients (<= 1.5)"] = by_n[64]["itl_p99_over_window_mean"]
        goals["p99 ITL / p99 window at 64 clients (<= 1.5)"] = by_n[64]["itl_p99_over_window_p99"]
    result = {
        "benchmark": "serve",
        "model": model_name,
        "client": args.client,
        "prompt_len": args.prompt_len,
        "prompt_kind": args.prompt_kind,
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "repeats": args.repeats,
        "engine_args": engine_args,
        "server_exit_status": exit_status,
        "points": points,
        "goals": goals,
        "machine": machine_info(torch.device(args.device or "cpu"), args.threads),
    }
    write_json(f"{args.out}.json", result)
    for goal, value in goals.items():
        print(f"goal: {goal}: {value:.2f}")
    print(f"server exit status {exit_status}; wrote {args.out}.json")
    return result


if __name__ == "__main__":
    main()
