"""Quantized weights on the CPU: decode tokens/s and perplexity per format, beside float32 and bf16 and beside
llama.cpp on the same weights in its matching formats, in one run (issue 34's benchmark).

Each format is SmolLM2-135M-Instruct (default) written by graphdecode's round-to-nearest writer
(graphdecode/models/quant/rtn.py) as a real compressed-tensors checkpoint:

| name | checkpoint | activations | llama.cpp |
|---|---|---|---|
| fp32 | the float checkpoint | float32 | F32 (the given GGUF) |
| bf16 | the float checkpoint, dtype bfloat16 | bf16 | BF16 |
| int8 | pack-quantized int8, one scale per row | float32 | Q8_0 (blocks of 32) |
| int4 | pack-quantized int4, groups of 32, symmetric | float32 | Q4_0 (blocks of 32) |
| int4-awq | int4 as above, AWQ-calibrated (rtn.py's `calibration`, awq.py) | float32 | Q4_0 (blocks of 32) |
| fp8 | float-quantized FP8 E4M3, one scale per row | float32 | - |

int4-awq is the same standard checkpoint format with activation-aware scales folded into the float weights
(docs/quantization.md): calibrated on 16 sequences of the model's own sampled text
(quantize_rtn.calibration_tokens, about
4000 tokens, never TEXT below); its llama.cpp peer is the same plain Q4_0. The quantized checkpoints quantize the
LM head too (int8 per row; FP8 for fp8), written untied from the embedding, which stays float (only its rows are
read); llama.cpp's `llama-quantize` quantizes its output tensor too (Q8_0 in Q8_0, Q6_K in Q4_0).

Decode is profiling/bench_cpu_peers.py's measurement (its worker and its llama.cpp runner): 128-token random
prompts, 128 greedy tokens, decode tokens/s = batch * 127 / (full run - prefill-only run), engines alternating
round by round, each point its best round. Perplexity: graphdecode's prompt logprobs over a fixed English text
(TEXT below, about 500 tokens), exp of the mean negative log-likelihood.

    python profiling/bench_quant.py --threads 2 --llama-bin /path/to/llama.cpp/build/bin \\
        --gguf /path/to/smollm2-f32.gguf
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from graphdecode.bench.common import script_module  # noqa: E402

peers = script_module(os.path.join(HERE, "bench_cpu_peers.py"))

FORMATS = {  # name -> (dtype, rtn arguments (format, bits, group, symmetric) or None, llama.cpp type)
    "fp32": ("float32", None, "F32"),
    "bf16": ("bfloat16", None, "BF16"),
    "int8": ("float32", ("pack-quantized", 8, None, True), "Q8_0"),
    "int4": ("float32", ("pack-quantized", 4, 32, True), "Q4_0"),
    "int4-awq": ("float32", ("pack-quantized", 4, 32, True), "Q4_0"),
    "fp8": ("float32", ("float-quantized", 8, None, True), None),
}
CALIBRATED = ("int4-awq",)  # written with AWQ calibration on the model's own sampled text
# every quantized format also quantizes the LM head (int8, FP8 for fp8; untied from the embedding), as
# llama-quantize does (its output tensor: Q8_0 in Q8_0, Q6_K in Q4_0)

TEXT = """The lighthouse stood at the end of a long stone pier, and for most of the year nobody paid it much
attention. Fishermen used it to judge the weather: when the spray reached the lamp room, the boats stayed in
the harbour. Children dared each other to run along the pier at high tide, and the keeper, an old man who had
lived in the small white cottage for forty years, shouted at them from his window without ever leaving his
chair. In winter the town emptied. The hotels closed their shutters, the cafe on the front put its chairs
inside, and the only lights after dark were the streetlamps and the slow turning beam out on the water.
It was during one of those winters that the keeper fell ill. The doctor came from the next town twice a week,
and a girl from the school brought soup in a flask every afternoon. She was eleven and curious about
everything: the brass instruments on the shelves, the logbooks with their columns of numbers, the way the
keeper could tell the time from the colour of the sky. He taught her to read the barometer and to write the
readings in the book, and when he could no longer climb the stairs, she climbed them for him, counting the
steps aloud so that he could hear her from his bed. There were one hundred and twelve of them. At the top she
wiped the salt from the glass, checked that the lamp was turning, and wrote the time and the wind in the log.
Spring came late that year. When the keeper was well enough to sit by the window again, he asked to see the
logbook. He read every entry she had written, slowly, turning the pages with great care, and then he closed
the book and said nothing for a long while. The next morning he wrote a letter to the harbour authority. It
was the first letter he had written in many years, and it asked that the girl be allowed to help him in the
summer, and to learn the work properly, so that the light would not depend on one old man alone. The reply
took three weeks. It said that lighthouses were being automated along the whole coast, that a machine would
soon do what he had done, and that no new keepers would be trained. He read it twice, folded it into the
logbook, and went on teaching her anyway: the tides, the stars, the names of the ships, how to splice a rope
and how to listen to the sea. Years later, when the machine had long since taken over and the cottage had
become a small museum, visitors found the logbook in a glass case, open at a page of careful handwriting."""


def checkpoint(args, name: str) -> str:
    dtype, rtn, _ = FORMATS[name]
    if rtn is None:
        return args.model
    from graphdecode.models.quant.rtn import quantize_checkpoint

    path = os.path.join(args.work, f"{os.path.basename(os.path.normpath(args.model))}-{name}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        calibration = None
        if name in CALIBRATED:
            calibration_tokens = script_module(os.path.join(HERE, "quantize_rtn.py")).calibration_tokens

            calibration = calibration_tokens(args.model, threads=args.threads)
        quantize_checkpoint(args.model, path, *rtn, quantize_head=True, calibration=calibration)
    return path


def gguf(args, name: str) -> str | None:
    kind = FORMATS[name][2]
    if not args.llama_bin or kind is None:
        return None
    if kind == "F32":
        return args.gguf
    path = os.path.join(args.work, f"llama-{kind}.gguf")
    if not os.path.isfile(path):
        subprocess.run([os.path.join(args.llama_bin, "llama-quantize"), args.gguf, path, kind], check=True,
                       capture_output=True)
    return path


def perplexity(path: str, dtype: str, threads: int, **engine) -> float:
    """exp(mean NLL) of TEXT's tokens (its first 1000: SmolLM2 has about 500) from the prompt logprobs; engine:
    further LLM options (bench_kv_fp8.py's kv_cache_dtype)."""
    from graphdecode import LLM, SamplingParams

    with LLM(path, dtype=dtype, cpu_threads=threads, max_model_len=1024, enable_prefix_caching=False,
             **engine) as llm:
        ids = llm.get_tokenizer().encode(TEXT)[:1000]
        (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
    nll = [-out.prompt_logprobs[j][t].logprob for j, t in enumerate(ids) if j > 0]
    return math.exp(sum(nll) / len(nll))


def weight_bytes(path: str) -> int:
    from graphdecode.models.loader import checkpoint_files

    return sum(os.path.getsize(f) for f in checkpoint_files(path))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=peers.DEFAULT_MODEL, help="float HF checkpoint (SmolLM2 by default)")
    ap.add_argument("--formats", default="fp32,bf16,int8,int4,int4-awq,fp8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-bin", help="llama.cpp's build/bin (llama-batched-bench, llama-quantize); omit: none")
    ap.add_argument("--gguf", help="the float32 checkpoint as GGUF (llama.cpp's F32, quantized from it)")
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "graphdecode", "bench_quant"))
    ap.add_argument("--out", default="profiling/out/bench_quant")
    args = ap.parse_args(argv)
    if args.llama_bin and not args.gguf:
        ap.error("--gguf: llama.cpp needs the float32 checkpoint as GGUF")
    os.makedirs(args.work, exist_ok=True)
    names = args.formats.split(",")
    peer_args = argparse.Namespace(batches=[int(b) for b in args.batches.split(",")], prefill=[],
                                   prompt_len=args.prompt_len, gen_len=args.gen_len, repeats=args.repeats,
                                   threads=args.threads, dtype="float32", model=args.model, llama_bin=args.llama_bin,
                                   gguf=None)
    report = {"args": vars(args), "formats": {}}
    for name in names:
        path = checkpoint(args, name)
        report["formats"][name] = {"checkpoint": path, "bytes": weight_bytes(path),
                                   "perplexity": perplexity(path, FORMATS[name][0], args.threads),
                                   "gguf": gguf(args, name), "ours": [], "llama.cpp": []}
        print(f"[bench_quant] {name}: {report['formats'][name]['bytes'] / 1e6:.0f} MB, perplexity "
              f"{report['formats'][name]['perplexity']:.3f}", flush=True)
    for r in range(args.rounds):
        for name in names:
            entry = report["formats"][name]
            peer_args.model, peer_args.dtype = entry["checkpoint"], FORMATS[name][0]
            entry["ours"].append(peers.run_worker(peers.MINE, sys.executable, peer_args, args.threads))
            if entry["gguf"]:
                peer_args.gguf = entry["gguf"]
                entry["llama.cpp"].append(peers.llama_cpp(peer_args))
            print(f"[bench_quant] round {r + 1}: {name} done", flush=True)
    for entry in report["formats"].values():
        entry["ours"] = peers.best_of(entry["ours"])
        entry["llama.cpp"] = peers.best_of(entry["llama.cpp"]) if entry["llama.cpp"] else None
    text = table(report, peer_args.batches, args.threads)
    report["table"] = text
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    return report


def table(report: dict, batches: list[int], threads: int) -> str:
    formats = report["formats"]
    base = formats.get("fp32")
    ppl0 = base["perplexity"] if base else None
    cols = [f"b{b}" for b in batches]
    lines = [f"| {threads} threads | weights MB | perplexity | " + " | ".join(f"decode {c}" for c in cols)
             + " | vs fp32 " + " / ".join(cols) + " | llama.cpp " + " / ".join(cols) + " | ours / llama.cpp |",
             "|" + "---|" * (3 + len(cols) + 3)]
    for name, e in formats.items():
        ours = [p["tokens_per_s"] for p in e["ours"]["decode"]]
        vs = [o / b["tokens_per_s"] for o, b in zip(ours, base["ours"]["decode"])] if base else []
        theirs = [p["tokens_per_s"] for p in e["llama.cpp"]["decode"]] if e["llama.cpp"] else []
        ppl = f"{e['perplexity']:.3f}" + (f" ({100 * (e['perplexity'] / ppl0 - 1):+.1f}%)" if ppl0 else "")
        lines.append(f"| {name} | {e['bytes'] / 1e6:.0f} | {ppl} | " + " | ".join(f"{v:.1f}" for v in ours)
                     + " | " + " / ".join(f"{v:.2f}x" for v in vs)
                     + " | " + (" / ".join(f"{v:.1f}" for v in theirs) or "-")
                     + " | " + (" / ".join(f"{o / t:.2f}x" for o, t in zip(ours, theirs)) or "-") + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
