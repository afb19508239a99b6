"""The server's weight-update routes, for reinforcement-learning loops (SGLang's names), on with
VLLM_SERVER_DEV_MODE=1 (vLLM's switch for its development and RLHF routes; off, they are 404s: whoever reaches
the port could otherwise swap the model):

    POST /update_weights_from_disk  {"model_path", "weight_version"?, "abort_all_requests"?: false}
        -> 200 {"success": true, "message", "weight_version", "updated", "skipped"}
        -> 400 {"success": false, "message"} naming what was refused (nothing was written)
    GET  /get_weight_version        -> {"weight_version"}

The update waits for the running requests to finish (or aborts them) and holds new ones until the weights are
in (server/weight_sync.py); with --data-parallel-size every replica updates.
"""

from __future__ import annotations

import os

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

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
