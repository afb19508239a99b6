"""In-process A/B of a CPU decode step's layers: one C++ call (models/cpu_decode.py) against the eager forward.

One engine, one process: `model.cpu_decode` set ("layers": every plain decoder layer of a decode step in one
call of csrc/cpu_layers.cpp) or None ("eager": the layer-by-layer forward, the same kernels called from
Python), switched between timed `generate` calls in alternating order so the host's drift reaches both alike.
Decode time is a full run less a prefill-only one. Prints the best of each as tokens/s, the best-of ratio,
the median of the paired ratios and whether the tokens are the same (BENCHMARKS.md section 18).

    python profiling/ab_cpu_decode_layers.py --threads 2 --batches 1,16
    python profiling/ab_cpu_decode_layers.py --threads 2 --batches 1,4 --dtype bfloat16
"""

from __future__ import annotations

import argparse


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--gen", type=int, default=65, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the engine")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]

    from graphdecode import LLM
    from graphdecode.bench.common import paired_ab, random_prompt_ids, timed_greedy
    from graphdecode.gguf_import import smollm2_dir

    llm = LLM(args.model or smollm2_dir(), dtype=args.dtype, max_batch_size=max(batches),
              max_model_len=args.prompt_len + args.gen + 8, cpu_threads=args.threads, enable_prefix_caching=False)
    model = llm.engine.runner.model
    layers = model.cpu_decode
    if layers is None:
        raise SystemExit("the model's decode steps do not take the one-call layers (not plain Llama layers, no "
                         "panelled projections, or no CPU kernels)")
    results = []
    for batch in batches:
        prompts = [{"prompt_token_ids": ids}
                   for ids in random_prompt_ids(batch, args.prompt_len, llm.config.model_config.vocab_size)]

        def run(name):
            model.cpu_decode = layers if name == "layers" else None
            try:
                full, tokens = timed_greedy(llm, prompts, args.gen)
                return full - timed_greedy(llm, prompts, 1)[0], tokens
            finally:
                model.cpu_decode = layers

        ab = paired_ab(run, ("eager", "layers"), args.rounds)
        decoded = batch * (args.gen - 1)
        result = {"batch": batch, "gen": args.gen, "prompt_len": args.prompt_len, "threads": args.threads,
                  "dtype": args.dtype, "eager_tokens_per_s": decoded / ab["best"]["eager"],
                  "layers_tokens_per_s": decoded / ab["best"]["layers"], "best_ratio": ab["best_ratio"],
                  "median_paired_ratio": ab["median_ratio"], "same_tokens": ab["same_outputs"]}
        results.append(result)
        print(f"{args.dtype}, batch {batch}, {args.threads} threads: eager {result['eager_tokens_per_s']:.1f} tok/s, "
              f"layers {result['layers_tokens_per_s']:.1f} tok/s; best-of {result['best_ratio']:.3f}x, median paired "
              f"{result['median_paired_ratio']:.3f}x [{min(ab['ratios']):.2f}-{max(ab['ratios']):.2f}], same tokens "
              f"{result['same_tokens']}", flush=True)
    return results


if __name__ == "__main__":
    main()
