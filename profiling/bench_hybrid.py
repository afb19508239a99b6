"""A hybrid model's decode beside transformers, and its decode cost per token as the context grows.

One process, the same model, dtype and threads for both sides:

* the model: a Qwen3.5-shaped random checkpoint (`--preset small`: Qwen3.5-0.8B's layout, three Gated
  DeltaNet layers per gated attention layer, scaled to what a 2-core CPU runs: hidden 512, 8 layers, 8
  attention heads : 2 KV heads of 64, linear heads 8 : 8 of 64, a 16k vocabulary; `tiny` for smoke runs),
  built with transformers' save_pretrained into the graphdecode cache (no download);
* decode tokens/s at each batch: B prompts of `--prompt-len` random tokens, `--new-tokens` greedy tokens
  (graphdecode.bench.sweep's point: decode = full run - prefill-only run, best of `--repeats`, the
  transformers side measured between graphdecode's repeats); transformers: batched greedy `generate`
  (its torch fallbacks for the delta rule and the convolution: what runs without fla / causal-conv1d), timed
  the same way. Rows whose tokens equal transformers' are counted;
* decode cost per token at `--contexts` (default 1k and 8k), batch 1, graphdecode only, for the hybrid and
  for a dense model of the same sizes (every layer attention: Qwen3 with the same heads), so the flat
  per-token cost of the recurrent layers shows beside attention's growth.

    python profiling/bench_hybrid.py --threads 2
    python profiling/bench_hybrid.py --preset tiny --batches 1,2 --contexts 64,128 --new-tokens 8 --repeats 1

Prints tables and writes `--json` (default profiling/out/bench_hybrid.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch

from graphdecode.bench.common import machine_info, random_prompt_ids, script_module, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
moe = script_module(os.path.join(HERE, "bench_moe.py"))

PRESETS = {
    "small": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 8, "linear_num_value_heads": 8,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64, "vocab_size": 16384},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
             "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 512},
}
COMMON = {"bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "initializer_range": 0.02,
          "max_position_embeddings": 16384, "linear_conv_kernel_dim": 4}
DENSE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size")


def ensure_model(preset: str, dense: bool) -> str:
    """The preset (hybrid Qwen3.5, or its dense Qwen3 contrast) in the graphdecode cache, built on first use."""
    import transformers

    from graphdecode.cache import cached_model_dir
    from graphdecode.default_model import save_random_model

    fields = dict(PRESETS[preset], **COMMON)
    if dense:
        fields = {k: fields[k] for k in (*DENSE_KEYS, "bos_token_id", "eos_token_id", "tie_word_embeddings",
                                         "initializer_range", "max_position_embeddings")}
    digest = hashlib.sha1(json.dumps([dense, fields], sort_keys=True).encode()).hexdigest()[:8]
    kind = "qwen3-dense" if dense else "qwen3_5"

    def build(path: str) -> None:
        config_cls = transformers.Qwen3Config if dense else transformers.Qwen3_5TextConfig
        save_random_model(path, config_cls(**fields), seed=0)

    return cached_model_dir(f"bench-hybrid-{kind}-{preset}-{digest}", build)


def hf_generate(model, ids, new_tokens: int):
    """bench_moe.py's batched greedy generate (exactly new_tokens tokens), with transformers' default cache."""
    return moe.hf_generate(model, ids, new_tokens, None)


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def decode_point(llm, model, batch: int, args) -> dict:
    """graphdecode's and transformers' decode tokens/s at one batch, repeats interleaved."""
    from graphdecode.bench.sweep import measure_engine_point

    vocab = llm.config.model_config.vocab_size
    ids = torch.tensor(random_prompt_ids(batch, args.prompt_len, vocab))
    hf_generate(model, ids, 2)  # warm-up
    hf = {"prefill": [], "full": []}

    def transformers_turn():
        hf["prefill"].append(_timed(lambda: hf_generate(model, ids, 1))[0])
        hf["full"].append(_timed(lambda: hf_generate(model, ids, args.new_tokens)))

    ours = measure_engine_point(llm, batch, llm.config.num_decode_steps, args.prompt_len, args.new_tokens,
                                args.repeats, torch.device("cpu"), between=transformers_turn)
    total, out = min(hf["full"], key=lambda r: r[0])
    hf_decode = max(total - min(hf["prefill"]), 1e-9)
    hf_tokens = out[:, args.prompt_len:].tolist()
    same = sum(a == b for a, b in zip(ours["output_ids"], hf_tokens))
    hf_tps = batch * (args.new_tokens - 1) / hf_decode
    return {"batch": batch, "graphdecode_decode_tokens_per_s": ours["decode_tokens_per_s"],
            "transformers_decode_tokens_per_s": hf_tps, "ratio": ours["decode_tokens_per_s"] / hf_tps,
            "rows_equal": same, "rows": batch}


def context_point(llm, context: int, args) -> dict:
    """ms per decoded token at batch 1 after a prompt of `context` tokens (full - prefill-only)."""
    from graphdecode import SamplingParams

    vocab = llm.config.model_config.vocab_size
    prompt = [{"prompt_token_ids": random_prompt_ids(1, context, vocab, seed=context)[0]}]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate(prompt, SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
    prefill = min(_timed(lambda: llm.generate(prompt, SamplingParams(max_tokens=1, **greedy), use_tqdm=False))[0]
                  for _ in range(args.repeats))
    full = min(_timed(lambda: llm.generate(prompt, SamplingParams(max_tokens=args.new_tokens, **greedy),
                                           use_tqdm=False))[0] for _ in range(args.repeats))
    return {"context": context, "ms_per_token": 1000 * max(full - prefill, 1e-9) / (args.new_tokens - 1)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="profiling/out/bench_hybrid.json")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> dict:
    from transformers import AutoModelForCausalLM

    from graphdecode import LLM

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = getattr(torch, args.dtype)
    hybrid = ensure_model(args.preset, dense=False)
    result = {"machine": machine_info(torch.device("cpu"), args.threads), "preset": args.preset,
              "fields": PRESETS[args.preset], "args": vars(args), "decode": [], "context": {}}
    model = AutoModelForCausalLM.from_pretrained(hybrid, dtype=dtype).eval()
    engine = dict(dtype=args.dtype, cpu_threads=args.threads, max_batch_size=max(batches),
                  max_model_len=max(contexts) + args.new_tokens + 16, enable_prefix_caching=False)
    with LLM(hybrid, **engine) as llm:
        for batch in batches:
            result["decode"].append(decode_point(llm, model, batch, args))
            print(json.dumps(result["decode"][-1]), flush=True)
        del model
        result["context"]["hybrid"] = [context_point(llm, c, args) for c in contexts]
    with LLM(ensure_model(args.preset, dense=True), **engine) as llm:
        result["context"]["dense"] = [context_point(llm, c, args) for c in contexts]
    write_json(args.json, result)
    print(format_table(result))
    return result


def format_table(result: dict) -> str:
    lines = ["| batch | graphdecode tok/s | transformers tok/s | ratio | rows equal |", "|---|---|---|---|---|"]
    for p in result["decode"]:
        lines.append(f"| {p['batch']} | {p['graphdecode_decode_tokens_per_s']:.1f} | "
                     f"{p['transformers_decode_tokens_per_s']:.1f} | {p['ratio']:.2f}x | "
                     f"{p['rows_equal']}/{p['rows']} |")
    contexts = [p["context"] for p in result["context"]["hybrid"]]
    lines += ["", "| ms per decoded token, batch 1 | " + " | ".join(f"{c} context" for c in contexts)
              + " | last / first |", "|---" * (len(contexts) + 2) + "|"]
    for kind in ("hybrid", "dense"):
        ms = [p["ms_per_token"] for p in result["context"][kind]]
        lines.append(f"| {kind} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {ms[-1] / ms[0]:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
