"""The CPU path beside transformers: prefill, decode eager and compiled, fp32 and bf16, peak RSS.

One run, same model, dtype and thread count for both:

* prefill: one prompt of L random tokens (no prefix-cache hit), `max_tokens=1`, against
  transformers' own prefill as `generate` runs it (one forward with `logits_to_keep=1`,
  SDPA attention);
* decode: B prompts of `--prompt-len` tokens, `--gen-len` greedy tokens with ignore_eos
  (graphdecode.bench.sweep's point: decode = full run - prefill-only run), eager and compiled,
  against `generate(cache_implementation="static")`; rows whose tokens equal
  transformers' are counted (fp32: all should);
* peak RSS of each side (every (side, dtype, mode) runs in a subprocess of its own; the
  sides alternate for `--rounds` rounds, so drift on a shared machine hits both alike);
* attention alone: one decode layer read in place by the CPU kernel against the torch
  reference's gather, batch 1/16/64;
* linears alone: SmolLM2's shapes by row count, aten's dense weight (row- and column-major)
  against the prepacked oneDNN one and, in fp32, the panel kernel (models/cpu_linear.py).

    python profiling/bench_cpu.py                               # SmolLM2-135M, fp32 and bf16
    python profiling/bench_cpu.py --preset default --prefill 512 --batches 1,16 --dtypes float32

Writes PREFIX.json and prints a table with each ratio (graphdecode / transformers; > 1
means graphdecode is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from graphdecode.bench.common import machine_info, random_prompt_ids, write_json

MARK = "BENCH_CPU_RESULT "


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - start)
    return best


# ------------------------------------------------------------------ workers (one per subprocess)
def engine_prefill(args) -> dict:
    from graphdecode import LLM, SamplingParams

    lengths = [int(x) for x in args.prefill.split(",")]
    llm = LLM(args.model_dir, dtype=args.dtype, buckets=[1], max_model_len=max(lengths) + 1, compile=False,
              enable_prefix_caching=False, cpu_threads=args.threads)
    vocab = llm.config.model_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": random_prompt_ids(1, 16, vocab, seed=99)[0]}], one)  # warm-up
    points = []
    for length in lengths:
        prompts = [random_prompt_ids(1, length, vocab, seed=100 + i)[0] for i in range(args.repeats)]
        seconds = _best(lambda i: llm.generate([{"prompt_token_ids": prompts[i]}], one, use_tqdm=False),
                        args.repeats)
        points.append({"tokens": length, "seconds": seconds})
        print(f"[bench_cpu] graphdecode {args.dtype} prefill {length}: {seconds:.2f} s", flush=True)
    return {"points": points, "cpu_threads": llm.stats().get("cpu_threads")}


def hf_prefill(args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    points = []
    with torch.inference_mode():
        model(torch.tensor(random_prompt_ids(1, 16, vocab, seed=99)), logits_to_keep=1)  # warm-up
        for length in (int(x) for x in args.prefill.split(",")):
            prompts = [torch.tensor(random_prompt_ids(1, length, vocab, seed=100 + i)) for i in range(args.repeats)]
            seconds = _best(lambda i: model(prompts[i], use_cache=True, logits_to_keep=1), args.repeats)
            points.append({"tokens": length, "seconds": seconds})
            print(f"[bench_cpu] transformers {args.dtype} prefill {length}: {seconds:.2f} s", flush=True)
    return {"points": points}


def engine_decode(args) -> dict:
    from graphdecode import LLM
    from graphdecode.bench.sweep import measure_engine_point

    batches = [int(x) for x in args.batches.split(",")]
    start = time.perf_counter()
    llm = LLM(args.model_dir, dtype=args.dtype, buckets=batches, max_model_len=args.prompt_len + args.gen_len + 16,
              compile=args.mode == "compiled", enable_prefix_caching=False, cpu_threads=args.threads)
    build_s = time.perf_counter() - start
    points = []
    for batch in batches:
        p = measure_engine_point(llm, batch, llm.config.num_decode_steps, args.prompt_len, args.gen_len,
                                 args.repeats, torch.device("cpu"))
        points.append({k: p[k] for k in ("batch", "decode_tokens_per_s", "tokens_per_s", "ms_per_decode_step",
                                         "output_ids")})
        print(f"[bench_cpu] graphdecode {args.dtype} {args.mode} batch {batch}: "
              f"{p['decode_tokens_per_s']:.1f} decode tok/s", flush=True)
    stats = llm.stats()
    return {"points": points, "build_seconds": build_s, "compile_seconds": stats["compile_seconds"],
            "cpu_threads": stats.get("cpu_threads")}


def hf_decode(args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    vocab = model.config.vocab_size
    points = []

    def run(ids, new_tokens):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, cache_implementation="static", pad_token_id=0,
                                  eos_token_id=None, disable_compile=True)

    for batch in (int(x) for x in args.batches.split(",")):
        ids = torch.tensor(random_prompt_ids(batch, args.prompt_len, vocab))
        run(ids, 2)  # warm-up
        prefill_s = _best(lambda i: run(ids, 1), args.repeats)
        outs = []
        total_s = _best(lambda i: outs.append(run(ids, args.gen_len)), args.repeats)
        tokens = outs[-1][:, args.prompt_len:].tolist()
        decode = batch * (args.gen_len - 1) / max(total_s - prefill_s, 1e-9)
        points.append({"batch": batch, "decode_tokens_per_s": decode, "tokens_per_s": batch * args.gen_len / total_s,
                       "output_ids": tokens})
        print(f"[bench_cpu] transformers {args.dtype} batch {batch}: {decode:.1f} decode tok/s", flush=True)
    return {"points": points}


def attention_probe(args) -> dict:
    """One decode layer's attention (9 heads : 3 KV heads, head_dim 64: SmolLM2's), kernel vs gather."""
    from graphdecode.attention import DecodeMetadata, TorchAttentionBackend

    heads, kv_heads, head_dim, page = 9, 3, 64, 16
    points = []
    for batch, context in ((1, 200), (16, 200), (16, 1000), (64, 300)):
        width = 1 << (-(-context // page) - 1).bit_length()
        num_pages = batch * width + 1
        kv = torch.randn(num_pages, 2, page, kv_heads, head_dim).to(getattr(torch, args.dtype))
        table = torch.randperm(num_pages - 1)[: batch * width].add(1).int().view(batch, width)
        seq_lens = torch.full((batch,), context, dtype=torch.int32)
        q = torch.randn(batch, heads, head_dim).to(kv.dtype)
        new = torch.randn(batch, kv_heads, head_dim).to(kv.dtype)
        slots = (table[:, (context - 1) // page].long() * page + (context - 1) % page)
        meta = DecodeMetadata(seq_lens=seq_lens, block_table=table, slot_mapping=slots, kv_indptr=None,
                              kv_indices=None, kv_last_page_len=None)
        backend = TorchAttentionBackend([kv], heads, kv_heads, head_dim)
        timings = {}
        for name, kernels in (("kernel", backend.kernels), ("gather", None)):
            if name == "kernel" and kernels is None:
                continue
            backend.kernels = kernels
            backend.decode(0, q, new, new, meta)
            timings[name] = _best(lambda i: backend.decode(0, q, new, new, meta), 20) * 1000
        points.append({"batch": batch, "context": context, **{f"{k}_ms": v for k, v in timings.items()}})
        print(f"[bench_cpu] attention {args.dtype} batch {batch} context {context}: "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()), flush=True)
    return {"points": points}


def linear_probe(args) -> dict:
    """SmolLM2's linear shapes (qkv, o, gate_up, down, LM head) by row count, in the layouts
    models/cpu_linear.py chooses from: aten's linear on the row-major weight ("dense"), on the same
    weight stored column-major ("column", fp32), oneDNN's prepacked weight ("packed") and, in fp32,
    the panel kernel (csrc/cpu_linear.cpp, "panel"). The layouts take turns within each repeat, so
    the machine's drift reaches all alike. One weight per shape: the smaller ones stay in cache here,
    where in a decode step every layer's weights stream from memory (the panel kernel's strength)."""
    import torch.nn.functional as F

    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models.cpu_linear import PackedWeight, PanelWeight

    dtype = getattr(torch, args.dtype)
    kernels = cpu_kernels() if dtype == torch.float32 else None
    points = []
    for name, (k, n) in {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                         "lm_head": (576, 49152)}.items():
        weight = torch.randn(n, k).to(dtype)
        packed = PackedWeight(weight)
        column = weight.t().contiguous().t()
        panel = PanelWeight(column, kernels) if kernels is not None else None
        for rows in (1, 2, 4, 8, 16, 32, 64, 512):
            x = torch.randn(rows, k).to(dtype)
            calls = {"dense": lambda: F.linear(x, weight),
                     "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")}
            if dtype == torch.float32:
                calls["column"] = lambda: F.linear(x, column)
            if panel is not None:
                calls["panel"] = lambda: kernels.panel_linear(x, panel.panels, n)
            repeats = 3 if n * rows > 10**7 else 20
            best = {layout: float("inf") for layout in calls}
            for _ in range(repeats):
                for layout, call in calls.items():
                    start = time.perf_counter()
                    call()
                    best[layout] = min(best[layout], time.perf_counter() - start)
            point = {"shape": name, "rows": rows, **{f"{layout}_ms": 1000 * t for layout, t in best.items()}}
            points.append(point)
            print(f"[bench_cpu] linear {args.dtype} {name} rows {rows}: "
                  + ", ".join(f"{layout} {1000 * t:.3f} ms" for layout, t in best.items())
                  + f" (fastest: {min(best, key=best.get)})", flush=True)
    return {"points": points}


WORKERS = {"engine-prefill": engine_prefill, "hf-prefill": hf_prefill, "engine-decode": engine_decode,
           "hf-decode": hf_decode, "attention": attention_probe, "linear": linear_probe}


def worker_main(args) -> None:
    torch.set_num_threads(args.threads)
    result = WORKERS[args.worker](args)
    result["peak_rss_bytes"] = _peak_rss()
    print(MARK + json.dumps(result), flush=True)


# ------------------------------------------------------------------ the parent
def _spawn(args, worker: str, dtype: str, mode: str = "eager") -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--model-dir", args.model_dir,
            "--dtype", dtype, "--mode", mode, "--threads", str(args.threads), "--prefill", args.prefill,
            "--batches", args.batches, "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
            "--repeats", str(args.repeats)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    sys.stdout.write("".join(line + "\n" for line in proc.stdout.splitlines() if not line.startswith(MARK)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{worker} {dtype} {mode} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def _best_of(kept: dict | None, new: dict, key: str, value: str, better) -> dict:
    """Merge two runs of one worker: the better value per point, the larger peak RSS."""
    if kept is None:
        return new
    old = {p[key]: p for p in kept["points"]}
    points = [p if old.get(p[key]) is None or better(p[value], old[p[key]][value]) == p[value] else old[p[key]]
              for p in new["points"]]
    return {**new, "points": points, "peak_rss_bytes": max(kept["peak_rss_bytes"], new["peak_rss_bytes"]),
            "runs": kept.get("runs", 1) + 1}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--preset", default=None, help="a model preset instead (e.g. default, micro)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill", default="512,2048,4096,8191", help="prompt lengths of the prefill points")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    p.add_argument("--modes", default="eager,compiled", help="graphdecode decode modes: eager, compiled")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    p.add_argument("--repeats", type=int, default=2, help="runs per point within a process; the fastest kept")
    p.add_argument("--rounds", type=int, default=2,
                   help="processes per side, alternating graphdecode and transformers; the fastest kept")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: prefill, decode, attention, linear")
    p.add_argument("--out", default="profiling/out/bench_cpu")
    # worker mode (internal)
    p.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return {}
    if args.model is not None:
        args.model_dir, name = args.model, os.path.basename(os.path.normpath(args.model))
    elif args.preset is not None:
        from graphdecode.bench.presets import ensure_preset

        args.model_dir, name = ensure_preset(args.preset, "cpu"), args.preset
    else:
        from graphdecode.gguf_import import smollm2_dir

        args.model_dir, name = smollm2_dir(), "SmolLM2-135M-Instruct"
    skip = set(filter(None, args.skip.split(",")))
    result = {"bench": "cpu", "model": name, "machine": machine_info(torch.device("cpu"), args.threads),
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "mode", "dtype")}, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        entry = result["dtypes"][dtype] = {}
        if "attention" not in skip:
            entry["attention"] = _spawn(args, "attention", dtype)
        if "linear" not in skip:
            entry["linear"] = _spawn(args, "linear", dtype)
        # the two sides alternate, a process each, round after round (the fastest of each kept): a
        # shared machine drifts by 10-15% over minutes, which must not land on one side only
        for _ in range(args.rounds):
            if "prefill" not in skip:
                prefill = entry.setdefault("prefill", {})
                for side, worker in (("graphdecode", "engine-prefill"), ("transformers", "hf-prefill")):
                    prefill[side] = _best_of(prefill.get(side), _spawn(args, worker, dtype), "tokens", "seconds", min)
            if "decode" not in skip:
                decode = entry.setdefault("decode", {})
                runs = [(mode, "engine-decode", mode) for mode in args.modes.split(",")]
                for side, worker, mode in runs + [("transformers", "hf-decode", "eager")]:
                    decode[side] = _best_of(decode.get(side), _spawn(args, worker, dtype, mode), "batch",
                                            "decode_tokens_per_s", max)
            write_json(args.out + ".json", result)
    print(format_table(result))
    print(f"(wrote {args.out}.json)")
    return result


def format_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['machine']['torch_threads']} thread(s), {result['machine']['date']}",
             f"{'dtype':<9} {'work':<30} {'graphdecode':>12} {'transformers':>13} {'ratio':>6}"]
    for dtype, entry in result["dtypes"].items():
        prefill, decode = entry.get("prefill") or {}, entry.get("decode") or {}
        if prefill:
            theirs = {p["tokens"]: p["seconds"] for p in prefill["transformers"]["points"]}
            for point in prefill["graphdecode"]["points"]:
                t, mine = point["tokens"], point["seconds"]
                work = f"prefill {t} tokens (s)"
                lines.append(f"{dtype:<9} {work:<30} {mine:>12.2f} {theirs[t]:>13.2f} {theirs[t] / mine:>5.2f}x")
        if decode:
            theirs = {p["batch"]: p for p in decode["transformers"]["points"]}
            for mode in (m for m in decode if m != "transformers"):
                for point in decode[mode]["points"]:
                    b, mine = point["batch"], point["decode_tokens_per_s"]
                    other = theirs[b]["decode_tokens_per_s"]
                    same = sum(x == y for x, y in zip(point["output_ids"], theirs[b]["output_ids"]))
                    work = f"decode batch {b} {mode} (tok/s)"
                    lines.append(f"{dtype:<9} {work:<30} {mine:>12.1f} {other:>13.1f} {mine / other:>5.2f}x"
                                 f"  same rows {same}/{b}")
            if "eager" in decode and "compiled" in decode:
                for e, c in zip(decode["eager"]["points"], decode["compiled"]["points"]):
                    work = f"compiled / eager, batch {e['batch']}"
                    lines.append(f"{dtype:<9} {work:<30} {c['decode_tokens_per_s'] / e['decode_tokens_per_s']:>12.2f}x")
        runs = {f"prefill {side}": run for side, run in prefill.items()}
        runs.update({f"decode {side}": run for side, run in decode.items()})
        if runs:
            lines.append(f"{dtype:<9} peak RSS MB: "
                         + ", ".join(f"{name} {run['peak_rss_bytes'] / 2**20:.0f}" for name, run in runs.items()))
        for point in (entry.get("linear") or {}).get("points", []):
            times = {k[:-3]: v for k, v in point.items() if k.endswith("_ms")}
            lines.append(f"{dtype:<9} linear {point['shape']} rows {point['rows']}: "
                         + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
                         + f" (fastest: {min(times, key=times.get)})")
        for point in (entry.get("attention") or {}).get("points", []):
            lines.append(f"{dtype:<9} attention batch {point['batch']} context {point['context']}: "
                         + ", ".join(f"{k[:-3]} {v:.3f} ms" for k, v in point.items() if k.endswith("_ms")))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
