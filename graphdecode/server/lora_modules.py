"""The server's LoRA adapters (vLLM's): served by name, listed by /v1/models, loaded and unloaded at run time.

`--lora-modules name=path` (or vLLM's JSON form, '{"name": ..., "path": ..., "base_model_name": ...}') names
each adapter a request may send as its `model`; each is checked against the model at start-up (a bad one stops
the server with one line). With VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, POST /v1/load_lora_adapter
({"lora_name", "lora_path"}) adds one and POST /v1/unload_lora_adapter ({"lora_name"}) removes one, as vLLM's
server does; requests already running with an unloaded adapter finish with it.
"""

from __future__ import annotations

import argparse
import json
import os

from pydantic import BaseModel, ConfigDict

from ..lora.request import LoRARequest
from .errors import APIError

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_int_id: int | None = None  # vLLM's request carries it; the name decides


def lora_module(text: str) -> LoRARequest:
    """argparse type of one --lora-modules entry: name=path, or a JSON object with name and path."""
    try:
        if text.lstrip().startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                    or not isinstance(value.get("path"), str):
                raise ValueError("a JSON entry needs string 'name' and 'path'")
            name, path, base = value["name"], value["path"], value.get("base_model_name")
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError("expected name=path")
            base = None
        return LoRARequest(name, 1, path, base)  # ids are given in order by LoRAModules
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


class LoRAModules:
    """name -> LoRARequest, each with its own int id (a new id for a name loaded again: its files may differ)."""

    def __init__(self, engine, modules: list[LoRARequest], base_names: tuple[str, ...]):
        self.engine = engine
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        for module in modules:
            try:
                self.add(module.lora_name, module.lora_path, module.base_model_name)
            except APIError as e:
                raise ValueError(f"--lora-modules: {e.message}") from None

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A new adapter, checked against the model; APIError naming the field."""
        if name in self.by_name or name in self.base_names:
            raise APIError(f"lora_name: {name!r} is already served", param="lora_name")
        try:
            lora = LoRARequest(name, self._next_id, path, base_model_name)
            self.engine.inputs.loras.check(lora)
        except (ValueError, TypeError) as e:  # the name's own check, else the adapter's files
            raise APIError(str(e), param="lora_name" if ".lora_name " in str(e) else "lora_path") from None
        self._next_id += 1
        self.by_name[name] = lora
        return lora

    def remove(self, name: str) -> None:
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise APIError(f"lora_name: no adapter {name!r} is served", status=404, type="not_found_error",
                           param="lora_name")
        self.engine.inputs.loras.forget(lora)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models' entries of the adapters (vLLM's: root the adapter's path, parent the base model)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "graphdecode",
                 "root": lora.lora_path, "parent": lora.base_model_name or self.base_names[0],
                 "max_model_len": max_model_len} for name, lora in self.by_name.items()]
