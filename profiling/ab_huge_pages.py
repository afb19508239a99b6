"""CPU decode with the weights on 2 MiB pages (EngineConfig.cpu_huge_pages) beside 4 KiB ones (BENCHMARKS.md 18u).

Four engines in one process, two with huge pages and two without, placed so that a trend in creation order
cancels (--on 1,2: the second and third built; --on 0,3: the first and last), then run in rotating order,
--repeats rounds, open-ended chat prompts to max_tokens. Per batch: each round's tokens/s of the huge-page
pair over the other pair, their median and how many rounds the huge pages won; and each engine's median
(two engines alike differ by their layout in memory: the spread between the pairs is the noise floor).

    python profiling/ab_huge_pages.py --batches 1,4,16 --repeats 12 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from graphdecode.bench.common import machine_info, script_module, write_json


def main(argv=None) -> dict:
    from graphdecode import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=12, help="rounds per batch, every engine once a round")
    p.add_argument("--on", default="1,2", help="which two of the four engines (by creation order) use huge pages")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="profiling/out/ab_huge_pages")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    on = {int(i) for i in args.on.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(num_decode_steps=8, max_batch_size=max(batches), max_model_len=1024, enable_prefix_caching=False,
                  cpu_threads=args.threads, dtype=args.dtype)
    engines = [LLM(args.model, cpu_huge_pages=i in on, **common) for i in range(4)]
    collapsed = [e.engine.executor.runner.model.huge_pages.wait() if i in on else 0 for i, e in enumerate(engines)]
    print(f"[huge pages] engines {sorted(on)}: {[c >> 20 for c in collapsed]} MiB on 2 MiB pages", flush=True)
    bench_spec = script_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_spec.py"))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result = {"bench": "huge_pages", "args": vars(args), "collapsed_bytes": collapsed,
              "machine": machine_info(engines[0].config.torch_device, args.threads), "points": []}
    for batch in batches:
        prompts = bench_spec._prompts(engines[0], bench_spec.OPEN_ENDED, batch)
        runs = bench_spec.measure(dict(enumerate(engines)), prompts, params, args.repeats)  # warmed, rotating
        rates = [runs[i]["rates"] for i in range(len(engines))]
        huge = [sum(rates[i][r] for i in on) for r in range(args.repeats)]
        small = [sum(rates[i][r] for i in range(4) if i not in on) for r in range(args.repeats)]
        ratios = [h / s for h, s in zip(huge, small)]
        point = {"batch": batch, "ratio_median": statistics.median(ratios), "wins": sum(x > 1 for x in ratios),
                 "ratios": ratios, "engine_medians": [statistics.median(x) for x in rates], "huge": sorted(on)}
        result["points"].append(point)
        print(f"[huge pages] batch {batch}: huge / 4 KiB {point['ratio_median']:.3f} (median of {args.repeats} "
              f"rounds, {point['wins']} won); engines' medians "
              f"{[f'{m:.1f}' + ('*' if i in on else '') for i, m in enumerate(point['engine_medians'])]} tok/s",
              flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    return result


if __name__ == "__main__":
    main()
