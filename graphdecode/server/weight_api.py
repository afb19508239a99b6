"""The server's weight-update routes, for reinforcement-learning loops (SGLang's names), on with
VLLM_SERVER_DEV_MODE=1 (vLLM's switch for its development and RLHF routes; off, they are 404s: whoever reaches
the port could otherwise swap the model):

    POST /update_weights_from_disk  {"model_path", "weight_version"?, "abort_all_requests"?: false}
        -> 200 {"success": true, "message", "weight_version", "updated", "skipped"}
        -> 400 {"success": false, "message"} naming what was refused (nothing was written)
    GET  /get_weight_version        -> {"weight_version"}

and vLLM's pause routes, for an update in several parts:

    POST /pause?mode=abort|wait&clear_cache=true   -> {"is_paused": true} once nothing runs
         (vLLM's older ?wait_for_inflight_requests=true is mode=wait)
    POST /resume                                   -> {"is_paused": false}
    GET  /is_paused                                -> {"is_paused"}

The update waits for the running requests to finish (or aborts them) and holds new ones until the weights are
in (server/weight_sync.py); with --data-parallel-size every replica updates.
"""

from __future__ import annotations

import os

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from .errors import APIError

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False


def weight_updates_allowed() -> bool:
    return os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true")


def add_weight_routes(app, server, engine) -> None:
    if not weight_updates_allowed():
        return

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await server.parse(request, UpdateWeightsFromDiskRequest)
        try:
            update = await engine.update_weights_from_disk(body.model_path, body.weight_version,
                                                           body.abort_all_requests)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return {"success": True, "message": f"weights updated to version {update.weight_version}",
                **update.as_dict()}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": await engine.get_weight_version()}

    @app.post("/pause")
    async def pause(mode: str | None = None, clear_cache: bool = True, wait_for_inflight_requests: bool = False):
        try:
            await engine.pause_generation(mode or ("wait" if wait_for_inflight_requests else "abort"), clear_cache)
        except (ValueError, TypeError) as exc:
            raise APIError(str(exc), param="mode") from None
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        await engine.resume_generation()
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await engine.is_paused()}
