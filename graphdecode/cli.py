"""Command line: `graphdecode generate ...`, `graphdecode serve ...` and `graphdecode bench ...`.

Every argument is checked before a model is loaded: argparse checks the numbers,
then the SamplingParams and the engine options are built (EngineConfig reads only
config.json). A bad value prints one line, `graphdecode: error: ...`, and exits with
status 2, as argparse's own errors do; so does a broken model directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import NoReturn

FIRST_PROMPT = "The capital of France is"
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # serve: seconds without a beat from the engine core before /health is 503


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the help already says what the default is, or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _fail(error) -> NoReturn:
    """A validation error as argparse reports one: a single line on stderr, exit status 2."""
    message = " ".join(str(error).split())
    print(f"graphdecode: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30,
                  "T": 1 << 40}


def _byte_size(text: str) -> int:
    """Bytes as vLLM writes them: 4294967296, 4G or 4GiB (binary), 4g (decimal)."""
    number = text.removesuffix("iB") if text[-3:-2] in ("K", "M", "G", "T") else text
    scale = _SIZE_SUFFIXES.get(number[-1:], 1)
    try:
        value = int(float(number[:-1] if scale > 1 else number) * scale)
    except (ValueError, OverflowError):
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size in bytes >= 1 (e.g. 4000000000, 4G, 4GiB), got {text!r}")
    return value


def _field_default(cls, name: str):
    """A dataclass field's default, so the help never repeats a number that lives elsewhere."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options. Their defaults are EngineConfig's (None here means: not given)."""
    from .config import (
        CPU_KV_BUDGET_BYTES,
        CPU_KVCACHE_SPACE_ENV,
        CPU_THREADS_ENV,
        DEFAULT_MAX_BATCH_SIZE,
        GPU_MEMORY_FRACTION,
        LOGPROBS_MODES,
        SCHEDULING_POLICIES,
        EngineConfig,
    )

    def config(name: str) -> str:
        return f"default: EngineConfig's, {_field_default(EngineConfig, name)}"

    p.add_argument("--model", default=None,
                   help="HuggingFace model directory (default: the built-in random Llama, made in the cache "
                        "directory on first use)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: EngineConfig's: cuda when available)")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: EngineConfig's: float32 on CPU; on CUDA the "
                        "checkpoint's own bfloat16 or float16, else bfloat16)")
    p.add_argument("--max-batch-size", type=_positive_int, default=None,
                   help=f"most sequences decoding at once (default: EngineConfig's, {DEFAULT_MAX_BATCH_SIZE}, "
                        f"or the largest of --buckets)")
    p.add_argument("--buckets", type=_int_list, default=None,
                   help="padded batch sizes that get a CUDA graph, e.g. 1,16,128 (default: EngineConfig's: "
                        "powers of two up to --max-batch-size)")
    p.add_argument("--num-decode-steps", "-k", type=_positive_int, default=None,
                   help=f"decode steps per window, k ({config('num_decode_steps')})")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help=f"KV cache page size in tokens, a power of two ({config('page_size')})")
    p.add_argument("--num-gpu-blocks-override", "--num-pages", dest="num_pages", type=_positive_int, default=None,
                   metavar="PAGES",
                   help="KV pool size in pages, exactly, on either device (default: sized by the options below)")
    p.add_argument("--kv-cache-memory-bytes", type=_byte_size, default=None, metavar="BYTES",
                   help=f"KV pool size in bytes per tensor-parallel rank, on either device, e.g. 4G (default: on "
                        f"CUDA by --gpu-memory-utilization; on CPU ${CPU_KVCACHE_SPACE_ENV} GiB when set, else "
                        f"{CPU_KV_BUDGET_BYTES >> 30} GiB at most)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help=f"share of the device's memory (on CPU: of the host's RAM) that weights, KV pool and "
                        f"activations may take, after what others use now (default: on CUDA {GPU_MEMORY_FRACTION}; "
                        f"on CPU unused)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest sequence, prompt + output (default: EngineConfig's: the model's "
                        "max_position_embeddings)")
    p.add_argument("--compile", type=_on_off, default=None, metavar="{on,off}",
                   help="torch.compile the decode forward (default: EngineConfig's: on on CUDA, off on CPU)")
    p.add_argument("--attention-backend", default=None, choices=["torch", "flashinfer"],
                   help="(default: EngineConfig's: flashinfer on CUDA when it can run, else torch)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=None,
                   help=f"ranks the model is split over: cuda:0..N-1, or N CPU processes "
                        f"({config('tensor_parallel_size')})")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='n-gram speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 8}\' (default: off)')
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="turn automatic prefix caching off (default: EngineConfig's: on)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"prefill tokens per engine step; longer prompts are chunked "
                        f"({config('max_num_batched_tokens')})")
    p.add_argument("--cpu-threads", "--threads", dest="cpu_threads", type=_positive_int, default=None,
                   help=f"torch threads of a CPU engine (default: EngineConfig's: ${CPU_THREADS_ENV}, else the "
                        f"cores this process may use, divided among tensor-parallel ranks; on a busy machine give "
                        f"fewer: threads beyond the idle cores make every matmul wait)")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help=f"most logprobs a request may ask for, -1 for no cap ({config('max_logprobs')})")
    p.add_argument("--logprobs-mode", default=None, choices=list(LOGPROBS_MODES),
                   help=f"what logprobs report ({config('logprobs_mode')})")
    p.add_argument("--scheduling-policy", default=None, choices=list(SCHEDULING_POLICIES),
                   help=f"admission order: arrival, or the requests' priority ({config('scheduling_policy')})")
    p.add_argument("--structured-max-states", type=_positive_int, default=None,
                   help=f"automaton states the device's constraint tables hold ({config('structured_max_states')})")
    p.add_argument("--structured-compile-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"wall time one constraint may take to compile ({config('structured_compile_timeout')})")
    p.add_argument("--structured-compile-memory-bytes", type=_positive_int, default=None, metavar="BYTES",
                   help=f"memory one constraint compile may take; larger ones are refused before they start "
                        f"({config('structured_compile_memory_bytes')})")


_ENGINE_OPTIONS = ("device", "dtype", "max_batch_size", "buckets", "num_decode_steps", "page_size",
                   "num_pages", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len", "compile",
                   "attention_backend", "tensor_parallel_size", "enable_prefix_caching",
                   "max_num_batched_tokens", "speculative_config", "cpu_threads", "max_logprobs", "logprobs_mode",
                   "scheduling_policy", "structured_max_states", "structured_compile_timeout",
                   "structured_compile_memory_bytes")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    from .sampling_params import SamplingParams

    def default(name: str) -> str:
        return f"default: SamplingParams', {_field_default(SamplingParams, name)}"

    p.add_argument("--max-tokens", type=int, default=None, help=f"tokens per completion ({default('max_tokens')})")
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: 0, greedy, so that a first run is reproducible; with -n > 1, "
                        f"SamplingParams' {_field_default(SamplingParams, 'temperature')}, so that the n "
                        "completions differ)")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling ({default('top_p')})")
    p.add_argument("--top-k", type=int, default=None, help=f"0 disables it ({default('top_k')})")
    p.add_argument("--seed", type=int, default=None,
                   help="per-request seed (default: none; seeds then derive from the engine's seed, so runs "
                        "repeat anyway)")
    p.add_argument("-n", type=int, default=None, help=f"completions per prompt ({default('n')})")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")


def _sampling_params(args):
    """SamplingParams from the flags; only the flags given are passed, so its defaults apply."""
    from .sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in ("n", "top_p", "top_k", "seed", "max_tokens")
             if getattr(args, name) is not None}
    if args.stop:
        given["stop"] = args.stop
    n = args.n if args.n is not None else _field_default(SamplingParams, "n")
    if args.temperature is not None:
        given["temperature"] = args.temperature
    elif n == 1:
        given["temperature"] = 0.0  # greedy: the CLI's one departure from SamplingParams' defaults
    return SamplingParams(**given)


def _engine_options(args) -> tuple[str, dict]:
    """(model directory, engine options given), checked by building an EngineConfig: no weights are read."""
    from .config import EngineConfig

    given = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name) is not None}
    model = args.model
    if model is None:
        from .default_model import default_model_dir

        model = default_model_dir()
    EngineConfig(model=model, **given)
    return model, given


def cmd_generate(args) -> int:
    from . import LLM

    prompts = args.prompts or [FIRST_PROMPT]
    try:
        params = _sampling_params(args)
        model, options = _engine_options(args)
    except (ValueError, TypeError) as e:
        _fail(e)
    try:
        llm = LLM(model, **options)
    except ValueError as e:  # a broken model directory
        _fail(e)
    with llm:  # tensor-parallel workers stop when the command is done, also when main() is called in-process
        try:
            if args.stream:
                _print_stream(llm, prompts, params)
            else:
                _print_outputs(llm, prompts, params, args.json)
        except ValueError as e:  # a prompt too long for --max-model-len
            _fail(e)
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


def _metrics_prefix(text: str) -> str:
    from .server.metrics import check_metrics_prefix

    try:
        return check_metrics_prefix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--metrics-prefix: ")) from None


def _serve_model(args) -> None:
    """`serve MODEL` as `vllm serve MODEL` takes it: into args.model; with --model too, they must agree."""
    positional = args.model_positional
    if positional is None:
        return
    if args.model is not None and os.path.realpath(args.model) != os.path.realpath(positional):
        raise ValueError(f"the model is given twice: MODEL {positional!r} and --model {args.model!r}; give one")
    args.model = positional


def cmd_serve(args) -> int:
    """The OpenAI-compatible server (graphdecode/server/openai_api.py) until SIGTERM or Ctrl+C."""
    try:
        _serve_model(args)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {args.port}")
        if not args.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
        from .server.engine_core import HEARTBEAT_INTERVAL_S

        if not args.heartbeat_timeout > HEARTBEAT_INTERVAL_S:
            raise ValueError(f"--heartbeat-timeout must be more than the engine core's heartbeat interval "
                             f"({HEARTBEAT_INTERVAL_S:g} s), got {args.heartbeat_timeout}")
        _engine_options(args)  # every engine option checked before the model loads
        from .server.openai_api import serve
    except (ValueError, TypeError) as e:
        _fail(e)
    except ImportError as e:
        _fail(f"serve needs fastapi, uvicorn and prometheus_client ({e}); pip install -e .")
    try:
        return serve(args)
    except ValueError as e:  # the engine could not be built (a broken model directory, ...)
        _fail(e)


def cmd_bench(args) -> int:
    from .bench import run_bucket_sweep_cli

    try:
        for name in ("buckets", "steps"):
            _int_list(getattr(args, name))
        for name in ("prompt_len", "gen_len", "repeats", "threads"):
            _positive_int(str(getattr(args, name)))
    except argparse.ArgumentTypeError as e:
        _fail(f"--{name.replace('_', '-')}: {e}")
    try:
        return run_bucket_sweep_cli(args)
    except ValueError as e:  # a bad --preset, --dtype, --device or model directory
        _fail(e)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="graphdecode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", help="generate text for prompts", formatter_class=_HelpFormatter,
        description="Generate text for prompts. Greedy by default (reproducible); with -n > 1 and no "
                    "--temperature, sampled at SamplingParams' temperature so the completions differ.",
    )
    gen.add_argument("prompts", nargs="*", help=f"prompts (default: {FIRST_PROMPT!r})")
    _engine_args(gen)
    _sampling_args(gen)
    output = gen.add_mutually_exclusive_group()
    output.add_argument("--stream", action="store_true", help="print text as it is produced")
    output.add_argument("--json", action="store_true", help="one JSON object per completion")
    gen.add_argument("--stats", action="store_true", help="print engine counters at the end")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
        formatter_class=_HelpFormatter,
        description="Serve the model over HTTP with the OpenAI API: POST /v1/completions, /v1/chat/completions "
                    "(streamed or not), GET /v1/models, /health, /metrics (Prometheus). SIGTERM drains: new "
                    "requests get 503, running ones finish (at most --shutdown-timeout), then the server exits 0.",
    )
    srv.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                     help="HuggingFace model directory, as `vllm serve MODEL` takes it (the same as --model)")
    _engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: the model directory's name, or "
                          "graphdecode-default for the built-in model)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds running requests get to finish after SIGTERM before they are aborted")
    srv.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                     help="the engine core beats every second, idle or busy; after this many seconds without a "
                          "beat (a stopped or frozen core) /health answers 503 and new requests get 503, until it "
                          "beats again")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's log level")
    srv.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")
    srv.add_argument("--metrics-prefix", type=_metrics_prefix, default="graphdecode:",
                     help="start of every /metrics family name: 'vllm:' gives vLLM's names, for dashboards and "
                          "gateways built for vLLM (docs/metrics.md)")
    srv.add_argument("--max-request-body-bytes", type=int, default=32 << 20, metavar="BYTES",
                     help="a request body over this many bytes gets HTTP 413 before it is read; 0: no limit "
                          "(default: 32 MiB, far above any prompt a context window holds)")
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="bucket sweep: tokens/s per bucket and k, beside transformers",
                           formatter_class=_HelpFormatter)
    from .bench import add_sweep_args

    add_sweep_args(bench)
    for action in bench._actions:  # options without a help string still show their default
        if action.help is None and action.default not in (None, False):
            action.help = "(default: %(default)s)"
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
