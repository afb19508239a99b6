"""Command line: `graphdecode generate ...`, `graphdecode serve ...` and `graphdecode bench ...`.

Every argument is checked before a model is loaded: argparse checks the numbers,
then the SamplingParams and the engine options are built (EngineConfig reads only
config.json). A bad value prints one line, `graphdecode: error: ...`, and exits with
status 2, as argparse's own errors do; so does a broken model directory.
"""

from __future__ import annotations

import argparse
import json
import sys

from .engine_args import HelpFormatter, add_engine_args, engine_options, fail, field_default, int_list, positive_int
from .server.args import DESCRIPTION as SERVE_DESCRIPTION
from .server.args import add_serve_args

FIRST_PROMPT = "The capital of France is"


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from .sampling_params import SamplingParams

    def default(name: str) -> str:
        recommended = "the model's recommendation (generation_config.json), else " if name != "n" else ""
        return f"default: {recommended}SamplingParams', {field_default(SamplingParams, name)}"

    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens per completion ({default('max_tokens')})")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: 0, greedy, so that a first run is reproducible; with -n > 1, "
                        "the model's recommendation (generation_config.json), else SamplingParams' "
                        f"{field_default(SamplingParams, 'temperature')}, so that the n completions differ)")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling ({default('top_p')})")
    p.add_argument("--top-k", type=int, default=None, help=f"0 disables it ({default('top_k')})")
    p.add_argument("--seed", type=int, default=None,
                   help="per-request seed (default: none; seeds then derive from the engine's seed, so runs "
                        "repeat anyway)")
    p.add_argument("-n", type=int, default=None, help=f"completions per prompt ({default('n')})")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _sampling_params(args, defaults: dict | None = None):
    """SamplingParams from the flags; a field without a flag takes `defaults` (the model's recommendations,
    EngineConfig.sampling_defaults) where they have it, else SamplingParams' own."""
    from .sampling_params import SamplingParams

    given = dict(defaults or {})
    given.update({name: getattr(args, name) for name in ("n", "top_p", "top_k", "seed", "max_tokens")
                  if getattr(args, name) is not None})
    if args.stop:
        given["stop"] = args.stop
    n = args.n if args.n is not None else field_default(SamplingParams, "n")
    if args.temperature is not None:
        given["temperature"] = args.temperature
    elif n == 1:
        given["temperature"] = 0.0  # greedy: the CLI's one departure from the defaults
    return SamplingParams(**given)


def cmd_generate(args) -> int:
    from . import LLM

    prompts = args.prompts or [FIRST_PROMPT]
    try:
        params = _sampling_params(args)
        model, options = engine_options(args)
    except (ValueError, TypeError) as e:
        fail(e)
    try:
        llm = LLM(model, **options)
    except ValueError as e:  # a broken model directory
        fail(e)
    with llm:  # tensor-parallel workers stop when the command is done, also when main() is called in-process
        params = _sampling_params(args, llm.config.sampling_defaults)  # checked above; now with the model's
        try:
            if args.stream:
                _print_stream(llm, prompts, params)
            else:
                _print_outputs(llm, prompts, params, args.json)
        except ValueError as e:  # a prompt too long for --max-model-len
            fail(e)
        if args.stats:
            print(json.dumps(llm.stats(), indent=2, default=str))
    return 0


def _print_outputs(llm, prompts, params, as_json: bool) -> None:
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        for c in out.outputs:
            if as_json:
                print(json.dumps({"prompt": prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}))
            else:
                label = f" [completion {c.index}]" if params.n > 1 else ""
                print(f"{prompt!r}{label} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")


def _print_stream(llm, prompts, params) -> None:
    """Text as it arrives. One completion: the text itself, then how it ended. Several: a header
    naming the prompts, then one line per non-empty delta, labelled with its prompt and completion."""
    eos = set(llm.config.model_config.eos_token_ids)
    single = len(prompts) == 1 and params.n == 1
    counts: dict[tuple[int, int], int] = {}
    if single:
        print(f"{prompts[0]!r} ->", flush=True)
    else:
        print(f"streaming {len(prompts)} prompt(s) x {params.n} completion(s); each line is new text:")
        for i, prompt in enumerate(prompts):
            print(f"  prompt {i}: {prompt!r}")

    def label(p: int, index: int) -> str:
        if len(prompts) == 1:
            return f"completion {index}"
        return f"prompt {p}" if params.n == 1 else f"prompt {p}, completion {index}"

    index_of: dict[str, int] = {}  # request id -> prompt index (identical prompts may swap: same text)
    for delta in llm.stream(prompts, params):
        p = index_of.get(delta.request_id)
        if p is None:
            taken = set(index_of.values())
            p = next(i for i, prompt in enumerate(prompts) if prompt == delta.prompt and i not in taken)
            index_of[delta.request_id] = p
        for c in delta.outputs:
            counts[p, c.index] = counts.get((p, c.index), 0) + len(c.token_ids)
            if c.text:
                if single:
                    print(c.text, end="", flush=True)
                else:
                    print(f"{label(p, c.index)}: {c.text!r}", flush=True)
            if c.finished:
                how = _finish_text(c, counts[p, c.index], eos)
                print(f"\n[{how}]" if single else f"{label(p, c.index)}: [{how}]", flush=True)


def _finish_text(c, num_tokens: int, eos: set) -> str:
    if c.finish_reason == "length":
        return f"finished: length limit reached, {num_tokens} tokens"
    if c.finish_reason == "stop":
        if isinstance(c.stop_reason, str):
            return f"finished: stop string {c.stop_reason!r}, {num_tokens} tokens"
        what = "end-of-sequence token" if c.stop_reason in eos else "stop token"
        return f"finished: {what} {c.stop_reason}, {num_tokens} tokens"
    return f"finished: {c.finish_reason}, {num_tokens} tokens"


def cmd_serve(args) -> int:
    """The OpenAI-compatible server (graphdecode/server/openai_api.py) until SIGTERM or Ctrl+C."""
    try:
        from .server.openai_api import serve_checked
    except ImportError as e:
        fail(f"serve needs fastapi, uvicorn and prometheus_client ({e}); pip install -e .")
    return serve_checked(args)


def cmd_bench(args) -> int:
    from .bench.sweep import run_bucket_sweep_cli

    try:
        for name in ("buckets", "steps"):
            int_list(getattr(args, name))
        for name in ("prompt_len", "gen_len", "repeats", "threads"):
            positive_int(str(getattr(args, name)))
    except argparse.ArgumentTypeError as e:
        fail(f"--{name.replace('_', '-')}: {e}")
    try:
        return run_bucket_sweep_cli(args)
    except ValueError as e:  # a bad --preset, --dtype, --device or model directory
        fail(e)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="graphdecode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", help="generate text for prompts", formatter_class=HelpFormatter,
        description="Generate text for prompts. Greedy by default (reproducible); with -n > 1 and no "
                    "--temperature, sampled at the model's recommended temperature (generation_config.json), "
                    "else SamplingParams', so the completions differ.",
    )
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {FIRST_PROMPT!r})")
    add_engine_args(gen)
    _sampling_args(gen)
    output = gen.add_mutually_exclusive_group()
    output.add_argument("--stream", action="store_true", help="print text as it is produced")
    output.add_argument("--json", action="store_true", help="one JSON object per completion")
    gen.add_argument("--stats", action="store_true", help="print engine counters at the end")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                         formatter_class=HelpFormatter, description=SERVE_DESCRIPTION)
    add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="bucket sweep: tokens/s per bucket and k, beside transformers",
                           formatter_class=HelpFormatter)
    from .bench.sweep import add_sweep_args

    add_sweep_args(bench)
    for action in bench._actions:  # options without a help string still show their default
        if action.help is None and action.default not in (None, False):
            action.help = "(default: %(default)s)"
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
