"""How an answer goes out: JSON bodies (compact, non-ASCII as is) and server-sent event streams.

A stream is `data: {...}` chunks, then `data: [DONE]`; an error after its start is one more
chunk, `data: {"error": ...}`, before [DONE]. SSE chunks are plain dicts through the encoder
(no pydantic on the way out). The stream's response always closes its chunk iterator, even
when the client left while a chunk was being sent: closing it is what aborts the engine
requests.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from .serving import outputs_error

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body: dict) -> Response:
    return Response(dumps(body), media_type="application/json")


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client left
    while a chunk was being sent (closing it is what aborts the engine request)."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def event_stream(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    """The response streaming `chunks` (each a whole `data: ...\\n\\n` event) as server-sent events."""
    return _SSEResponse(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)


def error_event(exc: Exception) -> bytes:
    """What a stream that has started sends for an exception out of its outputs (serving.outputs_error)."""
    return b"data: " + dumps(outputs_error(exc).body()).encode() + b"\n\n"
