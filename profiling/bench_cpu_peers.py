"""The CPU path against the engines a CPU user would pick instead: vLLM's CPU build and llama.cpp.

Same machine, same weights (SmolLM2-135M-Instruct by default), same precision, equal thread
counts, 128-token random prompts and 128 greedy tokens (ignore_eos); the engines alternate
round by round and each point keeps its best round, so drift on a shared machine hits all
of them alike.

* graphdecode and vLLM run this file as a worker (`--worker graphdecode|vllm`) in their own
  Python. vLLM's CPU build compiles its model with inductor by default; graphdecode compiles only when
  asked (`compile=True`), so `--compile both` runs it both ways, eager and compiled, as two engines: vLLM's CPU build lives in a virtual environment of its own (`--vllm-python`), as
  it pins its own dependencies. Decode tokens/s = batch * (gen_len - 1) / (full run -
  prefill-only run); prefill = one prompt of L tokens with max_tokens=1. CPU-seconds per
  token are the user+system time of the worker's whole process tree (vLLM's engine-core
  process included): for decode, the full runs' less the prefill-only runs', per decoded token.
* llama.cpp runs its own tools on a GGUF conversion of the same checkpoint (`--gguf`):
  `llama-batched-bench` for decode at each batch (its S_TG) and `llama-bench` for prefill
  (pp L). Its CPU-seconds come from the tool's whole run (rusage of the child): for decode,
  the share of its wall time spent in generation (T_TG / (T_PP + T_TG)); for prefill, per
  prompt token processed, llama-bench's warm-up run included.
* Greedy tokens of graphdecode and vLLM are compared row by row at every batch (fp32: they
  should agree).

    python profiling/bench_cpu_peers.py --vllm-python /work/peers/vllm-venv/bin/python \\
        --llama-bin /work/peers/llama.cpp/build/bin --gguf /work/peers/smollm2-f32.gguf --threads 1,2

Writes PREFIX.json and prints one table per thread count (ratios > 1: graphdecode is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

MARK = "BENCH_PEERS_RESULT "
MINE, COMPILED = "graphdecode", "graphdecode compiled"
DEFAULT_MODEL = os.path.join(os.path.expanduser("~"), ".cache", "graphdecode", "smollm2-135m-instruct")


def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Not graphdecode.bench's random_prompt_ids: the vLLM worker's Python has no graphdecode."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def tree_cpu_seconds() -> float:
    """user + system seconds of this process and every live descendant."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Timer:
    """Best wall time over repeats, and the tree's CPU-seconds summed over all of them."""

    def __init__(self):
        self.cpu = 0.0

    def best(self, fn, repeats: int):
        best, result = float("inf"), None
        for _ in range(repeats):
            cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
            self.cpu += tree_cpu_seconds() - cpu0
        return best, result


# ------------------------------------------------------------------ workers (one per subprocess)
def _max_model_len(args) -> int:
    return max([args.prompt_len + args.gen_len, *args.prefill]) + 16


def _greedy(llm, sampling_params):
    """generate(prompts, max_tokens) -> each prompt's greedy token ids, through an `LLM` API both
    engines share (token-id prompts, SamplingParams, use_tqdm)."""
    def generate(prompts, max_tokens):
        params = sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def _graphdecode_engine(args):
    from graphdecode import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=_max_model_len(args), enable_prefix_caching=False,
              cpu_threads=args.threads, max_batch_size=max(args.batches), compile=args.compiled,
              kv_cache_dtype=args.kv_cache_dtype)
    return _greedy(llm, SamplingParams), llm.config.model_config.vocab_size


def _vllm_engine(args):
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=_max_model_len(args), enable_prefix_caching=False,
              max_num_seqs=max(args.batches), seed=0)
    return _greedy(llm, SamplingParams), llm.llm_engine.model_config.get_vocab_size()


def worker(args) -> dict:
    generate, vocab = (_graphdecode_engine if args.worker == "graphdecode" else _vllm_engine)(args)
    generate(prompt_ids(2, 16, vocab, seed=99), 4)  # warm-up
    result = {"decode": [], "prefill": []}
    for batch in args.batches:
        prompts = prompt_ids(batch, args.prompt_len, vocab, seed=batch)
        generate(prompts, 2)  # this batch's shapes warm
        prefill, full = Timer(), Timer()
        prefill_s, _ = prefill.best(lambda: generate(prompts, 1), args.repeats)
        full_s, tokens = full.best(lambda: generate(prompts, args.gen_len), args.repeats)
        decoded = batch * (args.gen_len - 1)  # per run: what the full run makes beyond the prefill-only one
        result["decode"].append({
            "batch": batch, "tokens_per_s": decoded / max(full_s - prefill_s, 1e-9),
            "cpu_s_per_token": max(full.cpu - prefill.cpu, 0.0) / (args.repeats * decoded), "output_ids": tokens})
    for length in args.prefill:
        prompts = prompt_ids(1, length, vocab, seed=1000 + length)
        timer = Timer()
        seconds, _ = timer.best(lambda: generate(prompts, 1), args.repeats)
        result["prefill"].append({"tokens": length, "tokens_per_s": length / seconds,
                                  "cpu_s_per_token": timer.cpu / (args.repeats * length)})
    return result


# ------------------------------------------------------------------ llama.cpp (its own tools)
def _run_tool(cmd: list[str]) -> tuple[str, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out.stdout, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def llama_cpp(args) -> dict:
    result = {"decode": [], "prefill": []}
    for batch in args.batches:
        ctx = batch * (args.prompt_len + args.gen_len) + 64
        text, cpu = _run_tool([os.path.join(args.llama_bin, "llama-batched-bench"), "-m", args.gguf,
                               "-t", str(args.threads), "-tb", str(args.threads), "-c", str(ctx), "-b", "2048",
                               "-ub", "512", "-npp", str(args.prompt_len), "-ntg", str(args.gen_len),
                               "-npl", str(batch), "--output-format", "jsonl"])
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        row = rows[-1]  # the tool's CPU time split between its phases by their wall time (threads busy in both)
        decode_cpu = cpu * row["t_tg"] / (row["t_pp"] + row["t_tg"])
        result["decode"].append({"batch": batch, "tokens_per_s": row["speed_tg"],
                                 "cpu_s_per_token": decode_cpu / (batch * args.gen_len)})
    for length in args.prefill:
        text, cpu = _run_tool([os.path.join(args.llama_bin, "llama-bench"), "-m", args.gguf, "-t", str(args.threads),
                               "-p", str(length), "-n", "0", "-r", str(args.repeats), "-o", "json"])
        run = json.loads(text)[0]
        made = length * (args.repeats + 1)  # llama-bench warms up once
        result["prefill"].append({"tokens": length, "tokens_per_s": run["avg_ts"], "cpu_s_per_token": cpu / made})
    return result


# ------------------------------------------------------------------ driver
def run_worker(engine: str, python: str, args, threads: int) -> dict:
    worker = MINE if engine.startswith(MINE) else engine
    cmd = [python, os.path.abspath(__file__), "--worker", worker, "--model", args.model, "--dtype", args.dtype,
           "--threads", str(threads), "--batches", ",".join(map(str, args.batches)),
           "--prefill", ",".join(map(str, args.prefill)), "--prompt-len", str(args.prompt_len),
           "--gen-len", str(args.gen_len), "--repeats", str(args.repeats),
           "--kv-cache-dtype", getattr(args, "kv_cache_dtype", "auto")] + (["--compiled"] * (engine == COMPILED))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in out.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"{engine} worker failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def best_of(runs: list[dict]) -> dict:
    """Per point, the round with the most tokens/s."""
    best = {"decode": [], "prefill": []}
    for kind in best:
        for i in range(len(runs[0][kind])):
            best[kind].append(max((r[kind][i] for r in runs), key=lambda p: p["tokens_per_s"]))
    return best


def table(threads: int, results: dict, args) -> str:
    engines = list(results)
    head = f"| tokens/s (CPU-s/token), {threads} thread{'s' * (threads > 1)} | " + " | ".join(engines)
    ours = [e for e in engines if e.startswith(MINE)]
    ratios = [(a, b) for a in ours for b in engines if not b.startswith(MINE)]
    head += "".join(f" | {a} / {b}" for a, b in ratios) + " |"
    lines = [head, "|" + "---|" * (1 + len(engines) + len(ratios))]
    for kind, key, label in (("decode", "batch", "decode, batch {}"), ("prefill", "tokens", "prefill, {} tokens")):
        for i, point in enumerate(results[ours[0]][kind]):
            cells = [f"{results[e][kind][i]['tokens_per_s']:.1f} ({results[e][kind][i]['cpu_s_per_token'] * 1e3:.1f} ms)"
                     for e in engines]
            cells += [f"{results[a][kind][i]['tokens_per_s'] / results[b][kind][i]['tokens_per_s']:.2f}x"
                      for a, b in ratios]
            lines.append(f"| {label.format(point[key])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement(results: dict) -> list[str]:
    if "vllm" not in results:
        return []
    notes = []
    for engine in (e for e in results if e.startswith(MINE)):
        for mine, theirs in zip(results[engine]["decode"], results["vllm"]["decode"]):
            same = sum(a == b for a, b in zip(mine["output_ids"], theirs["output_ids"]))
            notes.append(f"{engine}, batch {mine['batch']}: {same}/{len(mine['output_ids'])} rows of greedy tokens "
                         "equal vLLM's")
    return notes


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=["graphdecode", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="HF checkpoint directory (all engines' weights)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", default="1,2", help="thread counts (each engine gets the same)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", default="off", choices=["off", "on", "both"],
                    help="graphdecode eager, compiled (compile=True), or both as two engines")
    ap.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)  # a worker's compile=True
    ap.add_argument("--kv-cache-dtype", default="auto", help=argparse.SUPPRESS)  # a graphdecode worker's
    ap.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu (omit: no vLLM)")
    ap.add_argument("--llama-bin", help="folder with llama-bench and llama-batched-bench (omit: no llama.cpp)")
    ap.add_argument("--gguf", help="the checkpoint converted to GGUF at --dtype (convert_hf_to_gguf.py)")
    ap.add_argument("--out", default="profiling/out/cpu_peers")
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",") if x]
    if args.worker:
        args.threads = int(args.threads)
        print(MARK + json.dumps(worker(args)), flush=True)
        return None
    if args.llama_bin and not args.gguf:
        ap.error("--gguf: llama.cpp needs the checkpoint converted to GGUF")
    report = {"args": dict(vars(args)), "threads": {}}
    texts = []
    for threads in (int(x) for x in args.threads.split(",")):
        args.threads = threads
        runs = {name: [] for name in {"off": [MINE], "on": [COMPILED], "both": [MINE, COMPILED]}[args.compile]}
        if args.vllm_python:
            runs["vllm"] = []
        if args.llama_bin:
            runs["llama.cpp"] = []
        for r in range(args.rounds):
            for engine in runs:
                if engine == "llama.cpp":
                    runs[engine].append(llama_cpp(args))
                else:
                    python = sys.executable if engine.startswith(MINE) else args.vllm_python
                    runs[engine].append(run_worker(engine, python, args, threads))
                print(f"[bench_cpu_peers] {threads} thread(s), round {r + 1}: {engine} done", flush=True)
        results = {e: best_of(v) for e, v in runs.items()}
        report["threads"][threads] = results
        texts.append(table(threads, results, args) + "\n" + "\n".join(agreement(results)))
        print(texts[-1], flush=True)
    report["tables"] = texts
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    print("\n\n".join(texts))
    return report


if __name__ == "__main__":
    main()
