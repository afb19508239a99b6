"""Where the server listens: a TCP port (--host/--port) or a Unix domain socket (--uds). The socket is bound
here when several API servers share it (api_servers.py), and for a single server's --uds (openai_api.run_server,
which removes the file at exit); uvicorn binds a single server's TCP port itself."""

from __future__ import annotations

import os
import socket
import stat


def bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--port: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def bind_unix(path: str) -> socket.socket:
    """A --uds socket (a stale socket file replaced, as uvicorn does), readable and writable by all as
    uvicorn makes its own."""
    remove_socket_file(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o666)
    except OSError as exc:
        sock.close()
        raise ValueError(f"--uds: cannot listen on {path!r}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def remove_socket_file(path: str) -> None:
    """Remove a --uds socket file (at exit: uvicorn replaces a stale one at start, but leaves its own)."""
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.remove(path)
    except OSError:
        pass
