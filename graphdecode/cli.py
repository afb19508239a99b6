"""Command line: `graphdecode generate ...` and `graphdecode bench ...`."""

from __future__ import annotations

import argparse
import json
import sys


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options. Their defaults are EngineConfig's (None here means: not given)."""
    p.add_argument("--model", default=None, help="HuggingFace model directory (default: the built-in random Llama)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    p.add_argument("--max-batch-size", type=int, default=None, help="most sequences decoding at once")
    p.add_argument("--buckets", type=_int_list, default=None,
                   help="padded batch sizes that get a CUDA graph, e.g. 1,16,128 (default: powers of two)")
    p.add_argument("--num-decode-steps", "-k", type=int, default=None, help="decode steps per window (k)")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["torch", "flashinfer"])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (small models: 1 is fastest)")


_ENGINE_OPTIONS = ("device", "dtype", "max_batch_size", "buckets", "num_decode_steps", "page_size",
                   "max_model_len", "attention_backend")


def _make_llm(args):
    import torch

    from . import LLM

    torch.set_num_threads(args.threads)
    given = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name) is not None}
    return LLM(args.model, **given)


def cmd_generate(args) -> int:
    from . import SamplingParams

    llm = _make_llm(args)
    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop or None,
    )
    prompts = args.prompts or ["The capital of France is"]
    if args.stream:
        for delta in llm.stream(prompts, params):
            for c in delta.outputs:
                print(f"[{delta.request_id}.{c.index}] {c.text!r}" + (f" <{c.finish_reason}>" if c.finished else ""))
    else:
        for prompt, out in zip(prompts, llm.generate(prompts, params)):
            for c in out.outputs:
                if args.json:
                    print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                      "finish_reason": c.finish_reason}))
                else:
                    print(f"{prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    if args.stats:
        print(json.dumps(llm.stats(), indent=2, default=str))
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bucket_sweep_cli

    return run_bucket_sweep_cli(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="graphdecode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="prompts (default: 'The capital of France is')")
    _engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1, help="completions per prompt")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print deltas as they are produced")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    gen.add_argument("--stats", action="store_true", help="print engine counters at the end")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="bucket sweep: tokens/s per bucket and k, beside transformers")
    from .bench import add_sweep_args

    add_sweep_args(bench)
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
