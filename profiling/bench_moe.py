"""MoE decode beside transformers on a tiny-but-wide mixture-of-experts model, and the MoE layers' share of a step.

One run, one process, the same model, dtype, device and thread count for both sides:

* the model: a random checkpoint of `--family` (qwen3_moe, mixtral, gpt_oss) built locally with
  transformers' `save_pretrained` (cached under $GRAPHDECODE_CACHE, no download). "Wide": many
  experts and a real hidden size (1024, 16 heads : 4 KV heads of 64) but 4 layers and an 8k
  vocabulary, so the experts are most of the weights and of a step's work (qwen3_moe: 64
  experts top-8 of 256; mixtral: 32 experts top-4 of 512; gpt_oss: 32 experts top-4 of 512,
  sliding window 128, YaRN). `--tiny`: a minimal preset for smoke tests; `--model DIR` any
  MoE checkpoint instead;
* decode tokens/s at each batch: B prompts of `--prompt-len` random tokens, `--new-tokens`
  greedy tokens with ignore_eos; decode = full run - prefill-only run (graphdecode.bench.sweep's
  measure_engine_point), best of `--repeats`; transformers: batched greedy `generate` with
  `min_new_tokens=max_new_tokens` (it cannot stop early) and a static cache (`--hf-cache`),
  timed the same way (full - `max_new_tokens=1`). ratio = graphdecode / transformers (> 1:
  graphdecode is faster);
* the MoE layers' share of a decode step: one more decode run per point with a forward
  pre/post hook pair on every MoE module (graphdecode's SparseMoE, transformers' `mlp` of each
  sparse layer) adding up perf_counter time; graphdecode counts only inside decode windows
  (`windows.run`: k steps of forward + sampling each), transformers only in one-token
  forwards, against the time from the end of the prefill forward to generate's return. On
  CUDA each hook synchronises, and graphdecode's share comes from an eager twin engine (no
  CUDA graphs, no torch.compile: hooks do not fire inside a graph), so it is an eager share;
* `--moe-impl grouped|reference|dense` sets `experts.implementation` on every MoE layer;
  `--compare-impls` runs grouped and reference (or `--impls A,B,...`) in one run. On an eager
  engine (the CPU default) the implementation is switched in place; a compiled or
  graph-captured engine is built once per implementation (the capture bakes it in).

    python profiling/bench_moe.py                                    # qwen3_moe wide, CPU fp32, batches 1,16,64
    python profiling/bench_moe.py --family gpt_oss --dtype bfloat16 --compare-impls --threads 4
    python profiling/bench_moe.py --tiny --batches 1,2 --new-tokens 2 --repeats 1   # smoke

Prints a table and writes `--json PATH` (default profiling/out/bench_moe.json) with every
number and the model's config.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import time

import torch

from graphdecode.bench.common import (
    add_compile_arg,
    compile_option,
    cuda_sync,
    machine_info,
    random_prompt_ids,
    write_json,
)

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
IMPLS = ("grouped", "reference", "dense")
ATTENTION = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
             "head_dim": 64, "vocab_size": 8192}
TINY_ATTENTION = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "vocab_size": 512}
COMMON = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
          "initializer_range": 0.02}
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}
# family -> (wide, tiny): the config.json fields beyond ATTENTION / TINY_ATTENTION and COMMON
PRESETS = {
    "qwen3_moe": (
        {"num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 256, "intermediate_size": 1024,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 4096},
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 64,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 512},
    ),
    "mixtral": (
        {"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 512, "sliding_window": None,
         "max_position_embeddings": 4096},
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": None,
         "max_position_embeddings": 512},
    ),
    "gpt_oss": (
        {"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 512, "sliding_window": 128,
         "rope_parameters": YARN, "max_position_embeddings": 131072},
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 16,
         "rope_parameters": YARN, "max_position_embeddings": 131072},
    ),
}


# ------------------------------------------------------------------ the model
def preset_fields(family: str, tiny: bool) -> dict:
    wide, small = PRESETS[family]
    return {**(TINY_ATTENTION if tiny else ATTENTION), **COMMON, **(small if tiny else wide)}


def ensure_moe_preset(family: str, tiny: bool) -> str:
    """The preset's directory in the graphdecode cache, built (random weights, seed 0) on first use;
    its name carries a hash of the fields, so a changed preset is a new directory."""
    from transformers import AutoConfig

    from graphdecode.cache import cached_model_dir
    from graphdecode.default_model import save_random_model

    fields = preset_fields(family, tiny)
    digest = hashlib.sha1(json.dumps([family, fields], sort_keys=True).encode()).hexdigest()[:8]
    name = f"bench-moe-{family}-{'tiny' if tiny else 'wide'}-{digest}"

    def build(path: str) -> None:
        save_random_model(path, AutoConfig.for_model(family, **fields), seed=0)

    return cached_model_dir(name, build)


def moe_summary(model_dir: str) -> dict:
    """What the table's header names: family, sizes, experts (graphdecode's parsed config)."""
    from graphdecode.models.model_config import load_model_config

    cfg = load_model_config(model_dir)
    moe = cfg.moe
    if moe is None:
        raise SystemExit(f"{model_dir}: not a mixture-of-experts model")
    return {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "num_heads": cfg.num_heads,
            "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "num_experts": moe.num_experts, "top_k": moe.top_k, "expert_intermediate_size": moe.intermediate_size,
            "sparse_layers": sum(moe.is_sparse(i) for i in range(cfg.num_layers)),
            "sliding_window": cfg.sliding_window}


# ------------------------------------------------------------------ hook timing
class HookTimer:
    """perf_counter seconds spent inside `modules`' forwards while `active` (one at a time: they do not nest).
    On CUDA each boundary synchronises, so the time is the device's (and a step's is eager)."""

    def __init__(self, modules, device: torch.device):
        self.device = device
        self.active = False
        self.seconds = 0.0
        self.calls = 0
        self._start = 0.0
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))

    def now(self) -> float:
        cuda_sync(self.device)
        return time.perf_counter()

    def _pre(self, module, args) -> None:
        if self.active:
            self._start = self.now()

    def _post(self, module, args, output) -> None:
        if self.active:
            self.seconds += self.now() - self._start
            self.calls += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def engine_moe_layers(llm) -> list:
    return [layer.mlp for layer in llm.engine.runner.model.model.layers if layer.sparse]


def set_engine_impl(llm, impl: str) -> None:
    for moe in engine_moe_layers(llm):
        moe.experts.implementation = impl


def engine_moe_share(llm, prompts, new_tokens: int) -> dict:
    """One decode run with the MoE layers hooked: their time inside decode windows over the windows' time."""
    from graphdecode import SamplingParams

    device = llm.config.torch_device
    runner = llm.engine.runner
    windows = runner.windows
    timer = HookTimer(engine_moe_layers(llm), device)
    run = windows.run
    totals = {"window_s": 0.0, "windows": 0}

    def timed_run(*args, **kwargs):
        start = timer.now()
        timer.active = True
        try:
            return run(*args, **kwargs)
        finally:
            timer.active = False
            totals["window_s"] += timer.now() - start
            totals["windows"] += 1

    windows.run = timed_run  # an instance attribute over the method, deleted again below
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    finally:
        del windows.run
        timer.close()
    steps = totals["windows"] * llm.config.num_decode_steps
    window_s = totals["window_s"]
    return {"moe_s": timer.seconds, "step_s": window_s / max(steps, 1), "moe_s_per_step": timer.seconds / max(steps, 1),
            "share": timer.seconds / window_s if window_s > 0 else None, "window_s": window_s,
            "windows": totals["windows"], "steps": steps, "moe_calls": timer.calls}


def hf_moe_layers(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def hf_moe_share(model, ids, new_tokens: int, cache: str | None) -> dict:
    """One generate with the sparse blocks hooked: their time in one-token forwards over the decode
    time (end of the prefill forward to generate's return: every decode step with its sampling)."""
    device = ids.device
    timer = HookTimer(hf_moe_layers(model), device)
    marks = {"prefill_end": None}

    def pre(module, args, kwargs):
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        tokens = args[0] if tokens is None and args else tokens
        timer.active = tokens is not None and tokens.shape[1] == 1

    def post(module, args, kwargs, output):
        if not timer.active:
            marks["prefill_end"] = timer.now()
        timer.active = False

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    try:
        hf_generate(model, ids, new_tokens, cache)
        end = timer.now()
    finally:
        for handle in handles:
            handle.remove()
        timer.close()
    decode_s = end - marks["prefill_end"]
    steps = new_tokens - 1
    return {"moe_s": timer.seconds, "step_s": decode_s / max(steps, 1), "moe_s_per_step": timer.seconds / max(steps, 1),
            "share": timer.seconds / decode_s if decode_s > 0 else None, "decode_s": decode_s, "steps": steps,
            "moe_calls": timer.calls}


# ------------------------------------------------------------------ the two sides
def _best(fn, repeats: int, device: torch.device):
    best, result = float("inf"), None
    for _ in range(repeats):
        cuda_sync(device)
        start = time.perf_counter()
        out = fn()
        cuda_sync(device)
        elapsed = time.perf_counter() - start
        if elapsed < best:
            best, result = elapsed, out
    return best, result


def hf_generate(model, ids, new_tokens: int, cache: str | None):
    extra = {} if cache is None else {"cache_implementation": cache}
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, disable_compile=True,
                              **extra)


def hf_point(model, batch: int, args, device: torch.device) -> dict:
    cache = None if args.hf_cache == "dynamic" else args.hf_cache
    ids = torch.tensor(random_prompt_ids(batch, args.prompt_len, model.config.vocab_size), device=device)
    hf_generate(model, ids, 2, cache)  # warm-up
    prefill_s, _ = _best(lambda: hf_generate(model, ids, 1, cache), args.repeats, device)
    total_s, out = _best(lambda: hf_generate(model, ids, args.new_tokens, cache), args.repeats, device)
    decode_s = max(total_s - prefill_s, 1e-9)
    steps = args.new_tokens - 1
    return {"decode_tokens_per_s": batch * steps / decode_s, "tokens_per_s": batch * args.new_tokens / total_s,
            "ms_per_decode_step": 1000 * decode_s / max(steps, 1), "prefill_s": prefill_s, "decode_s": decode_s,
            "total_s": total_s, "output_ids": out[:, args.prompt_len:].tolist(),
            "moe": hf_moe_share(model, ids, args.new_tokens, cache)}


def engine_point(llm, share_llm, batch: int, args, device: torch.device) -> dict:
    from graphdecode.bench.sweep import measure_engine_point

    p = measure_engine_point(llm, batch, llm.config.num_decode_steps, args.prompt_len, args.new_tokens,
                             args.repeats, device)
    point = {k: p[k] for k in ("decode_tokens_per_s", "tokens_per_s", "ms_per_decode_step", "prefill_s", "decode_s",
                               "total_s", "windows", "device_steps", "output_ids")}
    vocab = llm.config.model_config.vocab_size
    prompts = [{"prompt_token_ids": ids} for ids in random_prompt_ids(batch, args.prompt_len, vocab)]
    point["moe"] = engine_moe_share(share_llm, prompts, args.new_tokens)
    point["moe"]["engine"] = "same" if share_llm is llm else "eager twin"
    return point


@contextlib.contextmanager
def built_with_impl(impl: str):
    """Engines built inside take `impl` as their MoE layers' implementation at load (post_load), so a
    CUDA graph or a compiled window captures that one."""
    from graphdecode.models import decoder

    default = decoder.default_implementation
    decoder.default_implementation = lambda device, dtype: impl
    try:
        yield
    finally:
        decoder.default_implementation = default


def free(*engines) -> None:
    for llm in engines:
        if llm is not None:
            llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="the preset's model family")
    p.add_argument("--tiny", action="store_true", help="a minimal preset (smoke tests)")
    p.add_argument("--model", default=None, help="an MoE HuggingFace model directory instead of the preset")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="both sides (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32, help="generated tokens per row (>= 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point; the fastest kept")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, both sides")
    p.add_argument("-k", "--num-decode-steps", type=int, default=8, help="graphdecode decode steps per window")
    p.add_argument("--moe-impl", choices=IMPLS, default="grouped", help="graphdecode's expert implementation")
    p.add_argument("--compare-impls", action="store_true", help="graphdecode with grouped and reference, one run")
    p.add_argument("--impls", default=None, help="implementations to run side by side (implies --compare-impls; default grouped,reference)")
    p.add_argument("--hf-cache", choices=("static", "dynamic"), default="static", help="transformers' KV cache")
    p.add_argument("--hf-experts", default=None,
                   help="transformers' experts_implementation (default: its own, grouped_mm where torch has it)")
    p.add_argument("--skip-hf", action="store_true", help="graphdecode only")
    add_compile_arg(p)
    p.add_argument("--json", default="profiling/out/bench_moe.json", help="where the JSON record goes")
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (one prefill token, then decode)")
    if args.compare_impls or args.impls:
        args.impl_list = (args.impls or "grouped,reference").split(",")
    else:
        args.impl_list = [args.moe_impl]
    for impl in args.impl_list:
        if impl not in IMPLS:
            p.error(f"unknown implementation {impl!r} (choose from {', '.join(IMPLS)})")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    batches = sorted({int(b) for b in args.batches.split(",")})
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, device, dtype, batches)
    finally:
        torch.set_num_threads(threads)


def _run(args, device: torch.device, dtype: str, batches: list[int]) -> dict:
    from graphdecode import LLM

    if args.model is not None:
        model_dir, name = args.model, os.path.basename(os.path.normpath(args.model))
    else:
        start = time.perf_counter()
        model_dir = ensure_moe_preset(args.family, args.tiny)
        name = f"{args.family} {'tiny' if args.tiny else 'wide'}"
        print(f"[bench_moe] preset {name}: {model_dir} ({time.perf_counter() - start:.1f} s)", flush=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    summary = moe_summary(model_dir)
    engine_args = {"device": str(device), "dtype": dtype, "buckets": batches, "num_decode_steps": args.num_decode_steps,
                   "max_model_len": args.prompt_len + args.new_tokens + args.num_decode_steps,
                   "enable_prefix_caching": False, "cpu_threads": args.threads, **compile_option(args)}
    eager_args = {**engine_args, "compile": False, "cuda_graphs": False}

    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        extra = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), **extra).to(device).eval()
        hf_impl = getattr(hf.config, "_experts_implementation", None)

    result = {
        "bench": "moe", "model": name, "model_dir": model_dir, "family": hf_config.get("model_type"),
        "preset": None if args.model else ("tiny" if args.tiny else "wide"), "summary": summary,
        "config": hf_config, "machine": machine_info(device, args.threads), "dtype": dtype,
        "args": {k: v for k, v in vars(args).items() if k != "impl_list"}, "impls": args.impl_list,
        "transformers": None if hf is None else {"experts_implementation": hf_impl, "cache": args.hf_cache,
                                                 "moe_layers": len(hf_moe_layers(hf))},
        "engine": {}, "points": [],
    }
    points = {b: {"batch": b, "graphdecode": {}, "transformers": None, "ratio": {}} for b in batches}
    result["points"] = list(points.values())

    llm = share_llm = None
    for i, impl in enumerate(args.impl_list):
        build_s = None  # None: the eager engine of the previous implementation, switched in place
        if llm is None or llm.config.compile or llm.config.cuda_graphs:
            old, llm = llm, None
            if old is not None and old is not share_llm:
                free(old)
            del old
            # the reference loop syncs with the host, which a CUDA graph cannot capture
            build_args = eager_args if impl == "reference" and device.type == "cuda" else engine_args
            with built_with_impl(impl):
                start = time.perf_counter()
                llm = LLM(model_dir, **build_args)
                build_s = time.perf_counter() - start
            if share_llm is None:
                eager = not (llm.config.compile or llm.config.cuda_graphs)
                share_llm = llm if eager else LLM(model_dir, **eager_args)
        set_engine_impl(llm, impl)
        set_engine_impl(share_llm, impl)
        result["engine"][impl] = {"build_seconds": build_s, "compile": llm.config.compile,
                                  "cuda_graphs": llm.config.cuda_graphs, "moe_layers": len(engine_moe_layers(llm)),
                                  "attention_backend": llm.config.attention_backend,
                                  "num_decode_steps": llm.config.num_decode_steps}
        for batch in batches:
            point = engine_point(llm, share_llm, batch, args, device)
            points[batch]["graphdecode"][impl] = point
            print(f"[bench_moe] graphdecode {impl} batch {batch}: {point['decode_tokens_per_s']:.1f} decode tok/s, "
                  f"MoE {100 * point['moe']['share']:.0f}% of a step", flush=True)
            if hf is not None and i == 0:  # transformers beside the first implementation, batch by batch
                theirs = points[batch]["transformers"] = hf_point(hf, batch, args, device)
                print(f"[bench_moe] transformers batch {batch}: {theirs['decode_tokens_per_s']:.1f} decode tok/s, "
                      f"MoE {100 * theirs['moe']['share']:.0f}% of a step", flush=True)
            write_json(args.json, result)
    free(llm, share_llm if share_llm is not llm else None)

    for point in points.values():
        theirs = point["transformers"]
        for impl, mine in point["graphdecode"].items():
            if theirs is not None:
                point["ratio"][impl] = mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
                mine["same_rows_as_transformers"] = sum(a == b for a, b in zip(mine["output_ids"],
                                                                               theirs["output_ids"]))
            first = point["graphdecode"][args.impl_list[0]]
            mine["same_rows_as_first_impl"] = sum(a == b for a, b in zip(mine["output_ids"], first["output_ids"]))
    write_json(args.json, result)
    print(format_table(result))
    print(f"(wrote {args.json})")
    return result


def format_table(result: dict) -> str:
    s, m, args = result["summary"], result["machine"], result["args"]
    lines = [f"{result['model']}: hidden {s['hidden_size']}, {s['num_layers']} layers ({s['sparse_layers']} MoE), "
             f"{s['num_experts']} experts top-{s['top_k']} of {s['expert_intermediate_size']}, "
             f"{s['num_heads']}:{s['num_kv_heads']} heads of {s['head_dim']}, vocab {s['vocab_size']}",
             f"{result['dtype']} on {m['device']}, {m['torch_threads']} thread(s), k={args['num_decode_steps']}, "
             f"prompt {args['prompt_len']}, {args['new_tokens']} new tokens, best of {args['repeats']}; "
             f"{m['date']} {m['git_commit']}"]
    if result["transformers"] is not None:
        t = result["transformers"]
        lines.append(f"transformers: experts {t['experts_implementation']}, {t['cache']} cache, eager generate")
    lines.append(f"{'':>5}  {'':<24} {'':>12} {'':>8} {'hooked run, ms/step':^21}")
    lines.append(f"{'batch':>5}  {'side':<24} {'decode tok/s':>12} {'ms/step':>8} {'step':>7} {'MoE':>7} "
                 f"{'share':>5} {'vs HF':>6}  same rows")
    for point in result["points"]:
        b, theirs = point["batch"], point["transformers"]
        for impl, mine in point["graphdecode"].items():
            ratio = point["ratio"].get(impl)
            same = mine.get("same_rows_as_transformers")
            lines.append(f"{b:>5}  {'graphdecode ' + impl:<24} {mine['decode_tokens_per_s']:>12.1f} "
                         f"{mine['ms_per_decode_step']:>8.2f} {_moe_cells(mine['moe'])} "
                         + (f"{ratio:>5.2f}x  {same}/{b}" if ratio is not None else f"{'-':>6}"))
        if theirs is not None:
            lines.append(f"{b:>5}  {'transformers':<24} {theirs['decode_tokens_per_s']:>12.1f} "
                         f"{theirs['ms_per_decode_step']:>8.2f} {_moe_cells(theirs['moe'])}")
    engine = next(iter(result["engine"].values()), {})
    lines.append("ms/step: decode time over the steps run (graphdecode: windows x k, the last window's overrun "
                 "included); vs HF: decode tok/s over transformers'")
    lines.append("hooked run: one more decode run timing the MoE layers' forwards (share: MoE / decode time)"
                 + ("; graphdecode's on an eager twin engine" if engine.get("cuda_graphs") or engine.get("compile")
                    else "") + ("; synchronised hooks (CUDA)" if result["machine"]["device"].startswith("cuda")
                                else ""))
    return "\n".join(lines)


def _moe_cells(moe: dict) -> str:
    return f"{1000 * moe['step_s']:>7.2f} {1000 * moe['moe_s_per_step']:>7.2f} {100 * moe['share']:>4.0f}%"


if __name__ == "__main__":
    main()
