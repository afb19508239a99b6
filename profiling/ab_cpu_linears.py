"""In-process A/B of the fp32 CPU linears: panels + column-major (today) against oneDNN packed + row-major.

One engine, one process: the projections' `PanelWeight`s and, built from the same weights, the
`PackedWeight`s the engine used before the panels (oneDNN's packed weight, the row-major one beside it
for 1-2 rows) are swapped in and out between timed `generate` calls, in alternating order, so the
host's drift reaches both alike. Prints the best of each, the best-of ratio, the median of the paired
ratios and whether the tokens are the same (BENCHMARKS.md section 12d).

    python profiling/ab_cpu_linears.py --batch 16 --gen 24
    python profiling/ab_cpu_linears.py --batch 1 --gen 1 --prompt-len 2048     # prefill
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gen", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from graphdecode import LLM, SamplingParams
    from graphdecode.bench.common import random_prompt_ids
    from graphdecode.gguf_import import smollm2_dir
    from graphdecode.models.cpu_linear import PackedWeight, PanelWeight

    llm = LLM(args.model or smollm2_dir(), buckets=[args.batch], num_decode_steps=8,
              max_model_len=args.prompt_len + args.gen + 8, cpu_threads=1, enable_prefix_caching=False)
    modules = [m for m in llm.engine.runner.model.modules() if isinstance(getattr(m, "packed", None), PanelWeight)]
    if not modules:
        raise SystemExit("no panelled projections: fp32 weights of 2^19 elements and up, with the CPU kernels")
    variants = {"panel": [m.packed for m in modules],
                "packed": [PackedWeight(m.packed.dense.contiguous()) for m in modules]}
    prompts = [{"prompt_token_ids": ids}
               for ids in random_prompt_ids(args.batch, args.prompt_len, llm.config.model_config.vocab_size)]
    params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)

    def run(name):
        for module, weight in zip(modules, variants[name]):
            module.packed = weight
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    run("panel")  # warm both
    run("packed")
    best, tokens, ratios = {"packed": float("inf"), "panel": float("inf")}, {}, []
    for i in range(args.rounds):
        took = {}
        for name in ("packed", "panel") if i % 2 == 0 else ("panel", "packed"):
            took[name], tokens[name] = run(name)
            best[name] = min(best[name], took[name])
        ratios.append(took["packed"] / took["panel"])
    result = {"batch": args.batch, "gen": args.gen, "prompt_len": args.prompt_len, "packed_s": best["packed"],
              "panel_s": best["panel"], "best_ratio": best["packed"] / best["panel"],
              "median_paired_ratio": statistics.median(ratios), "same_tokens": tokens["packed"] == tokens["panel"]}
    print(f"batch {args.batch}, {args.gen} tokens, {args.prompt_len}-token prompts: packed {best['packed']:.3f} s, "
          f"panels {best['panel']:.3f} s; best-of {result['best_ratio']:.3f}x, median paired "
          f"{result['median_paired_ratio']:.3f}x [{min(ratios):.2f}-{max(ratios):.2f}], "
          f"same tokens {result['same_tokens']}", flush=True)
    return result


if __name__ == "__main__":
    main()
