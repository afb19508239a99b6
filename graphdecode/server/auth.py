"""API keys (`--api-key`, or the VLLM_API_KEY environment variable, as vLLM reads them).

With keys set, every route but the probes (/health, /ping, /load, /version, /metrics) answers 401
unless the request carries one of them, as `Authorization: Bearer KEY` (the OpenAI clients' header) or
`x-api-key: KEY` (the Anthropic clients'). A route added later is guarded too: only the probes are
listed. CORS preflights (OPTIONS) pass, since browsers send them without credentials. Keys are kept
as SHA-256 digests and compared in constant time, each of them every time, so neither the keys nor
which one matched can be read from response times.
"""

from __future__ import annotations

import hashlib
import os
import secrets

API_KEY_ENV = "VLLM_API_KEY"
PUBLIC_PATHS = ("/health", "/ping", "/load", "/version", "/metrics")


def api_keys(given: list[str] | None) -> list[str]:
    """The keys of `--api-key` (one or more), else VLLM_API_KEY's one; [] when neither is set. An empty key is
    a ValueError naming where it came from (it would make the server look protected while letting anyone in
    who sends an empty bearer token)."""
    keys = list(given) if given else ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) is not None else [])
    for key in keys:
        if not key.strip():
            where = "--api-key" if given else API_KEY_ENV
            raise ValueError(f"{where}: an API key must not be empty or blank")
    return keys


def _public(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


class ApiKeyAuth:
    """ASGI middleware: 401 in the shape of the path's API for a guarded route without a valid key."""

    def __init__(self, app, keys: list[str], error_response):
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]
        self.error_response = error_response  # (APIError, path) -> an ASGI response

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        sent = []
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    sent.append(token.strip())
            elif name == b"x-api-key":
                sent.append(value.strip())
        ok = False
        for token in sent:
            digest = hashlib.sha256(token).digest()
            for known in self.digests:
                ok |= secrets.compare_digest(digest, known)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if _public(path) or self.authorized(scope["headers"]):
            await self.app(scope, receive, send)
            return
        from .errors import APIError  # (not at the top: server/args.py imports this module, and stays light)

        err = APIError("a valid API key is needed: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                       status=401, type="authentication_error", code="invalid_api_key")
        await self.error_response(err, path)(scope, receive, send)
