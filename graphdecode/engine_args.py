"""The engine's options, once: the command-line flags derived from EngineConfig's fields (their
defaults and checks live there), the argument types the flags parse, and the one check of
unknown keyword arguments that LLM and AsyncLLM share.

A bad value prints one line, `graphdecode: error: ...`, and exits with status 2 (`fail`), as
argparse's own errors do.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from decimal import Decimal, InvalidOperation
from typing import NoReturn


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" unless the help already says what the default is, or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def fail(error) -> NoReturn:
    """A validation error as argparse reports one: a single line on stderr, exit status 2."""
    message = " ".join(str(error).split())
    print(f"graphdecode: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


_SUFFIXES = {"k": 1000, "m": 1000**2, "g": 1000**3, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def token_count(text: str) -> int | None:
    """A count of tokens as vLLM's --max-model-len takes it: 4096, 32k (32,000), 25.6k, 32K (32,768); "auto" or
    -1: None (the model's own)."""
    text = text.strip()
    if text in ("auto", "-1"):
        return None
    number, scale = (text[:-1], _SUFFIXES[text[-1]]) if text and text[-1] in _SUFFIXES else (text, 1)
    try:
        value = Decimal(number) * scale if scale > 1 and text[-1].islower() else int(number) * scale
    except (ValueError, InvalidOperation):
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 4096, 32k or 32K, got {text!r}") \
            from None
    if isinstance(value, Decimal) and not value.is_finite() or value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens >= 1, got {text!r}")
    return int(value)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30,
                  "T": 1 << 40}


def byte_size(text: str) -> int:
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


def field_default(cls, name: str):
    """A dataclass field's default, so the help never repeats a number that lives elsewhere."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options. Their defaults are EngineConfig's (None here means: not given)."""
    from .config import (
        CPU_KV_BUDGET_BYTES,
        CPU_KVCACHE_SPACE_ENV,
        CPU_THREADS_ENV,
        DEFAULT_MAX_BATCH_SIZE,
        EXECUTOR_BACKENDS,
        GPU_MEMORY_FRACTION,
        LOGPROBS_MODES,
        SCHEDULING_POLICIES,
        EngineConfig,
    )
    from .launcher import DEFAULT_MASTER_PORT

    def config(name: str) -> str:
        return f"default: EngineConfig's, {field_default(EngineConfig, name)}"

    p.add_argument("--model", default=None,
                   help="HuggingFace model directory (default: the built-in random Llama, made in the cache "
                        "directory on first use)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the tokenizer's directory, when the model's has none or another is wanted (the same "
                        "vocabulary) (default: the model directory's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: EngineConfig's: cuda when available)")
    p.add_argument("--dtype", default=None,
                   help="auto, float32, bfloat16 or float16 (vLLM's float and half too) (default: EngineConfig's, "
                        "auto: float32 on CPU; on CUDA the checkpoint's own bfloat16 or float16, else bfloat16)")
    p.add_argument("--max-batch-size", "--max-num-seqs", dest="max_batch_size", type=positive_int, default=None,
                   help=f"most sequences decoding at once (default: EngineConfig's, {DEFAULT_MAX_BATCH_SIZE}, "
                        f"or the largest of --buckets)")
    p.add_argument("--buckets", type=int_list, default=None,
                   help="padded batch sizes that get a CUDA graph, e.g. 1,16,128 (default: EngineConfig's: "
                        "powers of two up to --max-batch-size)")
    p.add_argument("--num-decode-steps", "-k", type=positive_int, default=None,
                   help=f"decode steps per window, k ({config('num_decode_steps')})")
    p.add_argument("--page-size", type=positive_int, default=None,
                   help=f"KV cache page size in tokens, a power of two ({config('page_size')})")
    p.add_argument("--num-gpu-blocks-override", "--num-pages", dest="num_pages", type=positive_int, default=None,
                   metavar="PAGES",
                   help="KV pool size in pages, exactly, on either device (default: sized by the options below)")
    p.add_argument("--kv-cache-memory-bytes", type=byte_size, default=None, metavar="BYTES",
                   help=f"KV pool size in bytes per tensor-parallel rank, on either device, e.g. 4G (default: on "
                        f"CUDA by --gpu-memory-utilization; on CPU ${CPU_KVCACHE_SPACE_ENV} GiB when set, else "
                        f"{CPU_KV_BUDGET_BYTES >> 30} GiB at most)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3"],
                   help=f"the KV cache's element: the model's dtype, or FP8 E4M3 with the checkpoint's per-layer "
                        f"k_scale / v_scale (else 1.0) at one byte each ({config('kv_cache_dtype')})")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help=f"share of the device's memory (on CPU: of the host's RAM) that weights, KV pool and "
                        f"activations may take, after what others use now (default: on CUDA {GPU_MEMORY_FRACTION}; "
                        f"on CPU unused)")
    p.add_argument("--max-model-len", type=token_count, default=None,
                   help="longest sequence, prompt + output, as vLLM writes it: 4096, 32k (32,000), 32K (32,768), "
                        "auto or -1 for the model's (default: EngineConfig's: the model's max_position_embeddings)")
    p.add_argument("--compile", type=on_off, default=None, metavar="{on,off}",
                   help="torch.compile the decode forward (default: EngineConfig's: on on CUDA, off on CPU)")
    p.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const=False, default=None,
                   help="no CUDA graphs: every decode step launched from Python (vLLM's flag; default: "
                        "EngineConfig's, graphs on CUDA)")
    p.add_argument("--attention-backend", default=None, choices=["torch", "flashinfer"],
                   help="(default: EngineConfig's: flashinfer on CUDA when it can run, else torch)")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=None,
                   help=f"ranks the model is split over: cuda:0..N-1, or N CPU processes "
                        f"({config('tensor_parallel_size')})")
    p.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=None,
                   help=f"stages the decoder's layers are split over, each of --tensor-parallel-size ranks (CPU "
                        f"ranks so far) ({config('pipeline_parallel_size')})")
    p.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                   help="decoder layers per pipeline stage, e.g. 10,14 (default: EngineConfig's: an even split, "
                        "the remainder to the stages before the last)")
    p.add_argument("--pp-micro-batches", type=positive_int, default=None, metavar="N",
                   help="micro-batches a decode window's rows are split into over pipeline stages so they overlap: "
                        "1 (none), or >= --pipeline-parallel-size (default: EngineConfig's: "
                        "--pipeline-parallel-size of them)")
    p.add_argument("--distributed-executor-backend", default=None, choices=list(EXECUTOR_BACKENDS),
                   help=f"how the ranks start: mp, spawned here (and by --headless on other nodes); "
                        f"external_launcher, by torchrun, whose rank 0 runs the engine; ray, as actors on the Ray "
                        f"cluster ({config('distributed_executor_backend')})")
    p.add_argument("--nnodes", type=positive_int, default=None,
                   help=f"machines the tensor-parallel ranks span, --tensor-parallel-size / this on each "
                        f"({config('nnodes')})")
    p.add_argument("--node-rank", type=int, default=None,
                   help=f"this machine's index: 0 runs the engine, 1..nnodes-1 run --headless ({config('node_rank')})")
    p.add_argument("--master-addr", default=None,
                   help=f"node 0's address, where the other nodes' ranks meet rank 0 ({config('master_addr')})")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"node 0's rendezvous port (default: {DEFAULT_MASTER_PORT} with --nnodes > 1, a free one "
                        f"on one machine)")
    p.add_argument("--speculative-config", type=json_object, default=None,
                   help='n-gram speculative decoding, vLLM\'s JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 8}\' (default: off)')
    p.add_argument("--enable-lora", dest="enable_lora", action="store_true", default=None,
                   help="requests may run with a LoRA adapter (PEFT's format; serve: --lora-modules) "
                        "(default: off)")
    p.add_argument("--max-loras", type=positive_int, default=None,
                   help=f"LoRA adapters resident on the device at once; a request whose adapter finds no free "
                        f"slot waits ({config('max_loras')})")
    p.add_argument("--max-lora-rank", type=positive_int, default=None,
                   help=f"the largest rank an adapter may have; every token pays for max-loras x this "
                        f"({config('max_lora_rank')})")
    p.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="LoRA adapters kept read in host memory (default: EngineConfig's: --max-loras)")
    p.add_argument("--generation-config", default=None, metavar="{auto,vllm,DIR}",
                   help="the sampling defaults of a request that leaves a field out: auto, the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens); vllm, SamplingParams' own; or a directory holding a "
                        f"generation_config.json ({config('generation_config')})")
    p.add_argument("--override-generation-config", type=json_object, default=None, metavar="JSON",
                   help='sampling defaults laid over --generation-config\'s, its JSON names, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 512}\' (default: none)')
    p.add_argument("--kv-events-config", type=json_object, default=None,
                   help='KV-cache events for prefix-aware routers, vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": '
                        'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
                        '(default: off)')
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", default=None,
                   help="turn automatic prefix caching off (default: EngineConfig's: on)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None,
                   help="prefix caching on, as it is by default (vLLM's flag)")
    p.add_argument("--allow-batch-variance", dest="batch_invariant", action="store_false", default=None,
                   help="let a request's tokens depend on which requests share its batch, for oneDNN's faster "
                        "GEMMs at many rows (default: EngineConfig's: batch-invariant)")
    p.add_argument("--no-cpu-huge-pages", dest="cpu_huge_pages", action="store_false", default=None,
                   help="leave a CPU engine's weights on the pages they were loaded on (default: EngineConfig's: "
                        "collapsed onto 2 MiB pages, for fewer TLB misses as decode streams them)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help=f"prefill tokens per engine step; longer prompts are chunked "
                        f"({config('max_num_batched_tokens')})")
    p.add_argument("--cpu-threads", "--threads", dest="cpu_threads", type=positive_int, default=None,
                   help=f"torch threads of a CPU engine (default: EngineConfig's: ${CPU_THREADS_ENV}, else the "
                        f"cores this process may use, divided among tensor-parallel ranks; on a busy machine give "
                        f"fewer: threads beyond the idle cores make every matmul wait)")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help=f"most logprobs a request may ask for, -1 for no cap ({config('max_logprobs')})")
    p.add_argument("--logprobs-mode", default=None, choices=list(LOGPROBS_MODES),
                   help=f"what logprobs report ({config('logprobs_mode')})")
    p.add_argument("--scheduling-policy", default=None, choices=list(SCHEDULING_POLICIES),
                   help=f"admission order: arrival, or the requests' priority ({config('scheduling_policy')})")
    p.add_argument("--structured-max-states", type=positive_int, default=None,
                   help=f"automaton states the device's constraint tables hold ({config('structured_max_states')})")
    p.add_argument("--structured-compile-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"wall time one constraint may take to compile ({config('structured_compile_timeout')})")
    p.add_argument("--structured-compile-memory-bytes", type=positive_int, default=None, metavar="BYTES",
                   help=f"memory one constraint compile may take; larger ones are refused before they start "
                        f"({config('structured_compile_memory_bytes')})")


def engine_option_names() -> tuple[str, ...]:
    """The EngineConfig fields add_engine_args gives a flag (derived from the flags, never listed twice)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return tuple(a.dest for a in parser._actions if a.dest != "model")


def engine_options(args) -> tuple[str, dict]:
    """(model directory, engine options given), checked by building an EngineConfig: no weights are read."""
    from .config import EngineConfig

    given = {name: getattr(args, name) for name in engine_option_names() if getattr(args, name) is not None}
    if getattr(args, "engine_seed", None) is not None:  # serve's --seed (generate's is each request's)
        given["seed"] = args.engine_seed
    model = args.model
    if model is None:
        from .default_model import default_model_dir

        model = default_model_dir()
    EngineConfig(model=model, **given)
    return model, given


# vLLM's EngineArgs names for EngineConfig fields, so that `LLM(model, max_num_seqs=16)` written for vLLM runs
VLLM_ALIASES = {"max_num_seqs": "max_batch_size", "block_size": "page_size", "num_gpu_blocks_override": "num_pages"}
# vLLM's arguments for what graphdecode always does: accepted with the value that asks for it
VLLM_ALWAYS = {"trust_remote_code": (True, False), "enable_chunked_prefill": (True,), "disable_log_stats": (True, False)}


def engine_kwargs(caller: str, engine_args: dict) -> dict:
    """EngineConfig's keyword arguments from `caller`'s (LLM, AsyncLLM): vLLM's names translated
    (VLLM_ALIASES; enforce_eager=True is cuda_graphs=False), vLLM's always-on ones dropped, then every
    name checked (check_engine_kwargs)."""
    out = {}
    for name, value in engine_args.items():
        if name in VLLM_ALIASES:
            target = VLLM_ALIASES[name]
            if target in engine_args:
                raise TypeError(f"{caller}() got both {name!r} (vLLM's name) and {target!r}: give one")
            out[target] = value
        elif name == "enforce_eager":
            if not isinstance(value, bool):
                raise ValueError(f"enforce_eager must be True or False, got {value!r}")
            if "cuda_graphs" in engine_args:
                raise TypeError(f"{caller}() got both 'enforce_eager' (vLLM's name) and 'cuda_graphs': give one")
            if value:
                out["cuda_graphs"] = False
        elif name in VLLM_ALWAYS:
            if value not in VLLM_ALWAYS[name] or not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: graphdecode cannot do that ({name} is always "
                                 f"{VLLM_ALWAYS[name][0]!r} here)")
        else:
            out[name] = value
    check_engine_kwargs(caller, out)
    return out


def check_engine_kwargs(caller: str, engine_args: dict) -> None:
    """A TypeError naming the first keyword that is not an EngineConfig field (and the closest one)."""
    from .config import EngineConfig

    valid = [f.name for f in dataclasses.fields(EngineConfig) if f.init and f.name != "model"]
    unknown = [name for name in engine_args if name not in valid]
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint} "
            f"(engine arguments are graphdecode.config.EngineConfig's fields: {', '.join(valid)})"
        )
