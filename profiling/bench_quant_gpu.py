"""Quantized decode on the GPU: int4 (tinygemm) and FP8 (scaled_mm) linears, and an FP8 KV cache, in the window's
CUDA graphs beside the bf16 engine on the same model, tokens/s side by side (issue 34's GPU benchmark; gpu_check's
bench_quant stage).

The `llama-3.2-1b` preset (random bf16 weights, built on the device) is written by graphdecode's round-to-nearest
writer (graphdecode/models/quant/rtn.py) as compressed-tensors pack-quantized int4 (groups of 128) and
float-quantized FP8 (one scale per row, activations scaled per token), the quantization run on the device.
Each engine decodes random prompts at each batch with CUDA graphs; decode tokens/s = batch * (gen_len - 1) /
(full run - prefill-only run), best of `--repeats`. Token agreement with bf16 is printed for the record only:
random weights have no margin (tests/gpu/test_gpu_quantized.py checks tokens on a wide-margin model).

    python profiling/bench_quant_gpu.py --out $OUT/bench_quant_gpu
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMATS = {"bf16": None, "int4": ("pack-quantized", 4, 128, True), "fp8": ("float-quantized", 8, None, True),
           "kv-fp8": None}  # kv-fp8: the bf16 weights with kv_cache_dtype="fp8"


def decode_rate(llm, batch: int, prompt_len: int, gen_len: int, vocab: int, repeats: int):
    from graphdecode import SamplingParams

    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(batch)]

    def run(tokens: int):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    run(2)
    best_prefill = best_full = float("inf")
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(1)
        best_prefill = min(best_prefill, time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = run(gen_len)
        best_full = min(best_full, time.perf_counter() - t0)
    return batch * (gen_len - 1) / max(best_full - best_prefill, 1e-9), out


def main(argv=None) -> dict:
    import torch

    from graphdecode import LLM
    from graphdecode.bench.presets import ensure_preset
    from graphdecode.models.quant.rtn import quantize_checkpoint

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-3.2-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--formats", default="bf16,int4,fp8")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention", default="torch", help="attention backend (the same for every format)")
    ap.add_argument("--work", default=os.path.join("/tmp", "bench_quant_gpu"))
    ap.add_argument("--out", default="profiling/out/bench_quant_gpu")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    src = ensure_preset(args.preset, args.device)
    report = {"args": vars(args), "formats": {}}
    reference = None
    for name in args.formats.split(","):
        path = src
        t0 = time.perf_counter()
        if FORMATS[name] is not None:
            path = os.path.join(args.work, f"{args.preset}-{name}")
            if not os.path.isfile(os.path.join(path, "config.json")):
                quantize_checkpoint(src, path, *FORMATS[name], device=args.device)
        written = time.perf_counter() - t0
        llm = LLM(path, device=args.device, dtype="bfloat16", cuda_graphs=args.device == "cuda", compile=False,
                  attention_backend=args.attention, num_decode_steps=8, max_batch_size=max(batches),
                  max_model_len=args.prompt_len + args.gen_len + 16, enable_prefix_caching=False,
                  kv_cache_dtype="fp8" if name == "kv-fp8" else "auto")
        kernel = getattr(llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.packed, "kernel", "bf16")
        if name == "kv-fp8":  # FlashInfer's FP8-KV module, or the torch reference where the kit lacks it
            backend = llm.engine.runner.backend
            kernel = "fp8 KV, " + ("torch reference" if getattr(backend, "reference", None) is not None
                                   else backend.name)
        vocab = llm.config.model_config.vocab_size
        points, first = [], None
        for batch in batches:
            rate, tokens = decode_rate(llm, batch, args.prompt_len, args.gen_len, vocab, args.repeats)
            first = first or tokens
            points.append({"batch": batch, "decode_tokens_per_s": rate})
            print(f"[bench_quant_gpu] {name} ({kernel}) batch {batch}: {rate:.0f} decode tok/s", flush=True)
        if reference is None:
            reference = first
        same = sum(a == b for a, b in zip(first, reference))
        report["formats"][name] = {"kernel": kernel, "written_s": written, "decode": points,
                                   "same_tokens_as_first_format_batch1": same}
        del llm
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    base = report["formats"].get("bf16")
    lines = ["| format | kernel | " + " | ".join(f"b{b} tok/s" for b in batches) + " | vs bf16 |",
             "|---" * (3 + len(batches)) + "|"]
    for name, e in report["formats"].items():
        rates = [p["decode_tokens_per_s"] for p in e["decode"]]
        vs = " / ".join(f"{r / b['decode_tokens_per_s']:.2f}x" for r, b in zip(rates, base["decode"])) if base else "-"
        lines.append(f"| {name} | {e['kernel']} | " + " | ".join(f"{r:.0f}" for r in rates) + f" | {vs} |")
    report["table"] = "\n".join(lines)
    print(report["table"], flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
