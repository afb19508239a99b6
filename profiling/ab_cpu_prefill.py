"""In-process A/B of CPU prefill attention: the prefill kernel (csrc/cpu_prefill.cpp) against SDPA's flash kernels.

One engine, one process: every layer's prefill attention through `CpuKernels.prefill_attention` ("kernel")
or through the path the backend takes without it ("sdpa": `_scaled_dot_product_flash_attention_for_cpu`,
two flash calls merged by log-sum-exp after cached tokens), switched between timed `generate` calls of
max_tokens=1 in alternating order so the host's drift reaches both alike. `--chunk N` prefills in chunks
of N tokens (max_num_batched_tokens), so later chunks attend over cached keys. Prints each length's best
times, the best-of ratio, the median of the paired ratios and whether the first tokens are the same
(BENCHMARKS.md section 18).

    python profiling/ab_cpu_prefill.py --threads 2 --lengths 512,2048
    python profiling/ab_cpu_prefill.py --threads 2 --lengths 2048 --chunk 512 --dtype bfloat16
"""

from __future__ import annotations

import argparse


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lengths", default="512,2048", help="prompt lengths (one prompt per generate)")
    p.add_argument("--batch", type=int, default=1, help="prompts per generate")
    p.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the engine")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    from graphdecode import LLM
    from graphdecode.attention.torch_backend import TorchAttentionBackend
    from graphdecode.bench.common import paired_ab, random_prompt_ids, timed_greedy
    from graphdecode.gguf_import import smollm2_dir

    extra = {} if args.chunk is None else {"max_num_batched_tokens": args.chunk}
    llm = LLM(args.model or smollm2_dir(), dtype=args.dtype, max_model_len=max(lengths) + 8, cpu_threads=args.threads,
              enable_prefix_caching=False, max_batch_size=max(args.batch, 1), **extra)
    if getattr(llm.engine.runner.backend, "kernels", None) is None:
        raise SystemExit("needs the CPU kernels (a C++ compiler)")
    with_kernel = TorchAttentionBackend._prefill_kernel
    variants = {"kernel": with_kernel, "sdpa": lambda self, spec: False}
    results = []
    for length in lengths:
        prompts = [{"prompt_token_ids": ids}
                   for ids in random_prompt_ids(args.batch, length, llm.config.model_config.vocab_size)]

        def run(name):
            TorchAttentionBackend._prefill_kernel = variants[name]
            try:
                return timed_greedy(llm, prompts, 1)
            finally:
                TorchAttentionBackend._prefill_kernel = with_kernel

        ab = paired_ab(run, ("sdpa", "kernel"), args.rounds)
        best, ratios = ab["best"], ab["ratios"]
        tokens_in = length * args.batch
        result = {"length": length, "batch": args.batch, "chunk": args.chunk, "threads": args.threads,
                  "dtype": args.dtype, "sdpa_s": best["sdpa"], "kernel_s": best["kernel"],
                  "sdpa_tokens_per_s": tokens_in / best["sdpa"], "kernel_tokens_per_s": tokens_in / best["kernel"],
                  "best_ratio": ab["best_ratio"], "median_paired_ratio": ab["median_ratio"],
                  "same_tokens": ab["same_outputs"]}
        results.append(result)
        print(f"{args.dtype}, {args.batch} x {length} tokens, chunk {args.chunk or 'default'}, {args.threads} threads: "
              f"sdpa {result['sdpa_tokens_per_s']:.0f} tok/s, kernel {result['kernel_tokens_per_s']:.0f} tok/s; "
              f"best-of {result['best_ratio']:.3f}x, median paired {result['median_paired_ratio']:.3f}x "
              f"[{min(ratios):.2f}-{max(ratios):.2f}], same tokens {result['same_tokens']}", flush=True)
    return results


if __name__ == "__main__":
    main()
