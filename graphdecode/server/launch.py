"""Start `graphdecode serve` as a subprocess and stop it: for scripts, benchmarks and tests.

    proc, url = start_server(["--model", model_dir, "-k", "8"], "server.log")
    ...  # talk to url + "/v1/completions"
    stop_server(proc)  # SIGTERM (graceful: unfinished requests end), then the exit status

The server's output goes to `log_path`; a server that exits or does not answer
`/health` in time raises RuntimeError with that log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from ..device.tp_rank import free_port


def start_server(args: list[str], log_path: str, timeout_s: float = 600.0, env: dict | None = None,
                 poll_s: float = 0.2, cwd: str | None = None, verify=True) -> tuple[subprocess.Popen, str]:
    """Run `python -m graphdecode.server.openai_api --port <free port> *args` (in `cwd`, which `-m` puts first on
    the import path); return (process, base url) once /health answers (asked every poll_s seconds). With
    --ssl-certfile the url is https, its certificate checked by `verify` (httpx's: True, an ssl.SSLContext, False);
    with --uds PATH it is http://localhost, reached through the socket (httpx.HTTPTransport(uds=PATH))."""
    port = free_port()
    cmd = [sys.executable, "-m", "graphdecode.server.openai_api", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    uds = args[args.index("--uds") + 1] if "--uds" in args else None
    url = f"{'https' if '--ssl-certfile' in args else 'http'}://{'localhost' if uds else f'127.0.0.1:{port}'}"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1, verify=verify, transport=httpx.HTTPTransport(uds=uds, verify=verify)
                      if uds else None) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{_read(log_path)}")
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not come up in {timeout_s:.0f} s:\n{_read(log_path)}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM, then SIGKILL after timeout_s; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""
