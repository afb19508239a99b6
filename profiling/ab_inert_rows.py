"""What a CPU window saves by leaving its inert rows out, in-process A/B on one engine (BENCHMARKS.md 10p, 10q).

Each point runs the same engine and prompts with the saving on and off, alternating round by round (the first to
run changing each round), best of --rounds, and checks the tokens are the same:
* verify: n-gram speculation forced in every window; a row's queries past its drafts inert (`verify_metadata`'s
  `drafted`) against every query live;
* logits: the window's LM head over the live rows only (`DecoderForCausalLM.window_logits`) against every row, on
  a plain engine and on forced n-gram;
* upkeep (with --eagle3-head): an EAGLE-3 engine forced plain, its upkeep pass over the live steps only
  (`HeadDrafter.kept_steps`) against every step; the pass's share of the run's time beside.

    python profiling/ab_inert_rows.py --threads 2 --eagle3-head DIR
"""

from __future__ import annotations

import argparse
import time

import torch

from graphdecode.bench.common import machine_info, script_module, write_json


def _rounds(llm, prompts, params, toggle, rounds: int, timed=None) -> dict:
    """{"on": ..., "off": ...}: each mode's best tokens/s, its tokens, and (timed: a [seconds] cell the toggled
    code adds to) its share of the time."""
    llm.generate(prompts, params, use_tqdm=False)
    out = {m: {"tokens_per_s": 0.0, "seconds": 0.0, "timed": 0.0} for m in ("on", "off")}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            toggle(mode == "on")
            before = timed[0] if timed else 0.0
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            point = out[mode]
            point["seconds"] += seconds
            point["timed"] += (timed[0] - before) if timed else 0.0
            point["tokens_per_s"] = max(point["tokens_per_s"], sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            point["tokens"] = [o.outputs[0].token_ids for o in outs]
    toggle(True)
    return out


def main(argv=None) -> dict:
    import graphdecode.device.speculative as speculative
    from graphdecode import LLM, SamplingParams
    from graphdecode.device.draft_head import HeadDrafter
    from graphdecode.models.decoder import DecoderForCausalLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--eagle3-head", default=None, help="an EAGLE-3 head's directory: adds the upkeep points")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="profiling/out/ab_inert_rows")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    sets = script_module(__file__.replace("ab_inert_rows.py", "bench_spec.py"))
    common = dict(max_model_len=1024, max_batch_size=16, num_decode_steps=8, cpu_threads=args.threads,
                  enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    ngram = LLM(args.model, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **common)
    ngram.engine.spec_policy.speculate = lambda bucket, rows=(): True
    plain = LLM(args.model, **common)

    real_meta, real_logits = speculative.verify_metadata, DecoderForCausalLM.window_logits
    real_kept = HeadDrafter.__dict__["kept_steps"]  # the staticmethod itself

    def every_query(*a, drafted=None, **k):
        return real_meta(*a, **k)

    def verify(on):
        speculative.verify_metadata = real_meta if on else every_query

    def logits(on):
        DecoderForCausalLM.window_logits = real_logits if on else \
            (lambda self, hidden, ctx: self.compute_logits(hidden))

    def upkeep(on):
        HeadDrafter.kept_steps = real_kept if on else staticmethod(lambda live: None)

    cases = [("verify", "n-gram forced", ngram, "open-ended", 4, verify, None),
             ("verify", "n-gram forced", ngram, "input-grounded", 4, verify, None),
             ("logits", "plain", plain, "open-ended", 16, logits, None),
             ("logits", "plain", plain, "open-ended", 4, logits, None),
             ("logits", "n-gram forced", ngram, "open-ended", 4, logits, None),
             ("logits", "n-gram forced", ngram, "input-grounded", 4, logits, None)]
    if args.eagle3_head:
        eagle = LLM(args.model, speculative_config={"method": "eagle3", "model": args.eagle3_head,
                                                    "num_speculative_tokens": 2}, **common)
        eagle.engine.spec_policy.speculate = lambda bucket, rows=(): False
        spent = [0.0]
        real_followed = HeadDrafter.followed

        def followed(self, *a):
            start = time.perf_counter()
            real_followed(self, *a)
            spent[0] += time.perf_counter() - start

        HeadDrafter.followed = followed
        cases += [("upkeep", "EAGLE-3 forced plain", eagle, "input-grounded", b, upkeep, spent) for b in (16, 4)]
    result = {"bench": "ab_inert_rows", "args": vars(args), "machine": machine_info(plain.config.torch_device,
                                                                                      args.threads), "points": []}
    for saving, engine, llm, name, batch, toggle, timed in cases:
        texts = sets.GROUNDED if name == "input-grounded" else sets.OPEN_ENDED
        runs = _rounds(llm, sets._prompts(llm, texts, batch), params, toggle, args.rounds, timed)
        on, off = runs["on"], runs["off"]
        point = {"saving": saving, "engine": engine, "set": name, "batch": batch,
                 "off_tokens_per_s": off["tokens_per_s"], "on_tokens_per_s": on["tokens_per_s"],
                 "speedup": on["tokens_per_s"] / off["tokens_per_s"], "same_tokens": on["tokens"] == off["tokens"],
                 "lengths": [len(t) for t in on["tokens"]]}
        if timed:
            point["upkeep_share_off"], point["upkeep_share_on"] = off["timed"] / off["seconds"], \
                on["timed"] / on["seconds"]
        result["points"].append(point)
        extra = (f", upkeep {100 * point['upkeep_share_off']:.2f}% -> {100 * point['upkeep_share_on']:.2f}% of the "
                 f"time" if timed else "")
        print(f"[inert] {saving:<7} {engine:<21} {name:<15} batch {batch:>2}: {off['tokens_per_s']:.1f} -> "
              f"{on['tokens_per_s']:.1f} tok/s ({point['speedup']:.3f}x){extra}, same tokens "
              f"{point['same_tokens']}, lengths {point['lengths']}", flush=True)
    write_json(args.out + ".json", result)
    return result


if __name__ == "__main__":
    main()
