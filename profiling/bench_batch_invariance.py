"""What batch invariance costs: the same model as two engines in one process, batch-invariant (the default: on
the CPU every linear's rows through the fixed-order panel kernels, on CUDA fixed 128-row GEMMs and FlashInfer
without split-KV) and `batch_invariant=False` (oneDNN's and aten's GEMMs past a few rows; cuBLAS as it chooses),
timed side by side in alternating rounds (bench.common.paired_ab).

Per point: decode tokens/s at batch 1 / 16 / 64 (a run of --gen tokens less a prefill-only run) and
prefill tokens/s of one --prefill-len prompt; the ratio is invariant over variant (above 1: invariance
costs). Also whether the two engines' greedy tokens agree. Results go to BENCHMARKS.md ("Batch invariance").

    python profiling/bench_batch_invariance.py --dtype bfloat16 --threads 2
    python profiling/bench_batch_invariance.py --dtype float32 --threads 2 --batches 1 16
    python profiling/bench_batch_invariance.py --device cuda --preset llama-3.2-1b --compile off   (a GPU)
"""

from __future__ import annotations

import argparse

from graphdecode.bench.common import (
    add_compile_arg,
    compile_option,
    paired_decode,
    paired_prefill,
    random_prompt_ids,
    resolve_model,
    timed_greedy,
    write_json,
)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--preset", default=None, help="a model preset instead (bench/presets.py, e.g. llama-3.2-1b)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    add_compile_arg(p)
    args = p.parse_args(argv)

    from graphdecode import LLM
    from graphdecode.gguf_import import smollm2_dir

    model = args.model or (resolve_model(None, args.preset, args.device)[0] if args.preset else smollm2_dir())
    longest = max(args.prompt_len + args.gen, args.prefill_len + 1) + 8
    engine = dict(dtype=args.dtype, max_batch_size=max(args.batches), max_model_len=longest, cpu_threads=args.threads,
                  enable_prefix_caching=False, max_num_batched_tokens=max(8192, args.prefill_len),
                  **({"device": args.device} if args.device else {}), **compile_option(args))
    llms = {"invariant": LLM(model, **engine), "variant": LLM(model, **engine, batch_invariant=False)}
    vocab = llms["invariant"].config.model_config.vocab_size
    results = {"model": model, "device": str(llms["invariant"].engine.runner.device), "dtype": args.dtype, "threads": args.threads, "decode": {}, "prefill": None}
    names = ("invariant", "variant")

    def run(name, prompts, tokens):
        return timed_greedy(llms[name], prompts, tokens)

    for batch in args.batches:
        prompts = [{"prompt_token_ids": ids} for ids in random_prompt_ids(batch, args.prompt_len, vocab)]
        tps, ab = paired_decode(run, names, prompts, args.gen, args.rounds)
        results["decode"][batch] = {"tokens_per_s": tps, "ratio": tps["variant"] / tps["invariant"],
                                    "median_ratio": ab["median_ratio"], "same_tokens": ab["same_outputs"]}
        print(f"decode batch {batch:3d}: invariant {tps['invariant']:7.1f} tok/s  variant {tps['variant']:7.1f} "
              f"tok/s  cost {tps['variant'] / tps['invariant']:.2f}x (median {ab['median_ratio']:.2f})  "
              f"same tokens {ab['same_outputs']}", flush=True)
    tps, ab = paired_prefill(run, names, random_prompt_ids(1, args.prefill_len, vocab, seed=1)[0], args.rounds)
    results["prefill"] = {"tokens": args.prefill_len, "tokens_per_s": tps, "ratio": tps["variant"] / tps["invariant"],
                          "median_ratio": ab["median_ratio"]}
    print(f"prefill {args.prefill_len}: invariant {tps['invariant']:7.1f} tok/s  variant {tps['variant']:7.1f} tok/s  "
          f"cost {tps['variant'] / tps['invariant']:.2f}x (median {ab['median_ratio']:.2f})", flush=True)
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
