"""Host overhead per decode window: schedule / launch / pythonize against batch and k.

Steady state on a micro model: B requests decode together for many windows (no
admissions or finishes inside the measured windows). Per window it reports the
engine's own host timers (`llm.stats()`: schedule, launch, pythonize) and, by
wrapping the runner's window function from outside, the time spent inside the
window itself.

What the numbers mean:
* CUDA: `launch` is host time to enqueue (graph replay + copies); the window runs on
  the device meanwhile, so schedule + launch + pythonize is the host's whole cost
  and must stay below the window's device time for the GPU never to wait.
* CPU: the window runs eagerly inside `launch`, so `launch` is mostly compute. The
  pure host part is schedule + pythonize + (launch - window), reported as
  `host_us`; `window_us` is the eager forward + sampling + advance_step time.

    python profiling/bench_host.py --batches 1,4,16,64,256 --steps 1,4,8,16
"""

from __future__ import annotations

import argparse
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import (
    cuda_sync,
    machine_info,
    random_prompt_ids,
    resolve_model,
    style_batch_axes,
    write_json,
)


class Timed:
    """Wraps a bound method as an instance attribute and sums the time spent in it."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name
        self.inner = getattr(owner, name)
        self.seconds = 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def detach(self) -> None:
        delattr(self.owner, self.name)


_HOST_KEYS = ("host_seconds_schedule", "host_seconds_launch", "host_seconds_pythonize", "seconds_blocked")


def measure(llm, batch: int, k: int, prompt_len: int, windows: int, warm: int) -> dict:
    engine = llm.engine
    vocab = llm.config.model_config.vocab_size
    params = SamplingParams(max_tokens=k * (windows + warm + 2) + 1, temperature=0.0, ignore_eos=True)
    for ids in random_prompt_ids(batch, prompt_len, vocab, seed=batch * 100 + k):
        engine.add_request({"prompt_token_ids": ids}, params)
    window_fn = Timed(engine.runner.windows, "run")
    samples = []
    try:
        for i in range(warm + windows):
            before = {key: engine.stats()[key] for key in _HOST_KEYS}
            window_before = window_fn.seconds
            engine.step()
            after = engine.stats()
            if i >= warm:
                d = {key: after[key] - before[key] for key in _HOST_KEYS}
                d["window"] = window_fn.seconds - window_before
                samples.append(d)
    finally:
        window_fn.detach()
    while engine.has_unfinished():
        engine.step()
    cuda_sync(llm.config.torch_device)

    def us(key: str) -> float:
        return 1e6 * sum(s[key] for s in samples) / len(samples)

    schedule, launch, window = us("host_seconds_schedule"), us("host_seconds_launch"), us("window")
    pythonize = us("host_seconds_pythonize") - us("seconds_blocked")
    host = schedule + max(launch - window, 0.0) + pythonize
    return {
        "batch": batch, "k": k, "windows_measured": len(samples),
        "schedule_us": schedule, "launch_us": launch, "pythonize_us": pythonize,
        "blocked_us": us("seconds_blocked"),
        "window_us": window,  # inside the window function (CPU: eager compute; CUDA: graph replay enqueue)
        "launch_host_us": max(launch - window, 0.0),  # staging flush + output copy enqueue
        "host_us": host,  # schedule + launch_host + pythonize
        "host_us_per_step": host / k,
        "host_fraction": host / (host + window) if host + window else 0.0,
    }


def format_table(points: list[dict]) -> str:
    head = (f"{'k':>3} {'batch':>5} {'sched':>8} {'launch':>9} {'pyth':>8} {'window':>9} "
            f"{'host':>8} {'host/step':>9} {'host%':>6}")
    lines = [head, "-" * len(head)]
    for p in points:
        lines.append(f"{p['k']:>3} {p['batch']:>5} {p['schedule_us']:>8.1f} {p['launch_us']:>9.1f} "
                     f"{p['pythonize_us']:>8.1f} {p['window_us']:>9.1f} {p['host_us']:>8.1f} "
                     f"{p['host_us_per_step']:>9.1f} {100 * p['host_fraction']:>5.1f}%")
    lines.append("µs per window; host = schedule + (launch - window) + pythonize")
    return "\n".join(lines)


def plot(points: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"[host] matplotlib is not importable ({exc}): no PNG written")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    batches = sorted({p["batch"] for p in points})
    for k in sorted({p["k"] for p in points}):
        pts = [p for p in points if p["k"] == k]
        axes[0].plot([p["batch"] for p in pts], [p["host_us"] for p in pts], "o-", label=f"k={k}")
        axes[1].plot([p["batch"] for p in pts], [p["host_us_per_step"] for p in pts], "o-", label=f"k={k}")
    for ax, ylabel in zip(axes, ("host µs per window", "host µs per decode step (window / k)")):
        style_batch_axes(ax, batches, ylabel)
    axes[0].legend(fontsize=7)
    fig.suptitle(title + "  (host = schedule + launch - window + pythonize)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory")
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,4,16,64,256", help="comma-separated batch sizes")
    p.add_argument("--steps", default="1,4,8,16", help="comma-separated k values")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--measured-steps", type=int, default=32,
                   help="decode steps measured per point: max(2, this // k) windows, so contexts stay comparable")
    p.add_argument("--warm", type=int, default=2, help="windows skipped first (prefill, first pythonize)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="profiling/out/bench_host", help="output prefix (.json, .png)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.batches.split(",")]
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    result = {"bench": "host_overhead", "model_name": model_name, "args": vars(args), "points": []}
    for k in [int(x) for x in args.steps.split(",")]:
        windows = max(2, args.measured_steps // k)
        llm = LLM(model_dir, device=args.device, max_batch_size=max(batches), num_decode_steps=k,
                  max_model_len=args.prompt_len + k * (windows + args.warm + 2) + 2, cpu_threads=args.threads)
        result["machine"] = machine_info(llm.config.torch_device, args.threads)
        result["device"] = llm.config.torch_device.type
        measure(llm, min(batches), k, args.prompt_len, 2, 1)  # warm-up
        for batch in batches:
            point = measure(llm, batch, k, args.prompt_len, windows, args.warm)
            result["points"].append(point)
            print(f"[host] k={k:>2} batch={batch:>3}: host {point['host_us']:8.1f} µs/window "
                  f"(window {point['window_us']:9.1f} µs)", flush=True)
            write_json(args.out + ".json", result)
        del llm
    title = f"{model_name} on {result['device']}: host µs per window"
    result["plot"] = plot(result["points"], args.out + ".png", title)
    write_json(args.out + ".json", result)
    print(format_table(result["points"]))
    return result


if __name__ == "__main__":
    main()
