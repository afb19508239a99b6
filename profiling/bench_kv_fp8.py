"""The FP8 KV cache on the CPU: how many sequences a pool of fixed bytes holds, decode tokens/s and perplexity,
each beside the cache in the model's dtype, in one run (issue 34's KV-cache benchmark).

* capacity: for each model dtype, EngineConfig's pages for --pool-bytes of KV cache and the sequences of
  --context tokens they hold at once (pages - the scratch page, / pages per sequence), "auto" against "fp8";
* decode: profiling/bench_cpu_peers.py's measurement (its worker: 128-token random prompts, 128 greedy tokens,
  decode tokens/s = batch * 127 / (full run - prefill-only run)), auto and fp8 alternating round by round, each
  point its best round;
* perplexity: bench_quant.py's (prompt logprobs over its fixed English text), with unit scales and with scales
  calibrated on a different text (graphdecode/models/quant/kv_scales.py).

    python profiling/bench_kv_fp8.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from graphdecode.bench.common import script_module  # noqa: E402

peers = script_module(os.path.join(HERE, "bench_cpu_peers.py"))
quant = script_module(os.path.join(HERE, "bench_quant.py"))

CALIBRATION = """Rain had fallen on the valley for nine days when the river finally broke its banks. The farmers moved
their animals to the high pastures, the school closed, and the bakery on the square kept its ovens going through the
night so that the volunteers filling sandbags would have bread in the morning. By the end of the week the water had
reached the steps of the town hall, and the mayor, who had been in office for less than a month, stood on those steps
in borrowed boots and told everyone who would listen that the town had seen worse and would see worse again."""


def capacity(model: str, dtype: str, kv: str, pool_bytes: int, context: int) -> dict:
    from graphdecode.config import EngineConfig

    config = EngineConfig(model, device="cpu", dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_bytes=pool_bytes,
                          max_model_len=context)
    return {"pages": config.num_pages, "sequences": (config.num_pages - 1) // config.max_pages_per_seq}


def calibrated(model: str, work: str) -> str:
    from transformers import AutoTokenizer

    from graphdecode.models.quant.kv_scales import calibrate_kv_scales, write_kv_scales

    path = os.path.join(work, os.path.basename(os.path.normpath(model)) + "-kv-scales")
    if not os.path.isfile(os.path.join(path, "config.json")):
        ids = AutoTokenizer.from_pretrained(model).encode(CALIBRATION)
        write_kv_scales(model, path, calibrate_kv_scales(model, [ids]))
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=peers.DEFAULT_MODEL, help="float HF checkpoint (SmolLM2 by default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pool-bytes", type=int, default=1 << 30, help="the KV pool of the capacity table")
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence in the capacity table")
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "graphdecode", "bench_kv"))
    ap.add_argument("--out", default="profiling/out/bench_kv_fp8")
    args = ap.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    report = {"args": vars(args), "capacity": {}, "perplexity": {}, "decode": {"auto": [], "fp8": []}}
    for dtype in ("float32", "bfloat16"):
        report["capacity"][dtype] = {kv: capacity(args.model, dtype, kv, args.pool_bytes, args.context)
                                     for kv in ("auto", "fp8")}
    scaled = calibrated(args.model, args.work)
    for name, path, kv in (("auto", args.model, "auto"), ("fp8", args.model, "fp8"),
                           ("fp8, calibrated scales", scaled, "fp8")):
        report["perplexity"][name] = quant.perplexity(path, "float32", args.threads, kv_cache_dtype=kv)
        print(f"[bench_kv_fp8] perplexity {name}: {report['perplexity'][name]:.4f}", flush=True)
    peer_args = argparse.Namespace(batches=[int(b) for b in args.batches.split(",")], prefill=[],
                                   prompt_len=args.prompt_len, gen_len=args.gen_len, repeats=args.repeats,
                                   threads=args.threads, dtype="float32", model=args.model)
    for r in range(args.rounds):
        for kv in ("auto", "fp8"):
            peer_args.kv_cache_dtype = kv
            report["decode"][kv].append(peers.run_worker(peers.MINE, sys.executable, peer_args, args.threads))
            print(f"[bench_kv_fp8] round {r + 1}: {kv} done", flush=True)
    for kv in ("auto", "fp8"):
        report["decode"][kv] = peers.best_of(report["decode"][kv])
    report["table"] = table(report, peer_args.batches, args)
    print(report["table"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return report


def table(report: dict, batches: list[int], args) -> str:
    lines = [f"| KV pool of {args.pool_bytes / 2**30:g} GiB, {args.context}-token sequences | pages | sequences at once |",
             "|---|---|---|"]
    for dtype, kinds in report["capacity"].items():
        for kv, c in kinds.items():
            lines.append(f"| {dtype} model, cache {kv} | {c['pages']} | {c['sequences']} |")
    ppl = report["perplexity"]
    lines += ["", "| float32 model, {} threads | perplexity | ".format(args.threads)
              + " | ".join(f"decode b{b} tok/s" for b in batches) + " |", "|---" * (2 + len(batches)) + "|"]
    for kv in ("auto", "fp8"):
        rates = [p["tokens_per_s"] for p in report["decode"][kv]["decode"]]
        lines.append(f"| cache {kv} | {ppl[kv]:.3f} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    ratio = [f["tokens_per_s"] / a["tokens_per_s"] for a, f in zip(report["decode"]["auto"]["decode"],
                                                                    report["decode"]["fp8"]["decode"])]
    lines.append(f"| fp8 / auto | {ppl['fp8'] / ppl['auto']:.4f} | " + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    lines.append(f"| cache fp8, calibrated scales | {ppl['fp8, calibrated scales']:.3f} |" + " |" * len(batches))
    lines.append("\ngreedy tokens before the first difference from auto's (mean over the batch's sequences of "
                 f"{args.gen_len}; random-token prompts): " + ", ".join(
                     f"b{b} {agreement(a['output_ids'], f['output_ids']):.1f}" for b, a, f in
                     zip(batches, report["decode"]["auto"]["decode"], report["decode"]["fp8"]["decode"])))
    return "\n".join(lines)


def agreement(auto: list[list[int]], fp8: list[list[int]]) -> float:
    firsts = [next((i for i, (x, y) in enumerate(zip(a, f)) if x != y), len(a)) for a, f in zip(auto, fp8)]
    return sum(firsts) / len(firsts)


if __name__ == "__main__":
    main()
