"""Shared-prefix workload, prefix caching on vs off in one run.

N requests (default 200) = one common prefix (default 1,000 tokens) + a unique suffix
(default 20 tokens), all submitted at once, greedy, `--max-tokens` (32) each with
ignore_eos. Per mode: prefill tokens computed (against the unique tokens, prefix once +
every suffix), prefix-cache hits, time to first token per request (submission -> the
step that hands the request its first token; p50 / p99 / max), and wall time.

    python profiling/bench_prefix_cache.py --preset micro --out profiling/out/bench_prefix_cache
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import machine_info, random_prompt_ids, resolve_model, write_json
from graphdecode.models import load_model_config


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(model_dir: str, args, prompts: list[list[int]], caching: bool) -> dict:
    llm = LLM(model_dir, device=args.device, page_size=args.page_size, max_batch_size=args.max_batch_size,
              max_model_len=args.prefix_len + args.suffix_len + args.max_tokens + 8,
              enable_prefix_caching=caching, cpu_threads=args.threads)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)  # warm-up (first use of every path)
    before = llm.stats()
    engine = llm.engine
    start = time.perf_counter()
    requests = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    ttft: dict[str, float] = {}
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter() - start
        for r in requests:
            if r.request_id not in ttft and r.seqs[0].num_output_tokens > 0:
                ttft[r.request_id] = now
    wall = time.perf_counter() - start
    after = llm.stats()
    outputs = [r.seqs[0].output_token_ids for r in requests]
    times = list(ttft.values())
    return {
        "prefix_caching": caching,
        "wall_s": wall,
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "prefix_cache_queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "prefill_steps": after["prefill_batches"] - before["prefill_batches"],
        "ttft_p50_s": statistics.median(times),
        "ttft_p99_s": _percentile(times, 0.99),
        "ttft_max_s": max(times),
        "output_tokens": sum(len(o) for o in outputs),
        "outputs": outputs,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="profiling/out/bench_prefix_cache")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    vocab = load_model_config(model_dir).vocab_size
    prefix = random_prompt_ids(1, args.prefix_len, vocab, seed=1)[0]
    prompts = [prefix + s for s in random_prompt_ids(args.requests, args.suffix_len, vocab, seed=2)]
    unique = args.prefix_len + args.requests * args.suffix_len
    result = {"bench": "prefix_cache", "model_name": model_name, "args": vars(args), "unique_tokens": unique,
              "machine": machine_info(torch.device(args.device or "cpu"), args.threads), "modes": []}
    for caching in (True, False):
        mode = run_mode(model_dir, args, prompts, caching)
        mode["prefill_over_unique"] = mode["prefill_tokens"] / unique
        result["modes"].append(mode)
    on, off = result["modes"]
    result["outputs_identical"] = on.pop("outputs") == off.pop("outputs")
    result["wall_speedup"] = off["wall_s"] / on["wall_s"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    print(f"{args.requests} requests, prefix {args.prefix_len} + {args.suffix_len} unique tokens, page size "
          f"{args.page_size}: {unique} unique tokens")
    print(f"{'caching':<8} {'prefill tok':>12} {'/unique':>8} {'hits':>8} {'ttft p50':>9} {'p99':>8} {'wall s':>8}")
    for m in result["modes"]:
        print(f"{'on' if m['prefix_caching'] else 'off':<8} {m['prefill_tokens']:>12} "
              f"{m['prefill_over_unique']:>8.3f} {m['prefix_cache_hits']:>8} {m['ttft_p50_s']:>9.3f} "
              f"{m['ttft_p99_s']:>8.3f} {m['wall_s']:>8.2f}")
    print(f"wall-time speedup {result['wall_speedup']:.2f}x, outputs identical: {result['outputs_identical']}"
          f"  (wrote {args.out}.json)")
    return result


if __name__ == "__main__":
    main()
