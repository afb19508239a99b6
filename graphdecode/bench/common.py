"""Helpers shared by the benchmarks (graphdecode.bench.sweep and profiling/bench_*.py).

Model resolution (a directory or a preset), machine description for the JSON
records, stats deltas, memory snapshots, a copy-bandwidth probe, deterministic
prompts. Nothing here times the engine itself.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time

import torch

COMPILE_CHOICES = {"auto": None, "on": True, "off": False}


def add_compile_arg(parser) -> None:
    """--compile auto|on|off: the engine's torch.compile (auto: EngineConfig's default, on on CUDA).
    gpu_check passes it to every bench, so a dry run and the GPU run take the same settings."""
    parser.add_argument("--compile", choices=list(COMPILE_CHOICES), default="auto",
                        help="engine torch.compile (auto: EngineConfig's default: on on CUDA, off on CPU)")


def compile_option(args) -> dict:
    """The engine argument for --compile: {} for auto (EngineConfig decides), else {"compile": bool}."""
    flag = COMPILE_CHOICES[args.compile]
    return {} if flag is None else {"compile": flag}


def resolve_model(model: str | None, preset: str | None, device: str | None = None) -> tuple[str, str]:
    """(directory, display name): --model wins, else --preset, else the built-in default model."""
    if model is not None and preset is not None:
        raise ValueError("give --model or --preset, not both")
    if model is not None:
        return model, os.path.basename(os.path.normpath(model))
    from .presets import ensure_preset

    name = preset or "default"
    return ensure_preset(name, device), name


def git_commit() -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                           check=False, capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def machine_info(device: torch.device, threads: int) -> dict:
    info = {
        "date": datetime.date.today().isoformat(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "memory_bytes": _total_memory(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def rss_bytes() -> int | None:
    """Resident set size of this process now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def memory_snapshot(device: torch.device) -> dict:
    snap = {"rss_bytes": rss_bytes()}
    if device.type == "cuda":
        snap["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
        snap["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        snap["cuda_reserved_bytes"] = torch.cuda.memory_reserved(device)
    return snap


def cuda_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes moved (read + written) per second by a large tensor copy on the device."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (128 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    cuda_sync(device)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_event.record()
            for _ in range(10):
                dst.copy_(src)
            end_event.record()
            end_event.synchronize()
            seconds = start_event.elapsed_time(end_event) / 1000 / 10
        else:
            start = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - start
        best = min(best, seconds)
    del src, dst
    return 2 * nbytes / best


def stats_delta(before: dict, after: dict) -> dict:
    """after - before for every numeric counter (and per-bucket window counts)."""
    out = {}
    for key, value in after.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value - before.get(key, 0)
        elif isinstance(value, dict):
            old = before.get(key, {})
            out[key] = {b: n - old.get(b, 0) for b, n in value.items() if n - old.get(b, 0)}
    return out


def random_prompt_ids(count: int, length: int, vocab: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    """Deterministic random token-id prompts in [low, vocab)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (count, length), generator=gen).tolist()


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def style_batch_axes(ax, batches: list[int], ylabel: str) -> None:
    """Log-log axes over batch sizes, as every bench plot draws them."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def timed_greedy(llm, prompts: list[dict], max_tokens: int) -> tuple[float, list[list[int]]]:
    """One timed greedy `generate` (ignore_eos, no progress bar): (seconds, each prompt's token ids)."""
    from .. import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def paired_ab(run, names: tuple[str, str], rounds: int) -> dict:
    """An in-process A/B: run(name) -> (seconds, outputs) for both names, one warm-up each, then `rounds`
    rounds in alternating order so the host's drift reaches both alike. -> {"best": {name: seconds},
    "ratios": [names[0]'s time / names[1]'s per round], "median_ratio", "best_ratio", "same_outputs"}."""
    import statistics

    first, second = names
    run(second)
    run(first)
    best, outputs, ratios = {first: float("inf"), second: float("inf")}, {}, []
    for i in range(rounds):
        took = {}
        for name in names if i % 2 == 0 else names[::-1]:
            took[name], outputs[name] = run(name)
            best[name] = min(best[name], took[name])
        ratios.append(took[first] / took[second])
    return {"best": best, "ratios": ratios, "median_ratio": statistics.median(ratios),
            "best_ratio": best[first] / best[second], "same_outputs": outputs[first] == outputs[second]}


def paired_decode(run, names: tuple[str, str], prompts: list[dict], gen: int, rounds: int) -> tuple[dict, dict]:
    """Two engines' decode side by side: run(name, prompts, max_tokens) -> (seconds, token ids) times a greedy
    generate; a run of `gen` tokens less a prefill-only run, in paired_ab's alternating rounds. -> (decode
    tokens/s by name, paired_ab's result)."""
    def decode(name):
        full, tokens = run(name, prompts, gen)
        return full - run(name, prompts, 1)[0], tokens

    ab = paired_ab(decode, names, rounds)
    return {name: len(prompts) * (gen - 1) / s for name, s in ab["best"].items()}, ab


def paired_prefill(run, names: tuple[str, str], prompt: list[int], rounds: int) -> tuple[dict, dict]:
    """Two engines' prefill of one prompt side by side (a one-token generate): (prompt tokens/s by name,
    paired_ab's result)."""
    ab = paired_ab(lambda name: run(name, [{"prompt_token_ids": prompt}], 1), names, rounds)
    return {name: len(prompt) / s for name, s in ab["best"].items()}, ab


def script_module(path: str):
    """A script file (a profiling/ script beside the caller's) imported as a module."""
    import importlib.util

    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
