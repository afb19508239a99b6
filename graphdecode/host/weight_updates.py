"""Weight updates between rollouts (reinforcement learning): the engine's weights version and where new weights
come from. The engine applies them (Engine.update_weights), the model writes them in place
(models/weight_update.py); docs/weight_updates.md tells the whole story."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightUpdate:
    """What an update did: the engine's weights version after it, the tensors written and those skipped (parts the
    engine does not run: a vision tower, MTP layers, a tied lm_head.weight), by their names."""

    weight_version: str
    updated: int
    skipped: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"weight_version": self.weight_version, "updated": self.updated, "skipped": list(self.skipped)}


def check_version(weight_version) -> str | None:
    """A version a caller gave (None: the engine numbers it)."""
    if weight_version is None:
        return None
    if not isinstance(weight_version, str) or not weight_version.strip():
        raise TypeError(f"weight_version: must be a non-empty str, got {weight_version!r}")
    return weight_version


def checkpoint_tensors(model_path) -> dict[str, torch.Tensor]:
    """Every tensor of a HuggingFace checkpoint directory (model.safetensors, or the shards its index lists), read
    into host memory: ValueError naming model_path if it is not one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..models.loader import checkpoint_files

    if not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f"model_path: must be a path, got {type(model_path).__name__}")
    path = os.fspath(model_path)
    if not os.path.isdir(path):
        raise ValueError(f"model_path: {path!r} is not a directory")
    try:
        files = checkpoint_files(path)
    except ValueError as e:
        raise ValueError(f"model_path: {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(file)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model_path: {file} cannot be read ({e})") from None
        clash = next((key for key in part if key in tensors), None)
        if clash is not None:
            raise ValueError(f"model_path: tensor {clash!r} is in more than one file of {path}")
        tensors.update(part)
    return tensors
