"""min_p / top_k / top_p on an eager CPU: each row's kept prefix found among its likeliest tokens
(`device/top_filter.py`) against sorting every row, in-process A/B on one engine (BENCHMARKS.md 18v).

Each point runs the same engine and prompts (open-ended chat, seeded T = 0.7) with the candidates (`WIDTH`) and
with the sort (the width set to the vocabulary's size), alternating round by round, best of --rounds, and checks
the tokens are the same: a plain engine at batch 1 and 16 under top_p, top_k and min_p, and n-gram speculation
forced in every window at batch 4 (its verify filters d + 1 queries a row).

    python profiling/ab_top_filter.py --threads 2
"""

from __future__ import annotations

import argparse
import os

import torch

from graphdecode.bench.common import machine_info, script_module, write_json


def main(argv=None) -> dict:
    import graphdecode.device.top_filter as top_filter
    from graphdecode import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="profiling/out/ab_top_filter")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    here = os.path.dirname(os.path.abspath(__file__))
    sets = script_module(os.path.join(here, "bench_spec.py"))
    rounds = script_module(os.path.join(here, "ab_inert_rows.py"))._rounds
    common = dict(max_model_len=1024, max_batch_size=16, num_decode_steps=8, cpu_threads=args.threads,
                  enable_prefix_caching=False)
    plain = LLM(args.model, **common)
    ngram = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **common)
    ngram.engine.spec_policy.speculate = lambda bucket, rows=(): True
    width, vocab = top_filter.WIDTH, plain.engine.runner.sampler.vocab_keys.numel()

    def candidates(on):
        top_filter.WIDTH = width if on else vocab

    filters = {"top_p 0.95": dict(top_p=0.95), "top_k 50": dict(top_k=50), "min_p 0.05": dict(min_p=0.05)}
    cases = [("plain", plain, name, batch) for name in filters for batch in (1, 16)]
    cases.append(("n-gram forced", ngram, "top_p 0.95", 4))
    result = {"bench": "ab_top_filter", "args": vars(args), "width": width, "vocab": vocab,
              "machine": machine_info(plain.config.torch_device, args.threads), "points": []}
    for engine, llm, name, batch in cases:
        params = SamplingParams(temperature=0.7, seed=7, max_tokens=args.max_tokens, **filters[name])
        runs = rounds(llm, sets._prompts(llm, sets.OPEN_ENDED, batch), params, candidates, args.rounds)
        on, off = runs["on"], runs["off"]
        point = {"engine": engine, "filter": name, "batch": batch, "sorted_tokens_per_s": off["tokens_per_s"],
                 "candidates_tokens_per_s": on["tokens_per_s"], "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                 "same_tokens": on["tokens"] == off["tokens"]}
        result["points"].append(point)
        print(f"[top filter] {engine:<14} {name:<11} batch {batch:>2}: sorted {off['tokens_per_s']:.1f} -> "
              f"candidates {on['tokens_per_s']:.1f} tok/s ({point['speedup']:.3f}x), same tokens "
              f"{point['same_tokens']}", flush=True)
    write_json(args.out + ".json", result)
    return result


if __name__ == "__main__":
    main()
