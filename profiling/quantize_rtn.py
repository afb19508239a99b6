"""Write a float HuggingFace checkpoint in one of the quantized formats the engine loads, with graphdecode's writer
(graphdecode/models/quant/rtn.py): round-to-nearest, or with --awq first calibrated by AWQ's activation-aware
scaling (graphdecode/models/quant/awq.py, llama-family models, integer formats) on text the model samples itself.
--perplexity: bench_quant.py's perplexity of the written checkpoint (and of the source) over its fixed text.

    python profiling/quantize_rtn.py SRC DST --format pack-quantized --bits 4 --group 32 --quantize-head --awq \\
        --perplexity
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from graphdecode.bench.common import script_module  # noqa: E402
from graphdecode.models.quant.rtn import FORMATS  # noqa: E402

PROMPTS = (  # varied openings for the model to continue (calibration_tokens)
    "The history of the printing press begins",
    "Once upon a time, in a village at the edge of a great forest,",
    "To make a good loaf of bread at home, you need",
    "The committee met on Tuesday to discuss the new budget, and",
    "Photosynthesis is the process by which plants",
    "She opened the letter slowly, afraid of what it might say.",
    "The most important thing to know about learning a new language is",
    "In the winter of 1848, the ship left the harbour with",
    "Dear Sam, thank you for your letter. The weather here has been",
    "A simple way to understand how computers store numbers is",
    "The old bridge over the river had been closed for years, but",
    "Here are some tips for a long walk in the mountains:",
    "When the train finally stopped, the passengers",
    "The city council announced today that",
    "My grandmother kept a small garden behind her house, where",
    "Scientists have long wondered why birds migrate",
)


def calibration_tokens(model: str, count: int = 16, length: int = 256, temperature: float = 0.9, seed: int = 0,
                       threads: int = 1, prompts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """`count` token sequences of the model's own text: each prompt (cycled; at most 64 tokens) followed by up to
    `length` tokens sampled from the float model by this engine at `temperature`, top-p 0.95 (seeded: the same
    every run; a sequence ends early at an end-of-sequence token)."""
    from graphdecode import LLM, SamplingParams

    with LLM(model, dtype="float32", cpu_threads=threads, max_model_len=length + 64,
             enable_prefix_caching=False) as llm:
        tok = llm.get_tokenizer()
        ids = [tok.encode(prompts[i % len(prompts)]) for i in range(count)]
        outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                            [SamplingParams(temperature=temperature, top_p=0.95, max_tokens=length, seed=seed + i)
                             for i in range(count)], use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(ids, outs)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a float HuggingFace checkpoint directory")
    ap.add_argument("dst", help="the directory to write")
    ap.add_argument("--format", default="pack-quantized", choices=FORMATS)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128, help="columns per scale; 0: one scale per row")
    ap.add_argument("--asymmetric", action="store_true", help="zero points (min-max ranges)")
    ap.add_argument("--act-order", action="store_true", help="gptq: desc_act column order")
    ap.add_argument("--quantize-head", action="store_true", help="the LM head too (int8 per row; FP8)")
    ap.add_argument("--awq", action="store_true", help="AWQ calibration on the model's own sampled text")
    ap.add_argument("--calibration-sequences", type=int, default=16)
    ap.add_argument("--calibration-length", type=int, default=256, help="sampled tokens per sequence")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the rounding (and the AWQ search) runs")
    ap.add_argument("--perplexity", action="store_true", help="bench_quant.py's perplexity, source and result")
    args = ap.parse_args(argv)

    import torch

    from graphdecode.models.quant.rtn import quantize_checkpoint

    torch.set_num_threads(args.threads)
    report = {}
    calibration = None
    if args.awq:
        start = time.monotonic()
        calibration = calibration_tokens(args.src, count=args.calibration_sequences, length=args.calibration_length,
                                         threads=args.threads)
        report["calibration_tokens"] = sum(len(s) for s in calibration)
        report["sampling_s"] = time.monotonic() - start
    start = time.monotonic()
    quantize_checkpoint(args.src, args.dst, args.format, args.bits, args.group or None, not args.asymmetric,
                        args.act_order, quantize_head=args.quantize_head, device=args.device,
                        calibration=calibration)
    report["write_s"] = time.monotonic() - start
    if args.perplexity:
        quant = script_module(os.path.join(HERE, "bench_quant.py"))
        report["perplexity_src"] = quant.perplexity(args.src, "float32", args.threads)
        report["perplexity"] = quant.perplexity(args.dst, "float32", args.threads)
    print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()))
    return report


if __name__ == "__main__":
    main()
