"""Weight updates between rollouts (reinforcement learning): what an update did, and the version it names. The
engine applies them (Engine.update_weights), the model writes them in place
(models/weight_update.py, which also reads a checkpoint directory's tensors); docs/weight_updates.md tells the whole
story."""

from __future__ import annotations

from dataclasses import dataclass


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
