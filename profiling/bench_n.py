"""Parallel sampling: what does n > 1 cost? (seeds/002: vLLM's n>1 regression.)

One 1,024-token prompt, n in {1, 8, 64}, max_tokens in {1, 64} (temperature 1.0,
ignore_eos). graphdecode prefills a prompt ONCE for any n (its n sequences share the
prompt's full pages), so `prefill_tokens` must be 1,024 for every n. For contrast the
same work is also sent as n separate copies of the prompt (n=1 each), which prefills
n x 1,024 tokens. Reports wall time, prefill tokens, generated tokens and the ratio
wall(n=64) / wall(n=1) per max_tokens.

    python profiling/bench_n.py                       # micro preset, CPU
    python profiling/bench_n.py --n 1,8,64 --max-tokens 1,64 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import (
    cuda_sync,
    machine_info,
    random_prompt_ids,
    resolve_model,
    stats_delta,
    write_json,
)


def timed(llm, prompts, params, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        before = llm.stats()
        cuda_sync(llm.config.torch_device)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        cuda_sync(llm.config.torch_device)
        wall = time.perf_counter() - start
        delta = stats_delta(before, llm.stats())
        if best is None or wall < best["wall_s"]:
            best = {
                "wall_s": wall,
                "prefill_tokens": delta["prefill_tokens"],
                "generated_tokens": delta["generated_tokens"],
                "windows": delta["windows"],
                "completions": sum(len(o.outputs) for o in outs),
            }
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory")
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--n", default="1,8,64", help="comma-separated n values")
    p.add_argument("--max-tokens", default="1,64", help="comma-separated max_tokens values")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("-k", "--num-decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs per point; the fastest is kept")
    p.add_argument("--no-copies", action="store_true", help="skip the n-separate-copies comparison")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="profiling/out/bench_n", help="output prefix (.json)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.n.split(",")]
    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, max_batch_size=max(ns),
              num_decode_steps=args.num_decode_steps, max_model_len=args.prompt_len + max(max_tokens) + 1,
              enable_prefix_caching=False,  # every run prefills the prompt: this measures the n > 1 fork
              cpu_threads=args.threads)
    prompt_ids = random_prompt_ids(1, args.prompt_len, llm.config.model_config.vocab_size)[0]
    prompt = {"prompt_token_ids": prompt_ids}
    result = {
        "bench": "parallel_sampling",
        "machine": machine_info(llm.config.torch_device, args.threads),
        "model_name": model_name,
        "args": vars(args),
        "points": [],
        "ratios": {},
    }
    timed(llm, [prompt], SamplingParams(n=min(ns), max_tokens=2, seed=0, ignore_eos=True), 1)  # warm-up
    for mt in max_tokens:
        for n in ns:
            params = SamplingParams(n=n, max_tokens=mt, temperature=1.0, seed=1, ignore_eos=True)
            point = {"mode": "n", "n": n, "max_tokens": mt, **timed(llm, [prompt], params, args.repeats)}
            result["points"].append(point)
            if not args.no_copies:
                single = SamplingParams(n=1, max_tokens=mt, temperature=1.0, ignore_eos=True)
                copies = {"mode": "copies", "n": n, "max_tokens": mt,
                          **timed(llm, [prompt] * n, single, args.repeats)}
                result["points"].append(copies)
            print(f"[n] max_tokens={mt:>3} n={n:>3}: {1000 * point['wall_s']:8.1f} ms, "
                  f"prefill {point['prefill_tokens']} tokens, generated {point['generated_tokens']}"
                  + ("" if args.no_copies else f" | as {n} copies: {1000 * copies['wall_s']:8.1f} ms, "
                                               f"prefill {copies['prefill_tokens']}"), flush=True)
            write_json(args.out + ".json", result)
        for mode in ("n", "copies"):
            pts = {q["n"]: q for q in result["points"] if q["mode"] == mode and q["max_tokens"] == mt}
            if min(ns) in pts and max(ns) in pts and max(ns) != min(ns):
                ratio = pts[max(ns)]["wall_s"] / pts[min(ns)]["wall_s"]
                result["ratios"][f"{mode}: max_tokens={mt} n={max(ns)}/n={min(ns)}"] = ratio
    write_json(args.out + ".json", result)
    for name, ratio in result["ratios"].items():
        print(f"[n] wall-time ratio {name}: {ratio:.2f}")
    return result


if __name__ == "__main__":
    main()
