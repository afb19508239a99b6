"""Build a model from a HuggingFace directory: config.json + safetensors (one file or shards).

Parameters are created on the meta device and materialised directly on the target
device, then filled tensor by tensor from the checkpoint, fusing q/k/v and
gate/up on the way in.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from .model_config import ModelConfig
from .registry import model_class

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: no model.safetensors or model.safetensors.index.json in {model_dir!r}")


def load_model(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int):
    cls = model_class(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                if key == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                name, shard = _target(key, cls.packed_modules)
                if name not in params:
                    raise ValueError(f"weights: checkpoint tensor {key!r} has no place in {cls.__name__}")
                tensor = f.get_tensor(key)
                param = params[name]
                if shard is None:
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"weights: {key!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                        )
                    param.data.copy_(tensor)
                    loaded.add(name)
                else:
                    modules[name.rsplit(".", 1)[0]].load_shard(param, shard, tensor)
                    loaded.add(f"{name}:{shard}")
    _check_complete(model, params, loaded)
    model.init_rotary(max_positions)
    model.eval()
    return model


def _target(key: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for fragment, (fused, shard) in packed.items():
        marker = f".{fragment}."
        if marker in key:
            return key.replace(marker, f".{fused}."), shard
    return key, None


def _check_complete(model, params: dict, loaded: set[str]) -> None:
    modules = dict(model.named_modules())
    for name in params:
        owner = modules[name.rsplit(".", 1)[0]]
        shards = getattr(owner, "shard_offsets", None)
        needed = [f"{name}:{s}" for s in shards] if shards else [name]
        missing = [n for n in needed if n not in loaded]
        if missing:
            raise ValueError(f"weights: checkpoint lacks {missing[0]!r}")
