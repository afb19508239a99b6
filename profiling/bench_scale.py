"""Scheduler scale: does throughput hold when 10x more prompts are queued at once?

The offline case from vLLM PR #6865 (seeds/003): N prompts of 16 tokens, 16 output
tokens each (ignore_eos, temperature 1.0), all handed to one `llm.generate()` call,
on a micro model so engine overhead dominates. vLLM main at the time: 577 req/s at
10k and 211 req/s at 100k (ratio 0.37). The goal here is a 100k/10k ratio >= 0.95.

The timed region is the whole `generate()` call: tokenization (text prompts, the
default), validation, request setup, every step, and output collection. The engine's
`step` is wrapped (no engine change) to record each step's duration with the waiting
and running counts, which splits the wall time into setup / steps / collection and
shows whether per-step cost grows with the queue.

    python profiling/bench_scale.py --num-prompts 10000,100000,500000
    python profiling/bench_scale.py --num-prompts 100000 --profile /tmp/scale.prof   # cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time

import torch

from graphdecode import LLM, SamplingParams
from graphdecode.bench.common import machine_info, resolve_model, rss_bytes, write_json
from graphdecode.host.gc_heap import freeze_startup_heap


def one_token_words(tokenizer) -> list[str]:
    """Vocabulary entries ' word' that encode to exactly one token on their own.

    The byte-level pre-tokenizer splits text at spaces and encodes each piece alone,
    so a text made of k such words encodes to exactly k tokens (+ BOS).
    """
    words = []
    for token_id in range(len(tokenizer)):
        piece = tokenizer.decode([token_id])
        is_word = len(piece) > 1 and piece[0] == " " and piece[1:].isalpha()
        if is_word and tokenizer(piece, add_special_tokens=False)["input_ids"] == [token_id]:
            words.append(piece)
    return words


def make_prompts(llm, count: int, length: int, kind: str, seed: int = 0) -> list:
    rng = random.Random(seed)
    vocab = llm.config.model_config.vocab_size
    if kind == "ids" or llm.tokenizer is None:
        return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(count)]
    words = one_token_words(llm.tokenizer)
    special = len(llm.tokenizer("x")["input_ids"]) - len(llm.tokenizer("x", add_special_tokens=False)["input_ids"])
    n_words = length - special
    return ["".join(rng.choice(words) for _ in range(n_words)) for _ in range(count)]


class StepRecorder:
    """Wraps engine.step (instance attribute): per-step duration, waiting and running counts."""

    def __init__(self, engine):
        self.engine = engine
        self.inner = engine.step
        self.starts: list[float] = []
        self.durations: list[float] = []
        self.waiting: list[int] = []
        self.running: list[int] = []
        engine.step = self

    def __call__(self):
        sched = self.engine.scheduler
        self.waiting.append(len(sched.waiting))
        self.running.append(len(sched.running))
        start = time.perf_counter()
        out = self.inner()
        self.starts.append(start)
        self.durations.append(time.perf_counter() - start)
        return out

    def detach(self) -> None:
        del self.engine.step


class GcTimer:
    """Time spent in the cyclic garbage collector, by generation (gc.callbacks)."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict:
        return {"seconds_by_generation": self.seconds, "collections_by_generation": self.counts}


def _step_profile(rec: StepRecorder) -> dict:
    """Mean step ms by tenth of the run and by waiting-queue size: growth shows up here."""
    d = rec.durations
    n = len(d)
    tenths = [1000 * sum(d[i * n // 10:(i + 1) * n // 10]) / max(len(d[i * n // 10:(i + 1) * n // 10]), 1)
              for i in range(10)] if n >= 10 else []
    full = [1000 * t for t, r in zip(d, rec.running) if r == max(rec.running, default=0)]
    return {
        "num_steps": n,
        "mean_step_ms": 1000 * sum(d) / max(n, 1),
        "step_ms_by_tenth": tenths,
        "mean_full_batch_step_ms": sum(full) / max(len(full), 1),
        "waiting_at_first_step": rec.waiting[0] if rec.waiting else 0,
    }


def run_point(llm, count: int, args, profile_path: str | None = None) -> dict:
    prompts = make_prompts(llm, count, args.prompt_len, args.prompts)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)
    gc.collect()
    rss_before = rss_bytes()
    rec = StepRecorder(llm.engine)
    before = llm.stats()
    profiler = cProfile.Profile() if profile_path else None
    if args.gc == "off":
        gc.disable()
    with GcTimer() as gc_timer:
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        outs = llm.generate(prompts, params)
        if profiler:
            profiler.disable()
        elapsed = time.perf_counter() - start
    gc.enable()
    rec.detach()
    after = llm.stats()
    rss_after = rss_bytes()
    if profiler:
        profiler.dump_stats(profile_path)
        pstats.Stats(profile_path).sort_stats("cumulative").print_stats(25)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    first, last = rec.starts[0], rec.starts[-1] + rec.durations[-1]
    del outs, prompts
    return {
        "num_prompts": count,
        "elapsed_s": elapsed,
        "requests_per_s": count / elapsed,
        "tokens_per_s": (prompt_tokens + out_tokens) / elapsed,
        "output_tokens_per_s": out_tokens / elapsed,
        "mean_prompt_tokens": prompt_tokens / count,
        "mean_output_tokens": out_tokens / count,
        "setup_s": first - start,  # tokenize, validate, build requests, add
        "steps_s": sum(rec.durations),
        "collect_s": start + elapsed - last,  # final RequestOutputs
        "steps": _step_profile(rec),
        "gc": gc_timer.summary(),
        "windows": after["windows"] - before["windows"],
        "prefill_batches": after["prefill_batches"] - before["prefill_batches"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "rss_before_bytes": rss_before,
        "rss_after_bytes": rss_after,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HuggingFace model directory")
    p.add_argument("--preset", default=None, help="model preset (default: micro when --model is absent)")
    p.add_argument("--device", default=None)
    p.add_argument("--num-prompts", default="10000,100000", help="comma-separated counts, e.g. 10000,100000,500000")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prompts", choices=["text", "ids"], default="text", help="text prompts go through the tokenizer")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("-k", "--num-decode-steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1000, help="prompts run once before timing")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gc", choices=["default", "freeze", "off"], default="default",
                   help="diagnostic: gc.freeze() after warm-up, or gc.disable() around each generate()")
    p.add_argument("--repeats", type=int, default=1, help="runs per count; the fastest is kept")
    p.add_argument("--profile", default=None, help="cProfile the largest count into this file")
    p.add_argument("--out", default="profiling/out/bench_scale", help="output prefix (.json)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    preset = args.preset or (None if args.model else "micro")
    model_dir, model_name = resolve_model(args.model, preset, args.device)
    llm = LLM(model_dir, device=args.device, max_batch_size=args.max_batch_size,
              num_decode_steps=args.num_decode_steps, max_model_len=args.prompt_len + args.output_len + 1,
              cpu_threads=args.threads)
    counts = [int(x) for x in args.num_prompts.split(",") if x.strip()]
    result = {
        "bench": "scale",
        "machine": machine_info(llm.config.torch_device, args.threads),
        "model_name": model_name,
        "args": vars(args),
        "points": [],
    }
    if args.warmup:
        run_point(llm, args.warmup, args)
    if args.gc == "freeze":
        freeze_startup_heap()
    for count in counts:
        profile = args.profile if args.profile and count == max(counts) else None
        runs = [run_point(llm, count, args, profile) for _ in range(args.repeats)]
        point = min(runs, key=lambda r: r["elapsed_s"])
        point["elapsed_s_all_runs"] = [r["elapsed_s"] for r in runs]
        result["points"].append(point)
        print(f"[scale] {count:>7} prompts: {point['elapsed_s']:8.1f} s  {point['requests_per_s']:8.1f} req/s  "
              f"{point['tokens_per_s']:9.0f} tok/s  setup {point['setup_s']:.2f} s  collect {point['collect_s']:.2f} s"
              f"  step {point['steps']['mean_step_ms']:.2f} ms  gc {sum(point['gc']['seconds_by_generation']):.2f} s",
              flush=True)
        write_json(args.out + ".json", result)
    base = result["points"][0]
    result["ratios"] = {
        f"{pt['num_prompts']}/{base['num_prompts']}": pt["requests_per_s"] / base["requests_per_s"]
        for pt in result["points"][1:]
    }
    write_json(args.out + ".json", result)
    for name, ratio in result["ratios"].items():
        print(f"[scale] req/s ratio {name}: {ratio:.3f}")
    return result


if __name__ == "__main__":
    main()
