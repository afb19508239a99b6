"""`--enable-request-id-headers` (vLLM's): every response carries an `X-Request-Id` header, the request's own
when it sent one (so a proxy's or client's id follows the request through the logs), else a fresh one."""

from __future__ import annotations

import uuid

HEADER = b"x-request-id"


class RequestIdHeaders:
    """ASGI middleware: the X-Request-Id header on every HTTP response, streamed ones included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == HEADER), None)
        request_id = given if given else uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
