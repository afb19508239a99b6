"""`--api-server-count N` (vLLM's): N API server processes in front of one engine core.

One process's event loop parses, tokenizes, renders chat templates and writes every stream; at
high request rates that loop, not the core, sets the pace. With N > 1 this process (the parent)
binds the port once, starts the engine core with one pipe pair per API server
(engine_core.py: each server's requests and deltas go over its own pair), and spawns N API
server processes that each accept connections on the shared socket (the kernel spreads them)
and run the usual app (openai_api.run_server) over `AsyncLLM.attached`.

/metrics adds the servers up: their counters and histograms live in prometheus_client's
multiprocess files (a temporary PROMETHEUS_MULTIPROC_DIR the parent makes and removes), and
the engine's families come from the core, which sends every server the same load. The
server-side gauges `num_requests_unfinished` and `GET /load` are the answering server's own.

The parent supervises: SIGTERM or SIGINT is passed on to every API server once (each drains
its requests, as a single server does; a second signal forces them), and once they have all
exited the core ends (it stops when its last client shut down). An API server that exits
unasked (its core died, or it was killed) takes the others down and the parent exits 1, so a
supervisor restarts the whole set. The API servers are in their own process group (a
terminal's Ctrl+C reaches the parent alone, which passes it on) and get SIGTERM if the parent
dies.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from multiprocessing.connection import wait

from ..engine_args import engine_options
from .async_llm import AsyncLLM, start_engine_core
from .listen import bind_tcp, bind_unix, remove_socket_file
from .metrics import MULTIPROC_DIR

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve_many(args, run_server) -> int:
    """Run args.api_server_count API servers over one engine core, each `run_server(args, engine, sockets,
    label)` (openai_api.run_server) in its own process; returns the exit status."""
    count = args.api_server_count
    model, options = engine_options(args)
    if args.uds:
        sock = bind_unix(args.uds)
    else:
        sock = bind_tcp(args.host, args.port)
        args.port = sock.getsockname()[1]  # --port 0: the port the kernel chose, for every server's banner
    metrics_dir = tempfile.mkdtemp(prefix="graphdecode-metrics-")
    core = None
    try:
        core, clients = start_engine_core(str(model), options, count)
        os.environ[MULTIPROC_DIR] = metrics_dir  # the API servers inherit it (the core has started without)
        spawn = multiprocessing.get_context("spawn")
        servers = [spawn.Process(target=run_api_server, name=f"graphdecode-api-server-{i}",
                                 args=(args, run_server, i, count, requests, outputs, sock, os.getpid()))
                   for i, (requests, outputs) in enumerate(clients)]
        for server in servers:
            server.start()
        for requests, outputs in clients:  # the servers hold their own copies now
            requests.close()
            outputs.close()
        sock.close()
        return _supervise(servers, core)
    finally:
        os.environ.pop(MULTIPROC_DIR, None)
        if core is not None and core.poll() is None:
            try:
                core.wait(30)  # it ends once its last API server shut down
            except subprocess.TimeoutExpired:
                core.kill()
                core.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        if args.uds:
            remove_socket_file(args.uds)


def _supervise(servers: list, core: subprocess.Popen) -> int:
    """Wait for the API servers; pass signals on; one that exits unasked stops the rest. Exit status: 0
    after a drain, 2 when none could start (the engine could not be built: each said why), else 1."""
    stopping = False
    status = 0

    def stop(*_):
        nonlocal stopping
        stopping = True
        for server in servers:
            if server.is_alive():
                os.kill(server.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        alive = list(servers)
        while alive:
            wait([server.sentinel for server in alive], timeout=1.0)
            for server in [s for s in alive if not s.is_alive()]:
                alive.remove(server)
                code = server.exitcode
                # asked to stop: 0 after its drain, or SIGTERM's own death where it came before the server
                # had set up its handler (still starting, so nothing to drain)
                if not stopping or code not in (0, -signal.SIGTERM):
                    status = 1
                    if alive and not stopping:
                        print(f"ERROR: graphdecode: {server.name} exited ({_how(code)}); stopping the other API "
                              f"servers, exit status 1", file=sys.stderr, flush=True)
                        stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if all(server.exitcode == 2 for server in servers):
        return 2
    return status


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"


def run_api_server(args, run_server, index: int, count: int, requests, outputs, sock: socket.socket,
                   parent: int) -> None:
    """One API server process: the app over its pipes to the core, on the shared socket."""
    os.setpgrp()  # a terminal's Ctrl+C goes to the parent, which passes it on once
    if sys.platform.startswith("linux"):  # the parent's death is a SIGTERM: drain, do not linger
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            sys.exit(1)  # the parent died before the request took hold
    try:
        engine = AsyncLLM.attached(requests, outputs)
    except ValueError as exc:
        print(f"graphdecode: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(run_server(args, engine, sockets=[sock], label=f"API server {index + 1}/{count} ",
                        log_stats=index == 0))  # one stats line for the one core
