"""In-process A/B of the CPU linears: today's dispatch against the one before it.

One engine, one process: the projections' and the LM head's weights as the engine loads them today
(panels up to PANEL_ROWS rows, oneDNN's packed GEMM for more; the head packed) and, rebuilt from the
same panels, the dispatch before (fp32: panels up to 48 rows, aten's NN GEMM on a column-major copy for
more, the head's row-major dense GEMV for 1-2 rows, packed for more; bf16: oneDNN's packed GEMM at every
row count, the head as today) are swapped in and out between timed
`generate` calls, in alternating order, so the host's drift reaches both alike. Decode time is a full
run less a prefill-only one. Prints the best of each, the best-of ratio, the median of the paired ratios
and whether the tokens are the same (BENCHMARKS.md sections 12d, 18).

    python profiling/ab_cpu_linears.py --batch 16 --gen 33 --threads 2
    python profiling/ab_cpu_linears.py --batch 1 --gen 65 --threads 2 --dtype bfloat16
    python profiling/ab_cpu_linears.py --batch 1 --gen 1 --prompt-len 2048     # prefill only
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from graphdecode.models.cpu_linear import PackedWeight

BEFORE_PANEL_ROWS = 48
BEFORE_DENSE_HEAD_ROWS = 2


class Before:
    """A projection as the engine ran it before: fp32 panels up to 48 rows, aten's NN GEMM on W^T for more;
    bf16 oneDNN's packed GEMM only."""

    def __init__(self, now):
        self.now = now
        weight = now.panels.transpose(1, 2).reshape(-1, now.in_features)[: now.out_features]
        self.column_major = weight.t().contiguous().t()

    def __call__(self, x, bias=None):
        if x.dtype == torch.bfloat16:
            return PackedWeight.run(self.now, x, bias)
        if x.numel() <= BEFORE_PANEL_ROWS * self.now.in_features:
            return self.now.kernels.panel_linear(x, self.now.panels, self.now.out_features, bias)
        return F.linear(x, self.column_major, bias)


class BeforeHead:
    """The LM head before: the row-major dense weight for 1-2 rows, oneDNN's packed one for more."""

    def __init__(self, now, dense):
        self.now, self.dense = now, dense

    def __call__(self, x, bias=None):
        dense = x.dtype == torch.float32 and x.shape[0] <= BEFORE_DENSE_HEAD_ROWS
        return F.linear(x, self.dense, bias) if dense else self.now(x, bias)


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
    modules = [m for m in model.modules() if isinstance(getattr(m, "packed", None), PanelWeight)]
    if not modules or model.packed_head is None or not model.config.tie_word_embeddings:
        raise SystemExit("needs panelled projections (fp32, a model that streams its weights, the CPU kernels) "
                         "and a tied LM head")
    variants = {"now": ([m.packed for m in modules], model.packed_head),
                "before": ([Before(m.packed) for m in modules],
                           BeforeHead(model.packed_head, model.model.embed_tokens.weight))}
    prompts = [{"prompt_token_ids": ids}
               for ids in random_prompt_ids(args.batch, args.prompt_len, llm.config.model_config.vocab_size)]

    def run(name):
        weights, model.packed_head = variants[name]
        for module, weight in zip(modules, weights):
            module.packed = weight
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
