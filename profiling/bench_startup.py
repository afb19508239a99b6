"""Start-up cost of a compiled engine: a cold process against a warm second process.

Each measurement is a fresh Python process that builds `LLM(model, compile=True, ...)`
and reports its construction time (model load, KV cache, compile, and on CUDA graph
capture) with stats()'s compile_seconds / capture_seconds, then runs one short greedy
generate whose tokens must equal those of an eager engine built in the same run.

* cold: a new, empty graphdecode cache directory (so inductor's caches under it are empty);
* warm: a second process on the same cache directory;
* eager: compile=False, the baseline a user pays without torch.compile.

    python profiling/bench_startup.py --preset default --device cpu --out profiling/out/bench_startup
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from graphdecode.bench.common import machine_info, resolve_model, write_json

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
t0 = time.perf_counter()
from graphdecode import LLM, SamplingParams
from torch._dynamo.utils import counters
args = json.loads(sys.argv[1])
t1 = time.perf_counter()
llm = LLM(args["model"], device=args["device"], dtype=args["dtype"], compile=args["compile"],
          buckets=args["buckets"], max_model_len=256, cpu_threads=int(sys.argv[2]))
t2 = time.perf_counter()
stats = llm.stats()
prompts = [{"prompt_token_ids": [5 + i, 17, 33, 48][: 1 + i % 4]} for i in range(5)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
print("RESULT " + json.dumps({
    "import_s": t1 - t0,
    "construct_s": t2 - t1,
    "compile_s": stats["compile_seconds"],
    "warm_start": stats["compile_warm_start"],
    "capture_s": stats["capture_seconds"],
    "first_generate_s": time.perf_counter() - t2,
    "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
    "fx_cache_misses": counters["inductor"]["fxgraph_cache_miss"],
    "tokens": [o.outputs[0].token_ids for o in outs],
}))
"""


def run_child(cache: str, spec: dict, threads: int) -> dict:
    env = dict(os.environ, GRAPHDECODE_CACHE=cache)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor's cache goes under the graphdecode cache
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec), str(threads)],
                          capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--preset", default="default", help="micro | llama-3.2-1b | default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--buckets", default="1,2,4,8,16", help="comma-separated buckets")
    p.add_argument("--warm-runs", type=int, default=2, help="warm processes after the cold one")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="profiling/out/bench_startup")
    args = p.parse_args(argv)
    model_dir, model_name = resolve_model(args.model, args.preset, args.device)
    buckets = [int(b) for b in args.buckets.split(",")]
    spec = {"model": model_dir, "device": args.device, "dtype": args.dtype, "buckets": buckets}
    result = {"bench": "startup", "model_name": model_name, "args": vars(args),
              "machine": machine_info(__import__("torch").device(args.device), args.threads)}
    with tempfile.TemporaryDirectory(prefix="gd-startup-") as cache:
        result["eager"] = run_child(cache, {**spec, "compile": False}, args.threads)
        result["cold"] = run_child(cache, {**spec, "compile": True}, args.threads)
        result["warm"] = [run_child(cache, {**spec, "compile": True}, args.threads) for _ in range(args.warm_runs)]
    for run in [result["cold"], *result["warm"]]:
        if run["tokens"] != result["eager"]["tokens"]:
            raise RuntimeError("the compiled engine's greedy tokens differ from the eager engine's")
    warm = min(r["construct_s"] for r in result["warm"])
    result["warm_over_cold"] = warm / result["cold"]["construct_s"]
    for run in [result["eager"], result["cold"], *result["warm"]]:
        run.pop("tokens")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out + ".json", result)
    print(f"{'process':<8} {'construct s':>12} {'compile s':>10} {'capture s':>10} {'fx hits':>8} {'misses':>7}")
    for name, run in [("eager", result["eager"]), ("cold", result["cold"])] + [("warm", r) for r in result["warm"]]:
        print(f"{name:<8} {run['construct_s']:>12.2f} {run['compile_s']:>10.2f} {run['capture_s']:>10.2f} "
              f"{run['fx_cache_hits']:>8} {run['fx_cache_misses']:>7}")
    print(f"warm / cold construction: {result['warm_over_cold']:.2f}  (wrote {args.out}.json)")
    return result


if __name__ == "__main__":
    main()
