"""In-process A/B of the CPU linears: today's dispatch against the one before it.

One engine, one process: the LM head as the engine loads it today (a PanelWeight: its panels up to
HEAD_PANEL_ROWS rows, oneDNN's packed GEMM for more; a tied embedding's lookups read the panels) and as
before (oneDNN's packed GEMM at every row count), swapped between timed `generate` calls in alternating
order, so the host's drift reaches both alike; the projections are today's in both. Decode time is a full
run less a prefill-only one. Prints the best of each, the best-of ratio, the median of the paired ratios
and whether the tokens are the same (BENCHMARKS.md sections 12d, 18).

    python profiling/ab_cpu_linears.py --batch 1 --gen 65 --threads 2
    python profiling/ab_cpu_linears.py --batch 1 --gen 65 --threads 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse

from graphdecode.models.cpu_linear import PackedWeight


class BeforeHead:
    """The LM head before: oneDNN's packed weight at every row count."""

    def __init__(self, now):
        self.now = now

    def __call__(self, x, bias=None):
        return PackedWeight.run(self.now, x, bias)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--gen", type=int, default=24, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the engine")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)

    from graphdecode import LLM
    from graphdecode.bench.common import paired_ab, random_prompt_ids, timed_greedy
    from graphdecode.gguf_import import smollm2_dir
    from graphdecode.models.cpu_linear import PanelWeight

    llm = LLM(args.model or smollm2_dir(), dtype=args.dtype, max_batch_size=args.batch, max_model_len=args.prompt_len + args.gen + 8,
              cpu_threads=args.threads, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if not isinstance(model.packed_head, PanelWeight):
        raise SystemExit("needs a panelled LM head (a model that streams its weights, the CPU kernels)")
    variants = {"now": model.packed_head, "before": BeforeHead(model.packed_head)}
    prompts = [{"prompt_token_ids": ids}
               for ids in random_prompt_ids(args.batch, args.prompt_len, llm.config.model_config.vocab_size)]

    def run(name):
        model.packed_head = variants[name]
        full, tokens = timed_greedy(llm, prompts, args.gen)
        return (full - timed_greedy(llm, prompts, 1)[0] if args.gen > 1 else full), tokens

    ab = paired_ab(run, ("before", "now"), args.rounds)
    best, ratios = ab["best"], ab["ratios"]
    result = {"batch": args.batch, "gen": args.gen, "prompt_len": args.prompt_len, "threads": args.threads,
              "dtype": args.dtype, "before_s": best["before"], "now_s": best["now"], "best_ratio": ab["best_ratio"],
              "median_paired_ratio": ab["median_ratio"], "same_tokens": ab["same_outputs"]}
    what = "decode" if args.gen > 1 else "prefill"
    print(f"{args.dtype}, batch {args.batch}, {args.gen} tokens, {args.prompt_len}-token prompts, {args.threads} "
          f"threads, {what}: "
          f"before {best['before']:.3f} s, now {best['now']:.3f} s; best-of {result['best_ratio']:.3f}x, median "
          f"paired {result['median_paired_ratio']:.3f}x [{min(ratios):.2f}-{max(ratios):.2f}], "
          f"same tokens {result['same_tokens']}", flush=True)
    return result


if __name__ == "__main__":
    main()
