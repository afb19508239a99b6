"""Two checkouts side by side in one sitting: decode and prefill tokens/s of the engine at batch
1/16/64, each point run in a fresh subprocess with PYTHONPATH on one checkout, the checkouts
alternating round by round (so a drifting machine hits both alike), best of the rounds kept.

Decode tokens/s is the bucket sweep's: (B x gen tokens) / (full run - prefill-only run), greedy
(or sampled at --temperature), ignore_eos, k = 8, public API only (so any two versions of graphdecode compare).

    python profiling/ab_checkouts.py --before /tmp/old --after . --model DIR --rounds 3
    python profiling/ab_checkouts.py --before /tmp/old --after . --model DIR --batches 1 --prompt-len 2048 \
        --gen-len 8 --threads 2 --dtype bfloat16     # long-prompt prefill
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

POINT = r"""
import json, sys, time, torch
from graphdecode import LLM, SamplingParams
model, batch, prompt_len, gen_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
threads, dtype, temperature = int(sys.argv[5]), sys.argv[6], float(sys.argv[7])
torch.manual_seed(0)
llm = LLM(model, num_decode_steps=8, max_batch_size=max(batch, 1), buckets=[batch], cpu_threads=threads, dtype=dtype,
          max_model_len=prompt_len + gen_len + 16, enable_prefix_caching=False)
vocab = llm.config.model_config.vocab_size
prompts = [{"prompt_token_ids": torch.randint(3, vocab, (prompt_len,)).tolist()} for _ in range(batch)]
def run(n):
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=temperature, seed=7 if temperature else None, max_tokens=n,
                                         ignore_eos=True))
    return time.perf_counter() - start
run(gen_len + 1); run(1)  # warm-up
full, prefill = min(run(gen_len + 1) for _ in range(2)), min(run(1) for _ in range(2))
print(json.dumps({"decode_tok_s": batch * gen_len / (full - prefill), "prefill_tok_s": batch * prompt_len / prefill}))
"""


def point(tree: str, model: str, batch: int, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), GRAPHDECODE_CPU_THREADS=str(args.threads))
    out = subprocess.run([sys.executable, "-c", POINT, model, str(batch), str(args.prompt_len), str(args.gen_len),
                          str(args.threads), args.dtype, str(args.temperature)],
                         env=env, capture_output=True, text=True, cwd="/tmp", check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled decode, seeded")
    args = parser.parse_args(argv)
    best: dict = {}
    for _ in range(args.rounds):
        for batch in (int(b) for b in args.batches.split(",")):
            for side, tree in (("before", args.before), ("after", args.after)):
                got = point(tree, args.model, batch, args)
                key = (side, batch)
                best[key] = {k: max(v, best.get(key, {}).get(k, 0.0)) for k, v in got.items()}
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        b, a = best["before", batch], best["after", batch]
        rows[batch] = {"before": b, "after": a, "decode_ratio": a["decode_tok_s"] / b["decode_tok_s"],
                       "prefill_ratio": a["prefill_tok_s"] / b["prefill_tok_s"]}
        print(f"batch {batch:3d}: decode {b['decode_tok_s']:8.1f} -> {a['decode_tok_s']:8.1f} tok/s "
              f"({rows[batch]['decode_ratio']:.3f}x), prefill {b['prefill_tok_s']:8.1f} -> "
              f"{a['prefill_tok_s']:8.1f} ({rows[batch]['prefill_ratio']:.3f}x)", flush=True)
    return rows


if __name__ == "__main__":
    main()
