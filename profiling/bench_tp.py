"""Tensor parallelism on CPU: TP=1 vs TP=2 (gloo, one torch thread per rank), side by side.

The model (`--preset tp-2048x8`: hidden 2048, 8 layers, 0.63B fp32 parameters, random
weights) is big enough for matmuls to dominate a step. For each batch (`--batches`, 1
and 16) and each TP size: decode tokens/s over `--gen-len` greedy tokens (ignore_eos),
the greedy tokens (which must be equal between TP sizes), and the share of the
driver's step time spent in collectives (all-reduce after o_proj and down_proj and in
the embedding, all-gather of the logits), measured by timing each collective to
completion on rank 0 (a collective waits for its slowest rank, so this is the
synchronisation cost as the driver feels it).

    python profiling/bench_tp.py --out profiling/out/bench_tp
On a machine with several GPUs the same script runs with --device cuda (NCCL).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from graphdecode.bench.common import (
    add_compile_arg,
    compile_option,
    machine_info,
    random_prompt_ids,
    resolve_model,
    write_json,
)
from graphdecode.models.parallel import TPGroup

_collective_seconds = [0.0]


def _timed(method):
    def run(self, x):
        if self.size == 1:
            return x
        import torch.distributed._functional_collectives as funcol

        start = time.perf_counter()
        out = funcol.wait_tensor(method(self, x))
        if out.is_cuda:
            torch.cuda.synchronize()
        _collective_seconds[0] += time.perf_counter() - start
        return out

    return run


def measure(model_dir: str, args, tp: int, batch: int) -> dict:
    from graphdecode import LLM, SamplingParams

    with LLM(model_dir, device=args.device, tensor_parallel_size=tp, buckets=[batch], num_decode_steps=args.k,
             max_model_len=args.prompt_len + args.gen_len + args.k + 8, enable_prefix_caching=False,
             cpu_threads=1, **compile_option(args)) as llm:  # one torch thread per rank
        vocab = llm.config.model_config.vocab_size
        prompts = [{"prompt_token_ids": p} for p in random_prompt_ids(batch, args.prompt_len, vocab, seed=3)]
        greedy = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2 * args.k, ignore_eos=True))  # warm-up
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, one)
        prefill_s = time.perf_counter() - start
        before = llm.stats()
        _collective_seconds[0] = 0.0
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy)
        total_s = time.perf_counter() - start
        collective_s = _collective_seconds[0]
        after = llm.stats()
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "tp": tp,
        "batch": batch,
        "total_s": total_s,
        "decode_tokens_per_s": (after["decode_tokens"] - before["decode_tokens"]) / decode_s,
        "tokens_per_s": batch * args.gen_len / total_s,
        "collective_s": collective_s,
        "collective_share": collective_s / total_s if tp > 1 else 0.0,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="model preset (default: tp-2048x8 when --model is absent)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("-k", type=int, default=8)
    add_compile_arg(p)
    p.add_argument("--out", default="profiling/out/bench_tp")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one thread per rank: the workers use the driver's count
    preset = args.preset or (None if args.model else "tp-2048x8")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    result = {"bench": "tensor_parallel", "model_name": model_name, "args": vars(args),
              "machine": machine_info(torch.device(args.device), 1), "points": []}
    originals = TPGroup.all_reduce, TPGroup.all_gather_last
    TPGroup.all_reduce, TPGroup.all_gather_last = _timed(originals[0]), _timed(originals[1])  # this process only
    try:
        for batch in [int(b) for b in args.batches.split(",")]:
            for tp in [int(t) for t in args.tp.split(",")]:
                point = measure(model_dir, args, tp, batch)
                result["points"].append(point)
                print(f"[tp] batch {batch} TP={tp}: {point['decode_tokens_per_s']:.1f} decode tok/s, "
                      f"collectives {100 * point['collective_share']:.0f}% of the run", flush=True)
    finally:
        TPGroup.all_reduce, TPGroup.all_gather_last = originals
    by_batch: dict = {}
    for point in result["points"]:
        by_batch.setdefault(point["batch"], []).append(point)
    result["same_tokens"] = all(all(pt["tokens"] == pts[0]["tokens"] for pt in pts) for pts in by_batch.values())
    result["speedup"] = {str(b): pts[-1]["decode_tokens_per_s"] / pts[0]["decode_tokens_per_s"]
                         for b, pts in by_batch.items()}
    for point in result["points"]:
        point.pop("tokens")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    print(f"{'batch':>5} {'TP':>3} {'decode tok/s':>13} {'tok/s':>8} {'collective share':>17}")
    for pt in result["points"]:
        print(f"{pt['batch']:>5} {pt['tp']:>3} {pt['decode_tokens_per_s']:>13.1f} {pt['tokens_per_s']:>8.1f} "
              f"{100 * pt['collective_share']:>16.1f}%")
    print(f"speedup (last TP over first): {result['speedup']}, same tokens: {result['same_tokens']}"
          f"  (wrote {args.out}.json)")
    return result


if __name__ == "__main__":
    main()
