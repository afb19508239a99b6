"""What LoRA costs: the same model as two engines in one process, plain and with enable_lora (its requests running
a PEFT adapter of rank --rank on every projection, made here with random weights), timed side by side in
alternating rounds (bench.common.paired_ab).

Per batch: decode tokens/s (a run of --gen tokens less a prefill-only run) of each engine, and the ratio plain
over LoRA (above 1: LoRA costs); the prefill of one --prefill-len prompt likewise. A LoRA engine pays its masked
matmuls over max_loras x rank columns for every token, with an adapter or without, and on a CPU it gives up the
one-call decode layers (models/cpu_decode.py). Results go to BENCHMARKS.md ("LoRA adapters").

    python profiling/bench_lora.py --threads 2
    python profiling/bench_lora.py --threads 2 --dtype bfloat16 --max-loras 4 --batches 1 8
"""

from __future__ import annotations

import argparse
import os

from graphdecode.bench.common import paired_decode, paired_prefill, random_prompt_ids, timed_greedy, write_json

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model: str, out: str, rank: int) -> str:
    """A PEFT adapter of every projection at `rank`, A and B random (small), saved once at `out`."""
    if os.path.isfile(os.path.join(out, "adapter_config.json")):
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    peft_model.save_pretrained(out)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="(default: the engine's)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter", default=None, help="the PEFT adapter's directory, made there (random) if it holds "
                                                    "none (default: in the cache directory, per model and rank)")
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--gen", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    from graphdecode import LLM, LoRARequest
    from graphdecode.cache import cache_root
    from graphdecode.gguf_import import smollm2_dir

    model = args.model or smollm2_dir()
    adapter = make_adapter(model, args.adapter or os.path.join(cache_root(), "lora",
                                                               f"{os.path.basename(model)}-r{args.rank}"), args.rank)
    lora = LoRARequest("bench", 1, adapter)
    longest = max(args.prompt_len + args.gen, args.prefill_len + 1) + 8
    engine = dict(max_batch_size=max(args.batches), max_model_len=longest, cpu_threads=args.threads,
                  enable_prefix_caching=False, max_num_batched_tokens=max(8192, args.prefill_len),
                  **({"dtype": args.dtype} if args.dtype else {}))
    llms = {"plain": LLM(model, **engine),
            "lora": LLM(model, **engine, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank)}
    vocab = llms["plain"].config.model_config.vocab_size

    def timed(name, prompts, tokens):
        llm = llms[name]
        if name == "plain":
            return timed_greedy(llm, prompts, tokens)
        real = llm.generate

        def with_adapter(prompts, params, use_tqdm=False):
            return real(prompts, params, use_tqdm=use_tqdm, lora_request=lora)
        llm.generate = with_adapter
        try:
            return timed_greedy(llm, prompts, tokens)
        finally:
            del llm.generate

    results = {"model": model, "dtype": str(llms["plain"].config.torch_dtype), "threads": args.threads,
               "rank": args.rank, "max_loras": args.max_loras, "decode": {}, "prefill": None}
    names = ("lora", "plain")
    for batch in args.batches:
        prompts = [{"prompt_token_ids": ids} for ids in random_prompt_ids(batch, args.prompt_len, vocab)]
        tps, ab = paired_decode(timed, names, prompts, args.gen, args.rounds)
        results["decode"][batch] = {"tokens_per_s": tps, "cost": tps["plain"] / tps["lora"],
                                    "median_cost": ab["median_ratio"]}
        print(f"decode batch {batch:3d}: plain {tps['plain']:7.1f} tok/s  lora {tps['lora']:7.1f} tok/s  cost "
              f"{tps['plain'] / tps['lora']:.2f}x (median {ab['median_ratio']:.2f})", flush=True)
    tps, ab = paired_prefill(timed, names, random_prompt_ids(1, args.prefill_len, vocab, seed=1)[0], args.rounds)
    results["prefill"] = {"tokens": args.prefill_len, "tokens_per_s": tps, "cost": tps["plain"] / tps["lora"],
                          "median_cost": ab["median_ratio"]}
    print(f"prefill {args.prefill_len}: plain {tps['plain']:7.1f} tok/s  lora {tps['lora']:7.1f} tok/s  cost "
          f"{tps['plain'] / tps['lora']:.2f}x (median {ab['median_ratio']:.2f})", flush=True)
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
