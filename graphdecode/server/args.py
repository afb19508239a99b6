"""`serve`'s arguments and their defaults, once: what `graphdecode serve` and
`python -m graphdecode.server.openai_api` both parse. Light to import (argparse and the engine's
option table; nothing of the server itself), so `graphdecode --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat

from ..engine_args import add_engine_args
from .auth import API_KEY_ENV, api_keys
from .chat_template import load_chat_template
from .lora_modules import lora_module
from .reasoning import REASONING_PARSERS
from .stat_logger import DEFAULT_LOG_STATS_INTERVAL_S
from .tool_parsers import TOOL_PARSERS

DEFAULT_TOOL_CALL_PARSER = "hermes"  # the format tool_choice "auto" reads calls in (tool_parsers.py)
HEARTBEAT_INTERVAL_S = 1.0  # how often the engine core says it is alive
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # seconds without a beat from the core before /health is 503
# Bodies over this many bytes are refused (413) before they are read. 32 MiB holds any single prompt a
# context window takes many times over (128k tokens as JSON ids is ~1 MB, as text ~0.5-3 MB) and batches of
# them, while a body of hundreds of MB, which would take seconds and GBs to parse, never reaches the parser.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
DESCRIPTION = ("Serve the model over HTTP with the OpenAI API: POST /v1/completions, /v1/chat/completions "
               "(streamed or not), GET /v1/models, /health, /metrics (Prometheus). SIGTERM drains: new "
               "requests get 503, running ones finish (at most --shutdown-timeout), then the server exits 0.")


# vLLM's flags for what graphdecode always does: accepted, changing nothing (why, for --help)
ALWAYS_ON = {
    "--enable-auto-tool-choice": "tool_choice 'auto' is always on",
    "--enable-prompt-tokens-details": "usage.prompt_tokens_details.cached_tokens is always reported while prefix "
                                      "caching is on",
    "--trust-remote-code": "graphdecode runs no code from a model directory (its model families are built in)",
    "--enable-chunked-prefill": "long prompts are always chunked (--max-num-batched-tokens)",
    "--disable-log-requests": "graphdecode never logs requests' contents",
    "--disable-fastapi-docs": "graphdecode serves no /docs, /redoc or /openapi.json",
}

DEFAULT_METRICS_PREFIX = "graphdecode:"
_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # a Prometheus metric name (':' allowed), or its start


def check_metrics_prefix(prefix) -> str:
    """The prefix, if every family name it starts is a valid Prometheus name; else ValueError."""
    if not isinstance(prefix, str) or (prefix and not _PREFIX.fullmatch(prefix)):
        raise ValueError(f"--metrics-prefix: {prefix!r} cannot start Prometheus metric names: use letters, digits, "
                         "'_' and ':', not a digit first (e.g. 'graphdecode:' or 'vllm:')")
    return prefix


def _metrics_prefix(text: str) -> str:
    try:
        return check_metrics_prefix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--metrics-prefix: ")) from None


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (e.g. '[\"https://example.com\"]')") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The model (positional or --model), the engine's options, and the server's own."""
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="HuggingFace model directory, as `vllm serve MODEL` takes it (the same as --model)")
    add_engine_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="engine replicas behind this server, each a whole engine in its own process (on a CPU, "
                        "each with its share of the cores; on CUDA, its own GPUs): requests go to the one with "
                        "the shortest queue, metrics carry an engine label")
    p.add_argument("--headless", action="store_true",
                   help="run only this machine's tensor-parallel ranks of an engine spread over --nnodes machines "
                        "(give its --node-rank, and node 0's --master-addr and --master-port): no HTTP server; "
                        "exits when node 0's engine ends")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host/--port (clients connect through the "
                        "file, e.g. curl --unix-socket PATH http://localhost/v1/models); removed at exit")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name clients send; with several, any of them (answers and metrics carry the "
                        "first) (default: the model directory's name, or graphdecode-default for the built-in "
                        "model)")
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) a request selects by sending NAME as its model, with "
                        "--enable-lora; vLLM's JSON form too: '{\"name\": ..., \"path\": ..., "
                        "\"base_model_name\": ...}' (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                   help="the engine core beats every second, idle or busy; after this many seconds without a "
                        "beat (a stopped or frozen core) /health answers 503 and new requests get 503, until it "
                        "beats again")
    p.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level")
    p.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS with this private key (PEM), with --ssl-certfile")
    p.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the certificate (PEM) served for HTTPS")
    p.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates are checked against")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                   help="whether clients must show a certificate: 0 no, 1 optional, 2 required (Python's "
                        "ssl.CERT_*; default: %(default)s)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own when it sent one, else a new one")
    p.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="no_access_log", action="store_true",
                   help="no log line per HTTP request")
    p.add_argument("--metrics-prefix", type=_metrics_prefix, default=DEFAULT_METRICS_PREFIX,
                   help="start of every /metrics family name: 'vllm:' gives vLLM's names, for dashboards and "
                        "gateways built for vLLM (docs/metrics.md)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="separate a thinking model's <think> block from its answer: Chat Completions' "
                        "reasoning_content, the Responses API's reasoning items, the Messages API's thinking "
                        "blocks (qwen3: an output without a block is all answer; deepseek_r1: all reasoning "
                        "until </think>)")
    p.add_argument("--tool-call-parser", default=DEFAULT_TOOL_CALL_PARSER, choices=sorted(TOOL_PARSERS),
                   help="the format tool_choice 'auto' reads the model's calls in (vLLM's names); 'required' and "
                        "named calls are constrained JSON in every format")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprob tokens as 'token_id:N' strings in every response (vLLM's; a request can ask for "
                        "it itself with return_tokens_as_token_ids)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, as if stream_options.include_usage were set (vLLM's)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load reports the requests running now (vLLM's; without it, 0)")
    p.add_argument("--seed", dest="engine_seed", type=int, default=None,
                   help="the engine's seed (EngineConfig.seed): a request without a seed of its own draws from "
                        "it, so a restarted server samples the same (default: EngineConfig's, 0)")
    for flag, why in ALWAYS_ON.items():
        p.add_argument(flag, action="store_true", help=f"accepted for vLLM's command lines: {why}")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (vLLM's: prompt and generation throughput, requests running and "
                        "waiting, KV cache usage, prefix cache hit rate)")
    p.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL_S, metavar="SECONDS",
                   help="seconds between stats lines; an idle engine logs one and is then quiet (default: "
                        "%(default)s, vLLM's)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="API server processes in front of the one engine core (vLLM's): they share the port, "
                        "each parses, tokenizes and streams its own connections, /metrics adds them up")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template of every chat-shaped endpoint: a file, or the Jinja template itself "
                        "(default: the tokenizer's)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help=f"one or more keys; every route but /health, /ping, /load, /version and /metrics then "
                        f"needs one, as 'Authorization: Bearer KEY' or 'x-api-key: KEY', else 401 (default: "
                        f"${API_KEY_ENV} when set, else none)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the origins browsers' scripts may call from, a JSON list (default: %(default)s)")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the methods allowed, a JSON list (default: %(default)s)")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: the request headers allowed, a JSON list (default: %(default)s)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cookies and credentials (default: off)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES, metavar="BYTES",
                   help="a request body over this many bytes gets HTTP 413 before it is read; 0: no limit "
                        "(default: 32 MiB, far above any prompt a context window holds)")


UDS_PATH_BYTES = 107  # sockaddr_un's sun_path holds 108 bytes with the terminating NUL


def check_listen_args(args) -> None:
    """--uds: a socket file that can be made there."""
    if args.uds is not None:
        if "\0" in args.uds:
            raise ValueError(f"--uds: {args.uds!r} holds a NUL character")
        path = os.path.abspath(args.uds)
        if not os.path.isdir(os.path.dirname(path)):
            raise ValueError(f"--uds: the folder {os.path.dirname(path)!r} does not exist")
        if os.path.exists(path) and not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ValueError(f"--uds: {args.uds!r} exists and is not a socket (it would not be replaced)")
        if len(os.fsencode(path)) > UDS_PATH_BYTES:
            raise ValueError(f"--uds: {path!r} is longer than a Unix socket's address holds ({UDS_PATH_BYTES} bytes)")


def check_serve_args(args) -> None:
    """ValueError naming the argument: `MODEL` against `--model`, the port, the timeouts, the body limit."""
    positional = args.model_positional
    if positional is not None:  # `serve MODEL` as `vllm serve MODEL` takes it; with --model too, they must agree
        if args.model is not None and os.path.realpath(args.model) != os.path.realpath(positional):
            raise ValueError(f"the model is given twice: MODEL {positional!r} and --model {args.model!r}; give one")
        args.model = positional
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_listen_args(args)
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.heartbeat_timeout > HEARTBEAT_INTERVAL_S:
        raise ValueError(f"--heartbeat-timeout must be more than the engine core's heartbeat interval "
                         f"({HEARTBEAT_INTERVAL_S:g} s), got {args.heartbeat_timeout}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules: serving LoRA adapters needs --enable-lora")
    api_keys(args.api_key)  # an empty key, from the flag or the environment
    load_chat_template(args.chat_template)
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile: give both (HTTPS) or neither")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')}: {path!r} is not a file")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if not args.log_stats_interval > 0:
        raise ValueError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval}")
    if args.max_request_body_bytes < 0:
        raise ValueError(f"--max-request-body-bytes must be >= 0 (0: no limit), got {args.max_request_body_bytes}")
