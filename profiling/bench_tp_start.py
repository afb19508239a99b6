"""How fast a CPU tensor-parallel engine starts: ranks forked from the forkserver against spawned ranks.

In one process, engines are built and closed in turn (forkserver, spawn, forkserver, spawn, ...), each
timed in three parts: construction (the ranks started, the model loaded on every rank), the first
generate (a rank still building its runner finishes it then), and close. The spawn rounds are the
baseline: the driver's `_rank_context` is replaced by multiprocessing's spawn, as ranks started before.
The process's first engine (--first: either kind) also pays the process's own first-use costs, and as a
forkserver engine the server's start (its preload: torch and the runner), so it is reported apart; run
once with each --first to compare them. Both kinds must give the same greedy tokens.

    python profiling/bench_tp_start.py --model DIR --tp 2 --rounds 3 --out profiling/out/bench_tp_start
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp

from graphdecode.bench.common import machine_info, resolve_model, write_json


def _one(model: str, tp: int, threads: int) -> dict:
    from graphdecode import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=256, max_batch_size=4, num_decode_steps=4,
              cpu_threads=threads)
    t1 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": [5 + i, 17, 33]} for i in range(4)],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    t2 = time.perf_counter()
    llm.close()
    t3 = time.perf_counter()
    return {"construct_s": t1 - t0, "first_generate_s": t2 - t1, "close_s": t3 - t2, "total_s": t3 - t0,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model directory (default: the micro preset)")
    p.add_argument("--preset", default=None, help="a preset (micro, ...); without --model or --preset: micro")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="engines of each kind after the first")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--first", choices=["forkserver", "spawn"], default="forkserver",
                   help="the kind of the process's first engine, which also pays the process's own first-use costs "
                        "(and, for forkserver, the server's start); run once with each to compare them")
    p.add_argument("--out", default=None, help="write OUT.json")
    args = p.parse_args(argv)
    from graphdecode.device import tensor_parallel

    model, _ = resolve_model(args.model, args.preset or (None if args.model else "micro"), "cpu")
    forkserver = tensor_parallel._rank_context

    def spawn(device):
        return mp.get_context("spawn")

    kinds = {"forkserver": forkserver, "spawn": spawn}
    tensor_parallel._rank_context = kinds[args.first]
    try:
        first = _one(model, args.tp, args.threads)
    finally:
        tensor_parallel._rank_context = forkserver
    runs = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, context in kinds.items():
            tensor_parallel._rank_context = context
            try:
                runs[kind].append(_one(model, args.tp, args.threads))
            finally:
                tensor_parallel._rank_context = forkserver
    same = all(r["tokens"] == first["tokens"] for rs in runs.values() for r in rs)
    parts = ("construct_s", "first_generate_s", "close_s", "total_s")
    summary = {kind: {part: round(statistics.median(r[part] for r in rs), 3) for part in parts}
               for kind, rs in runs.items()}
    result = {"model": model, "tp": args.tp, "rounds": args.rounds,
              "machine": machine_info(torch.device("cpu"), args.threads),
              "first_engine": dict(kind=args.first, **{part: round(first[part], 3) for part in parts}),
              "median": summary,
              "spawn_over_forkserver_total": round(summary["spawn"]["total_s"] / summary["forkserver"]["total_s"], 2),
              "same_tokens": same}
    print(f"TP={args.tp}, median of {args.rounds} engines each (s): construct / first generate / close / total")
    for kind, row in summary.items():
        print(f"  {kind:10s} {row['construct_s']:6.2f} {row['first_generate_s']:6.2f} {row['close_s']:6.2f} "
              f"{row['total_s']:6.2f}")
    row = result["first_engine"]
    print(f"  the process's first engine ({args.first}): {row['construct_s']:.2f} {row['first_generate_s']:.2f} "
          f"{row['close_s']:.2f} {row['total_s']:.2f}; same tokens: {same}")
    if args.out:
        write_json(args.out + ".json", result)
    return result


if __name__ == "__main__":
    main()
