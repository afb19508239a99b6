"""An EAGLE-3 head beside plain decoding, in-process and alternating (BENCHMARKS.md 10c).

--mode forced: speculating every window (the policy off) at each d of --ds, batch 1, the open-ended
chat prompts one at a time: tokens/s, accepted drafts per verify and per draft position.
--mode plain-windows: the policy forced plain, at --batch: what following the target's plain steps
costs an EAGLE-3 engine (beside a plain engine, another plain one for the noise floor, and an n-gram
engine, which follows nothing).

    python profiling/ab_eagle3.py --head DIR --mode forced --ds 2,3,4 --threads 2
    python profiling/ab_eagle3.py --head DIR --mode plain-windows --batch 16 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from graphdecode.bench.common import script_module


def main(argv=None) -> dict:
    from graphdecode import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", required=True, help="the EAGLE-3 head's directory (profiling/distil_eagle3.py)")
    p.add_argument("--mode", choices=("forced", "plain-windows"), default="forced")
    p.add_argument("--ds", default="2,3,4", help="forced: num_speculative_tokens to try")
    p.add_argument("--batch", type=int, default=16, help="plain-windows: the batch")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="above 0: sampled, seeded (rejection sampling)")
    p.add_argument("--dtype", default="float32", help="the target's (and head's) dtype: float32 or bfloat16")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    batch = 1 if args.mode == "forced" else args.batch
    common = dict(max_model_len=1024, max_batch_size=max(batch, 4), num_decode_steps=8, enable_prefix_caching=False,
                  cpu_threads=args.threads, dtype=args.dtype)
    engines = {"plain": LLM(args.model, **common)}
    if args.mode == "forced":
        for d in (int(x) for x in args.ds.split(",")):
            e = LLM(args.model, speculative_config={"method": "eagle3", "model": args.head,
                                                    "num_speculative_tokens": d}, **common)
            e.engine.spec_policy.speculate = lambda bucket, rows=(): True
            engines[f"eagle3 d={d}"] = e
    else:
        engines["plain again"] = LLM(args.model, **common)
        for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                           ("eagle3", {"method": "eagle3", "model": args.head, "num_speculative_tokens": 4})):
            e = LLM(args.model, speculative_config=spec, **common)
            e.engine.spec_policy.speculate = lambda bucket, rows=(): False
            engines[f"{name}, plain windows"] = e
    texts = script_module(__file__.replace("ab_eagle3.py", "bench_spec.py")).OPEN_ENDED
    tokenizer = engines["plain"].get_tokenizer()
    prompts = [{"prompt": tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                                        add_generation_prompt=True, tokenize=False)}
               for i in range(max(batch, len(texts)) if args.mode == "forced" else batch)]
    params = SamplingParams(temperature=args.temperature, seed=7 if args.temperature > 0 else None,
                            max_tokens=args.max_tokens, ignore_eos=args.mode != "forced")
    for e in engines.values():
        e.generate(prompts[:1], params)
    best: dict[str, float] = {}
    accepted: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for name, e in engines.items():
            before = e.stats()
            start = time.perf_counter()
            if args.mode == "forced":  # batch 1: one prompt at a time
                outs = [e.generate([p], params)[0] for p in prompts]
            else:
                outs = e.generate(prompts, params)
            seconds = time.perf_counter() - start
            after = e.stats()
            best[name] = max(best.get(name, 0.0), sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            verifies = after["spec_verifies"] - before["spec_verifies"]
            per_position = [a - b for a, b in zip(after.get("spec_accepted_per_position", []),
                                                  before.get("spec_accepted_per_position", [])
                                                  or [0] * len(after.get("spec_accepted_per_position", [])))]
            accepted[name] = ((after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / verifies
                              if verifies else 0.0, per_position)
    for name in engines:
        print(f"{name:22s} {best[name]:7.1f} tok/s  {best[name] / best['plain']:.2f}x  accepted/verify "
              f"{accepted[name][0]:.2f}  accepted per draft position {accepted[name][1]}")
    return {"tokens_per_s": best, "accepted": accepted}


if __name__ == "__main__":
    main()
