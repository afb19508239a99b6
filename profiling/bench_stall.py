"""Decode stall under a long prompt: chunked prefill budget vs a budget larger than the prompt.

32 streams decode (greedy, ignore_eos); then one 4,000-token prompt arrives. For each
budget (`--budgets`, default 256 and 8192) in one run: the longest gap between two
token deliveries of any running stream from the arrival until the long prompt's first
token, beside the median step time before it arrived (one window) and the longest
step while it was prefilled (one chunk + one window). Goal: with chunking the gap is
bounded by one chunk's prefill plus one window, not the whole prompt.

    python profiling/bench_stall.py --preset micro --out profiling/out/bench_stall
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import machine_info, random_prompt_ids, resolve_model, write_json
from graphdecode.models import load_model_config


def run_budget(model_dir: str, args, budget: int, streams: list[list[int]], long_prompt: list[int]) -> dict:
    llm = LLM(model_dir, device=args.device, max_batch_size=args.streams + 1, num_decode_steps=args.k,
              max_model_len=args.long_len + 64, max_num_batched_tokens=budget, enable_prefix_caching=False,
              cpu_threads=args.threads)
    engine = llm.engine
    stream_params = SamplingParams(temperature=0, max_tokens=args.long_len, ignore_eos=True)
    running = [engine.add_request({"prompt_token_ids": p}, stream_params) for p in streams]
    step_times = []
    for _ in range(args.warm_steps):  # every stream decoding, windows in steady state
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    window_s = statistics.median(step_times[-max(3, args.warm_steps // 2):])
    long_request = engine.add_request({"prompt_token_ids": long_prompt}, SamplingParams(temperature=0, max_tokens=4))
    last_delivery = {r.request_id: time.perf_counter() for r in running}
    counts = {r.request_id: r.seqs[0].num_output_tokens for r in running}
    longest_gap, longest_step, steps = 0.0, 0.0, 0
    while long_request.seqs[0].num_output_tokens == 0:
        t0 = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        longest_step = max(longest_step, now - t0)
        steps += 1
        for r in running:
            n = r.seqs[0].num_output_tokens
            if n > counts[r.request_id]:
                longest_gap = max(longest_gap, now - last_delivery[r.request_id])
                counts[r.request_id], last_delivery[r.request_id] = n, now
    now = time.perf_counter()
    longest_gap = max([longest_gap] + [now - t for t in last_delivery.values()])  # streams still waiting
    for r in running + [long_request]:
        engine.abort_request(r.request_id)
    while engine.has_unfinished():
        engine.step()
    return {
        "budget": budget,
        "window_step_s": window_s,
        "steps_until_first_token": steps,
        "longest_step_s": longest_step,
        "longest_gap_s": longest_gap,
        "gap_over_window": longest_gap / window_s,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt-len", type=int, default=16)
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--budgets", default="256,8192")
    p.add_argument("-k", type=int, default=8, help="decode steps per window")
    p.add_argument("--warm-steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="profiling/out/bench_stall")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    vocab = load_model_config(model_dir).vocab_size
    streams = random_prompt_ids(args.streams, args.stream_prompt_len, vocab, seed=1)
    long_prompt = random_prompt_ids(1, args.long_len, vocab, seed=2)[0]
    result = {"bench": "stall", "model_name": model_name, "args": vars(args),
              "machine": machine_info(torch.device(args.device or "cpu"), args.threads), "points": []}
    for budget in [int(b) for b in args.budgets.split(",")]:
        result["points"].append(run_budget(model_dir, args, budget, streams, long_prompt))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    print(f"{args.streams} streams, then one {args.long_len}-token prompt (k={args.k})")
    print(f"{'budget':>7} {'window s':>9} {'steps':>6} {'longest step s':>15} {'longest gap s':>14} {'gap/window':>11}")
    for pt in result["points"]:
        print(f"{pt['budget']:>7} {pt['window_step_s']:>9.4f} {pt['steps_until_first_token']:>6} "
              f"{pt['longest_step_s']:>15.4f} {pt['longest_gap_s']:>14.4f} {pt['gap_over_window']:>11.1f}")
    print(f"(wrote {args.out}.json)")
    return result


if __name__ == "__main__":
    main()
