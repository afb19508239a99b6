"""Beyond one process on one CPU box, side by side in one run: pipeline stages against one rank, and
data-parallel replicas against one engine.

* Pipeline: decode tokens/s of one engine at `--batches` (16, 64) with every core on one rank (TP=1, `--threads`
  threads) against PP=2 (two stages, `--threads` / 2 threads each), with one micro-batch in flight (a stage idles
  while the other runs: the bubble) and with two (pp_micro_batches=2, the default: the stages overlap). Greedy
  tokens must be equal. Decode tokens/s as the bucket sweep counts
  them: (B x gen) / (full run - prefill-only run).
* Data parallel: `graphdecode serve` with one engine (`--threads` threads) against `--data-parallel-size 2` (half
  each), `--clients` concurrent clients of `--max-tokens` tokens each through the HTTP API: output tokens/s of the
  whole burst.

    python profiling/bench_distributed.py --threads 2 --out profiling/out/bench_distributed
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import httpx

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import machine_info, random_prompt_ids, write_json


def decode_rate(model: str, batch: int, args, **engine) -> tuple[float, list]:
    prompts = [{"prompt_token_ids": ids} for ids in random_prompt_ids(batch, args.prompt_len, 2000, seed=batch)]
    with LLM(model, num_decode_steps=8, max_batch_size=batch, buckets=[batch],
             max_model_len=args.prompt_len + args.gen_len + 16, enable_prefix_caching=False, **engine) as llm:
        def run(n):
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start, outs
        run(args.gen_len)  # warm-up
        full, outs = min((run(args.gen_len) for _ in range(args.repeats)), key=lambda r: r[0])
        prefill = min(run(1)[0] for _ in range(args.repeats))
    return batch * (args.gen_len - 1) / (full - prefill), [o.outputs[0].token_ids for o in outs]


async def burst(url: str, clients: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as c:
        async def one(i):
            r = await c.post("/v1/completions", json={"model": "bench", "prompt": f"Client {i} writes a story about",
                                                      "max_tokens": max_tokens, "ignore_eos": True})
            return r.json()["usage"]["completion_tokens"]
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(clients))))
        return tokens / (time.perf_counter() - start)


def serve_rate(model: str, args, replicas: int) -> float:
    from graphdecode.server.launch import start_server, stop_server

    threads = max(1, args.threads // replicas)
    proc, url = start_server(["--model", model, "--served-model-name", "bench", "--threads", str(threads), "-k", "8",
                              "--max-model-len", "512", "--max-batch-size", str(args.clients), "--no-access-log",
                              "--log-level", "warning", "--data-parallel-size", str(replicas)],
                             f"{args.out}.serve{replicas}.log", timeout_s=600)
    try:
        asyncio.run(burst(url, args.clients, 8))  # warm-up
        return max(asyncio.run(burst(url, args.clients, args.max_tokens)) for _ in range(args.repeats))
    finally:
        stop_server(proc)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=2, help="cores in use by every configuration")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=33)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: pipeline, serve")
    p.add_argument("--out", default="profiling/out/bench_distributed")
    args = p.parse_args(argv)
    if args.model is None:
        from graphdecode.gguf_import import smollm2_dir

        args.model = smollm2_dir()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    import torch

    result = {"machine": machine_info(torch.device("cpu"), args.threads), "args": vars(args), "pipeline": [],
              "serve": {}}
    if "pipeline" not in args.skip:
        for batch in map(int, args.batches.split(",")):
            one, tokens = decode_rate(args.model, batch, args, cpu_threads=args.threads)
            half = max(1, args.threads // 2)
            bubble, tokens_bubble = decode_rate(args.model, batch, args, cpu_threads=half, pipeline_parallel_size=2,
                                                pp_micro_batches=1)
            two, tokens_pp = decode_rate(args.model, batch, args, cpu_threads=half, pipeline_parallel_size=2)
            row = {"batch": batch, "tp1_tok_s": one, "pp2_one_micro_batch_tok_s": bubble, "pp2_tok_s": two,
                   "pp2_over_tp1": two / one, "tokens_equal": tokens == tokens_pp == tokens_bubble}
            result["pipeline"].append(row)
            print(f"decode batch {batch}: TP=1 {one:.1f} tok/s; PP=2 one micro-batch {bubble:.1f} ({bubble / one:.2f}x), "
                  f"two {two:.1f} ({two / one:.2f}x); tokens equal: {row['tokens_equal']}", flush=True)
    if "serve" not in args.skip:
        one, two = serve_rate(args.model, args, 1), serve_rate(args.model, args, 2)
        result["serve"] = {"clients": args.clients, "one_engine_tok_s": one, "two_replicas_tok_s": two,
                           "ratio": two / one}
        print(f"serve, {args.clients} clients: one engine {one:.1f} tok/s, two replicas {two:.1f} tok/s "
              f"({two / one:.2f}x)", flush=True)
    write_json(f"{args.out}.json", result)
    return result


if __name__ == "__main__":
    main()
