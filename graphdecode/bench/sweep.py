"""Bucket sweep: decode throughput per (batch bucket, k), beside transformers `generate`.

For every k in `--steps` one LLM is built; for every batch B in `--buckets` it runs
B equal-length token-id prompts with greedy decoding and `ignore_eos`, so every
row runs the full `--gen-len`. Each point is measured three times over:

* a warm-up (first use of a bucket: compile / graph variants),
* a prefill-only run (`max_tokens=1`, no decode window at all),
* the full run (`max_tokens=gen_len`); decode time = full - prefill-only.

Per point: end-to-end and decode tokens/s, ms per executed decode step (windows x k
steps; rows run all k steps of the last window even past their end), host ms per
window (schedule / launch / pythonize, from `llm.stats()`), padding waste (bucket
rows without a sequence), memory, and the bandwidth a step achieves against the
bytes it must move (weights + the KV it reads) as a fraction of this device's
measured copy bandwidth. On CPU, "launch" executes the window eagerly: it is
compute, not host overhead (see profiling/bench_host.py for the split).

The transformers baseline runs `generate(do_sample=False, cache_implementation=
"static")` on the same model, dtype, device, prompts and lengths (torch.compile
off unless `--baseline-compile`), in the same process, interleaved with the engine:
after each of the engine's timed repeats of a point, one of transformers' on the same
batch, and each side keeps its fastest. A machine's speed drifts by tens of percent over
minutes (a shared CPU above all); run side by side, both sides see the same minutes.
Writes PREFIX.json and PREFIX.png (when matplotlib is importable) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from .common import (
    add_compile_arg,
    compile_option,
    copy_bandwidth,
    cuda_sync,
    machine_info,
    memory_snapshot,
    random_prompt_ids,
    resolve_model,
    stats_delta,
    style_batch_axes,
    write_json,
)


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HuggingFace model directory")
    p.add_argument("--preset", default=None, help="micro | llama-3.2-1b | default (built in the cache dir)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the engine's)")
    p.add_argument("--buckets", default="1,4,16,64",
                   help="comma-separated batch sizes; exactly these buckets are built and captured")
    p.add_argument("--steps", default="1,8", help="comma-separated k values (decode steps per window)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point; the fastest is kept")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--baseline-compile", action="store_true", help="let transformers torch.compile (CUDA)")
    add_compile_arg(p)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (small models: 1 is fastest)")
    from ..cache import cache_root

    p.add_argument("--out", default=os.path.join(cache_root(), "bench", "bench_buckets"),
                   help="output path prefix (.json, .png); unless given, under the graphdecode cache directory "
                        "($GRAPHDECODE_CACHE), not the current one")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


# ------------------------------------------------------------------ engine side
def _timed_generate(llm, prompts, params, device) -> tuple[float, dict, list]:
    before = llm.stats()
    cuda_sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    cuda_sync(device)
    elapsed = time.perf_counter() - start
    return elapsed, stats_delta(before, llm.stats()), outs


def measure_engine_point(llm, batch: int, k: int, prompt_len: int, gen_len: int, repeats: int, device,
                         between=None) -> dict:
    """One (batch, k) point, best of `repeats`; `between()`, when given, runs after each timed repeat (the
    baseline's turn, so both sides are measured in the same minutes)."""
    from .. import SamplingParams

    vocab = llm.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": ids} for ids in random_prompt_ids(batch, prompt_len, vocab)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate(prompts, SamplingParams(max_tokens=min(gen_len, 2 * k + 1), **greedy))  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prefills, fulls = [], []
    for _ in range(repeats):
        prefills.append(_timed_generate(llm, prompts, SamplingParams(max_tokens=1, **greedy), device))
        fulls.append(_timed_generate(llm, prompts, SamplingParams(max_tokens=gen_len, **greedy), device))
        if between is not None:
            between()
    prefill_s, prefill_stats, _ = min(prefills, key=lambda r: r[0])
    total_s, st, outs = min(fulls, key=lambda r: r[0])
    windows = max(st["windows"], 1)
    decode_s = max(total_s - prefill_s, 1e-9)
    device_steps = st["windows"] * k
    launch_s = max(st["host_seconds_launch"] - prefill_stats["host_seconds_launch"], 0.0)
    return {
        "k": k,
        "batch": batch,
        "bucket": max(st["windows_per_bucket"], key=st["windows_per_bucket"].get) if st["windows_per_bucket"] else None,
        "total_s": total_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tokens_per_s": batch * gen_len / total_s,
        "decode_tokens_per_s": st["decode_tokens"] / decode_s,
        "windows": st["windows"],
        "device_steps": device_steps,
        "ms_per_decode_step": 1000 * decode_s / max(device_steps, 1),
        "overrun_steps": device_steps - (gen_len - 1),  # steps past the last useful one (last window)
        "host_ms_per_window": {
            "schedule": 1000 * st["host_seconds_schedule"] / windows,
            "launch": 1000 * launch_s / windows,
            "pythonize": 1000 * (st["host_seconds_pythonize"] - st["seconds_blocked"]) / windows,
            "blocked": 1000 * st["seconds_blocked"] / windows,
        },
        "padding_waste": 1 - st["live_rows"] / st["window_rows"] if st["window_rows"] else 0.0,
        "prefill_tokens": st["prefill_tokens"],
        "decode_tokens": st["decode_tokens"],
        "generated_tokens": st["generated_tokens"],
        "memory": memory_snapshot(device),
        "output_ids": [o.outputs[0].token_ids for o in outs],
    }


def _engine_sizes(llm, prompt_len: int, gen_len: int) -> dict:
    from ..config import model_weight_bytes

    cfg = llm.config.model_config
    weight_bytes = model_weight_bytes(cfg, llm.config.torch_dtype)  # read once a step, packed or dense
    kv = llm.engine.runner.kv_caches
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv[0].element_size()
    return {
        "weight_bytes": weight_bytes,
        "kv_cache_bytes": sum(t.numel() * t.element_size() for t in kv),
        "kv_bytes_per_token": kv_bytes_per_token,
        "mean_context": prompt_len + gen_len / 2,
    }


def _add_bandwidth(point: dict, sizes: dict, copy_bytes_per_s: float | None) -> None:
    """Bytes a decode step must move: all weights once + every row's KV read at the mean context."""
    step_bytes = sizes["weight_bytes"] + point["batch"] * sizes["mean_context"] * sizes["kv_bytes_per_token"]
    achieved = step_bytes / (point["ms_per_decode_step"] / 1000)
    point["step_bytes"] = step_bytes
    point["achieved_bytes_per_s"] = achieved
    point["bandwidth_fraction"] = achieved / copy_bytes_per_s if copy_bytes_per_s else None


def sweep_engine(model_dir: str, args, device: torch.device, result: dict, out_prefix: str,
                 baseline: "Baseline | None" = None) -> None:
    from .. import LLM

    for k in _ints(args.steps):
        llm = LLM(
            model_dir, device=str(device), dtype=args.dtype, buckets=sorted(set(_ints(args.buckets))),
            num_decode_steps=k, max_model_len=args.prompt_len + args.gen_len, cpu_threads=args.threads,
            **compile_option(args),
            enable_prefix_caching=False,  # the repeated runs of a point must prefill alike
        )
        sizes = _engine_sizes(llm, args.prompt_len, args.gen_len)
        result["model_sizes"] = sizes
        result["engine_config"] = {
            "dtype": str(llm.config.torch_dtype), "attention_backend": llm.config.attention_backend,
            "compile": llm.config.compile, "cuda_graphs": llm.config.cuda_graphs,
            "buckets": list(llm.config.buckets),
            "compile_seconds": llm.stats()["compile_seconds"],
            "capture_seconds": llm.stats()["capture_seconds"],
            "graphs_captured": llm.stats()["graphs_captured"],
        }
        if baseline is not None:
            baseline.dtype = llm.config.torch_dtype
        for batch in _ints(args.buckets):
            between = (lambda b=batch: baseline.run(b)) if baseline is not None else None
            point = measure_engine_point(llm, batch, k, args.prompt_len, args.gen_len, args.repeats, device, between)
            _add_bandwidth(point, sizes, result["copy_bytes_per_s"])
            result["points"].append(point)
            print(f"[bench] k={k} batch={batch}: {point['tokens_per_s']:.0f} tok/s, "
                  f"{point['ms_per_decode_step']:.2f} ms/step", flush=True)
            write_json(out_prefix + ".json", result)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------- baseline side
class Baseline:
    """transformers `generate` on the same model, prompts and lengths, one timed repeat per `run(batch)`
    (called between the engine's repeats of that batch), the fastest kept per batch. Loaded at the first
    run (after the engine's first build, so on CUDA the engine sizes its KV cache first). A failure
    (transformers missing, a model it cannot run) is recorded and ends the baseline, not the sweep."""

    def __init__(self, model_dir: str, args, device: torch.device):
        self.model_dir, self.args, self.device = model_dir, args, device
        self.dtype: torch.dtype | None = None  # the engine's, set before the first run
        self.model = None
        self.best: dict[int, dict] = {}  # batch -> {"total_s", "prefill_s", "tokens"}
        self.skipped: str | None = None

    def run(self, batch: int) -> None:
        if self.skipped is not None:
            return
        try:
            self._run(batch)
        except Exception as exc:  # noqa: BLE001 - the baseline is optional: keep the engine's numbers
            print(f"[bench] transformers baseline failed ({type(exc).__name__}: {exc}); skipped")
            self.skipped = f"{type(exc).__name__}: {exc}"

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device).eval()
        self.extra = {}
        if not self.args.baseline_compile and hasattr(GenerationConfig(), "disable_compile"):
            self.extra["disable_compile"] = True
        eos = self.model.config.eos_token_id
        self.pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

    def _generate(self, ids: torch.Tensor, new_tokens: int):
        cuda_sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                cache_implementation="static", pad_token_id=self.pad, eos_token_id=None, **self.extra,
            )  # eos_token_id=None: like ignore_eos, EOS may be produced but does not stop (min_new_tokens would ban it)
        cuda_sync(self.device)
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
        return time.perf_counter() - start, out

    def _run(self, batch: int) -> None:
        if self.model is None:
            self._load()
        args = self.args
        ids = torch.tensor(random_prompt_ids(batch, args.prompt_len, self.model.config.vocab_size), device=self.device)
        best = self.best.get(batch)
        if best is None:
            self._generate(ids, 2)  # warm-up
            best = self.best[batch] = {"total_s": float("inf"), "prefill_s": float("inf"), "tokens": None}
        best["prefill_s"] = min(best["prefill_s"], self._generate(ids, 1)[0])
        total_s, out = self._generate(ids, args.gen_len)
        if total_s < best["total_s"]:
            best["total_s"], best["tokens"] = total_s, out[:, args.prompt_len:].tolist()

    def points(self, engine_points: list[dict]) -> list[dict]:
        """One baseline point per batch measured, with how many rows equal the engine's (its first k's) tokens."""
        gen_len = self.args.gen_len
        engine_ids = {}
        for p in engine_points:
            engine_ids.setdefault(p["batch"], p["output_ids"])
        points = []
        for batch, best in sorted(self.best.items()):
            total_s, prefill_s, mine = best["total_s"], best["prefill_s"], engine_ids.get(batch)
            points.append({
                "batch": batch,
                "total_s": total_s,
                "prefill_s": prefill_s,
                "tokens_per_s": batch * gen_len / total_s,
                "decode_tokens_per_s": batch * (gen_len - 1) / max(total_s - prefill_s, 1e-9),
                "ms_per_decode_step": 1000 * max(total_s - prefill_s, 0.0) / max(gen_len - 1, 1),
                "rows_matching_engine": sum(a == b for a, b in zip(best["tokens"], mine)) if mine else None,
            })
            print(f"[bench] transformers batch={batch}: {points[-1]['tokens_per_s']:.0f} tok/s", flush=True)
        return points


# -------------------------------------------------------------------- report
def speedups(result: dict) -> list[dict]:
    base = {b["batch"]: b for b in result["baseline"]}
    rows = []
    for p in result["points"]:
        b = base.get(p["batch"])
        rows.append({
            "k": p["k"], "batch": p["batch"],
            "speedup": p["tokens_per_s"] / b["tokens_per_s"] if b else None,
            "decode_speedup": p["decode_tokens_per_s"] / b["decode_tokens_per_s"] if b else None,
        })
    return rows


def format_table(result: dict) -> str:
    base = {b["batch"]: b for b in result["baseline"]}
    head = (f"{'k':>3} {'batch':>5} {'bucket':>6} {'tok/s':>9} {'dec tok/s':>10} {'ms/step':>8} "
            f"{'sched':>6} {'launch':>7} {'pyth':>6} {'pad%':>5} {'HF tok/s':>9} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for p in result["points"]:
        h = p["host_ms_per_window"]
        b = base.get(p["batch"])
        lines.append(
            f"{p['k']:>3} {p['batch']:>5} {p['bucket'] or '-':>6} {p['tokens_per_s']:>9.0f} "
            f"{p['decode_tokens_per_s']:>10.0f} {p['ms_per_decode_step']:>8.3f} {h['schedule']:>6.3f} "
            f"{h['launch']:>7.3f} {h['pythonize']:>6.3f} {100 * p['padding_waste']:>5.1f} "
            + (f"{b['tokens_per_s']:>9.0f} {p['tokens_per_s'] / b['tokens_per_s']:>6.2f}x" if b
               else f"{'-':>9} {'-':>7}")
        )
    lines.append("host ms per window: sched / launch / pyth" + (
        "  (CPU: launch runs the window eagerly = compute)" if result["device"] == "cpu" else ""))
    return "\n".join(lines)


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        print(f"[bench] matplotlib is not importable ({exc}): no PNG written")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for k in sorted({p["k"] for p in result["points"]}):
        pts = [p for p in result["points"] if p["k"] == k]
        ax1.plot([p["batch"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", label=f"graphdecode k={k}")
        ax2.plot([p["batch"] for p in pts], [p["ms_per_decode_step"] for p in pts], "o-", label=f"graphdecode k={k}")
    if result["baseline"]:
        bs = result["baseline"]
        ax1.plot([b["batch"] for b in bs], [b["tokens_per_s"] for b in bs], "s--", color="gray", label="transformers")
        ax2.plot([b["batch"] for b in bs], [b["ms_per_decode_step"] for b in bs], "s--", color="gray",
                 label="transformers")
    batches = sorted({p["batch"] for p in result["points"]})
    for ax, ylabel in ((ax1, "tokens/s (end to end)"), (ax2, "ms per decode step")):
        style_batch_axes(ax, batches, ylabel)
    ax1.legend(fontsize=7)
    fig.suptitle(f"{result['model_name']} on {result['device']} ({result['dtype']}), "
                 f"prompt {result['args']['prompt_len']}, gen {result['args']['gen_len']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------- main
def run_bucket_sweep(args) -> dict:
    torch.set_num_threads(args.threads)
    model_dir, model_name = resolve_model(args.model, args.preset, args.device)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_prefix = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out_prefix)), exist_ok=True)
    result = {
        "bench": "bucket_sweep",
        "machine": machine_info(device, args.threads),
        "model_dir": model_dir,
        "model_name": model_name,
        "device": device.type,
        "dtype": args.dtype,
        "args": {k: v for k, v in vars(args).items() if k != "func"},
        "copy_bytes_per_s": copy_bandwidth(device),
        "points": [],
        "baseline": [],
    }
    baseline = None if args.no_baseline else Baseline(model_dir, args, device)
    sweep_engine(model_dir, args, device, result, out_prefix, baseline)
    result["dtype"] = result["engine_config"]["dtype"].replace("torch.", "")
    if baseline is not None:
        result["baseline"] = baseline.points(result["points"])
        if baseline.skipped is not None:
            result["baseline_skipped"] = baseline.skipped
    result["speedups"] = speedups(result)
    for p in result["points"]:
        p.pop("output_ids", None)
    write_json(out_prefix + ".json", result)
    result["plot"] = plot(result, out_prefix + ".png")
    write_json(out_prefix + ".json", result)
    print(format_table(result))
    written = [os.path.abspath(out_prefix + ".json")] + ([os.path.abspath(result["plot"])] if result["plot"] else [])
    print(f"[bench] results written to {' and '.join(written)}")
    return result


def run_bucket_sweep_cli(args) -> int:
    run_bucket_sweep(args)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser)
    return run_bucket_sweep_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
