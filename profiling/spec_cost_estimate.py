"""The speculation policy's cost estimate beside the measure: for each batch, an n-gram engine runs bench_spec.py's
input-grounded prompts once never speculating and once speculating every window, then the policy's estimated
speculative / plain window-time ratio (host/spec_policy.py: from the prefills' per-row time and the smallest
bucket's plain window, as if that bucket's windows had not been measured) is printed beside the measured ratio.

    python profiling/spec_cost_estimate.py --batches 1,4,16 -d 4 --threads 2
"""

from __future__ import annotations

import argparse
import os

import torch

from graphdecode.bench.common import machine_info, script_module, write_json


def main(argv=None) -> dict:
    from graphdecode import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("-k", type=int, default=8, help="decode steps (rounds) per window")
    p.add_argument("-d", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="profiling/out/spec_cost_estimate")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    bench_spec = script_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_spec.py"))
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": args.d},
              num_decode_steps=args.k, max_batch_size=max(batches), max_model_len=1024, enable_prefix_caching=False,
              cpu_threads=args.threads)
    policy = llm.engine.spec_policy
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for batch in batches:
        for forced in (False, True):
            policy.speculate = lambda bucket, rows=(), forced=forced: forced
            llm.generate(bench_spec._prompts(llm, bench_spec.GROUNDED, batch), params, use_tqdm=False)
    del policy.speculate
    m, b = policy.row_costs()
    result = {"bench": "spec_cost_estimate", "args": vars(args), "machine": machine_info(llm.config.torch_device,
              args.threads), "step_seconds": m, "row_seconds": b, "points": []}
    print(f"a forward: {m * 1e3:.1f} ms + {b * 1e3:.2f} ms a row (prefill averages: {policy._prefill})")
    for batch in batches:
        spec, plain = policy.window_seconds[(batch, True, False)], policy.window_seconds[(batch, False, False)]
        measured = policy.cost_ratio(batch)
        del policy.window_seconds[(batch, True, False)]
        estimated = policy.cost_ratio(batch)  # from the measured plain window
        del policy.window_seconds[(batch, False, False)]
        unrun = policy.cost_ratio(batch)  # as if the bucket had not run either kind
        policy.window_seconds[(batch, True, False)], policy.window_seconds[(batch, False, False)] = spec, plain
        result["points"].append({"batch": batch, "plain_window_s": plain, "spec_window_s": spec,
                                 "measured": measured, "estimated": estimated, "estimated_unrun": unrun})
        print(f"batch {batch:>3}: plain window {plain:.3f} s, speculative {spec:.3f} s: ratio {measured:.2f}, "
              f"estimated {estimated:.2f} (bucket not run: {unrun:.2f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    return result


if __name__ == "__main__":
    main()
