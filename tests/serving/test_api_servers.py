"""`--api-server-count 2`: two API server processes share the port in front of one engine core; /metrics
adds them up; SIGTERM drains both and exits 0; a killed API server takes the set down with status 1.
`--uds`: a server on a Unix domain socket instead of a port, for the real openai client through it."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import stat
import time

import httpx
import openai
import pytest

from graphdecode.server.launch import start_server, stop_server
from graphdecode.server.listen import bind_unix, remove_socket_file
from tests.helpers import one_line_cli_error, signalled_mid_stream

MODEL = "multi"


def _start(text_model, log, *extra):
    return start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1", "--no-access-log",
                         "--log-level", "warning", "--api-server-count", "2", "-k", "2", "--max-model-len", "512",
                         *extra], str(log), timeout_s=180)


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of each child of `pid`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return out


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process tree from /proc")
def test_two_api_servers_one_core_metrics_added_up_and_a_killed_server_ends_the_set(text_model, tmp_path):
    log = tmp_path / "server.log"
    proc, url = _start(text_model, log)
    try:
        children = _children(proc.pid)
        servers = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
        cores = [pid for pid, cmd in children.items() if "graphdecode.server.engine_core" in cmd]
        assert len(servers) == 2 and len(cores) == 1, children

        def complete(i: int) -> int:  # a fresh connection each: the kernel hands them to either server
            body = {"model": MODEL, "prompt": f"Request number {i} says", "max_tokens": 3, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Connection": "close"}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            prompt_tokens = sum(pool.map(complete, range(16)))
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        prompt_tokens += chat.json()["usage"]["prompt_tokens"]
        for _ in range(4):  # whichever server answers the scrape, the counters are both servers'
            assert _counter(url, "graphdecode:generation_tokens_total") == 16 * 3 + 2
            assert _counter(url, "graphdecode:request_success_total") == 17
            assert _counter(url, "graphdecode:prompt_tokens_total") == prompt_tokens

        os.kill(servers[0], signal.SIGKILL)
        assert proc.wait(60) == 1  # the other server and the core go down with it: a supervisor restarts all
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(pid) for pid in (servers[1], cores[0])):
            time.sleep(0.1)
        assert not _alive(servers[1]) and not _alive(cores[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "exited (killed by SIGKILL); stopping the other API servers" in open(log).read()


def test_sigterm_drains_every_api_server_then_exits_0(text_model, tmp_path):
    proc, url = _start(text_model, tmp_path / "server.log", "--shutdown-timeout", "30")
    try:
        body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 300, "stream": True,
                "ignore_eos": True}
        finish = []
        with signalled_mid_stream(url, body, proc, signal.SIGTERM) as lines:
            for line in lines:
                if line.startswith("data: {"):
                    finish.append(json.loads(line[6:])["choices"][0]["finish_reason"])
        assert finish[-1] == "length"  # the running request ran to its end
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_api_server_count_is_checked(capsys):
    line = one_line_cli_error(capsys, ["serve", "--api-server-count", "0"])
    assert "--api-server-count must be >= 1, got 0" in line



def test_a_server_on_a_unix_socket(text_model, tmp_path):
    """--uds: the openai client through the socket file (streamed and whole), no TCP port listening, the file
    removed once SIGTERM drained the server; a stale socket file left by a killed server is replaced."""
    path = str(tmp_path / "gd.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # what a killed server leaves behind
    stale.close()
    log = tmp_path / "server.log"
    proc, url = start_server(["--model", text_model, "--served-model-name", MODEL, "--threads", "1",
                              "--log-level", "warning", "-k", "2", "--max-model-len", "256", "--uds", path], str(log),
                             timeout_s=180)
    port = int(proc.args[proc.args.index("--port") + 1])  # given, and ignored for the socket
    try:
        assert url == "http://localhost" and stat.S_ISSOCK(os.stat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=60) as http, \
                openai.OpenAI(base_url=f"{url}/v1", api_key="x", http_client=http, max_retries=0) as client:
            whole = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=5, temperature=0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt="Hi there", max_tokens=5, temperature=0, stream=True))
            assert whole.choices[0].finish_reason == "length" and streamed == whole.choices[0].text
            assert http.get(f"{url}/health").status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert f"serving {MODEL!r} (max_model_len 256) on unix:{path}" in log.read_text()
    finally:
        assert stop_server(proc, 40) == 0, log.read_text()
    assert not os.path.exists(path)


def test_several_api_servers_share_one_unix_socket(tmp_path):
    """The socket --api-server-count binds for its servers: connections to the file reach a listener that any
    process holding it accepts from; permissions as uvicorn's own; removed by the same helper."""
    path = str(tmp_path / "shared.sock")
    sock = bind_unix(path)
    try:
        sock.listen()
        assert sock.get_inheritable() and stat.S_IMODE(os.stat(path).st_mode) == 0o666
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        conn, _ = sock.accept()
        client.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        conn.close()
        client.close()
    finally:
        sock.close()
    remove_socket_file(path)
    assert not os.path.exists(path)
    (tmp_path / "plain").write_text("x")
    remove_socket_file(str(tmp_path / "plain"))  # only ever a socket
    assert (tmp_path / "plain").exists()


@pytest.mark.parametrize("uds, fragment", [
    ("/no/such/folder/gd.sock", "--uds: the folder '/no/such/folder' does not exist"),
    (__file__, "exists and is not a socket (it would not be replaced)"),
    ("/tmp/" + "x" * 120, "is longer than a Unix socket's address holds (107 bytes)"),
    ("gd\0.sock", "--uds: 'gd\\x00.sock' holds a NUL character"),
])
def test_a_bad_uds_is_refused_by_name(capsys, uds, fragment):
    assert fragment in one_line_cli_error(capsys, ["serve", "--uds", uds], clean=True)
