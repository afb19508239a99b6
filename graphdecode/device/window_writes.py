"""WindowWrites: the one registered set of tensors a decode window may write.

A window writes its decode state (DecodeState: inputs, positions, done flags, outputs, token
counts, automaton states, token history, ...), whatever the model counts as it runs (the MoE
layers' per-expert token counters), and the KV cache. Graph capture runs a real warm-up window
first, possibly while live rows sit in the decode state (a variant captured lazily); it saves
this set before and restores it after, so the warm-up leaves no trace. The KV cache is not in
the set on purpose: a window's K/V writes land at or past each row's position (or on the
scratch page), and the next real window rewrites those slots before anything reads them.

Everything a window may write is registered here by its owner (`register`), and nothing else:
tests/device/test_graph_twin.py runs a window and checks that every tensor it changed, outside the KV
cache, is in the set, so the next piece of window state cannot leak past a capture unseen.
"""

from __future__ import annotations

import torch


class WindowWrites:
    def __init__(self):
        self._tensors: dict[str, torch.Tensor] = {}

    def register(self, owner: str, tensors: dict[str, torch.Tensor | None]) -> None:
        """Add `owner`'s window-written tensors (None entries: not allocated, skipped)."""
        for name, tensor in tensors.items():
            if tensor is not None:
                self._tensors[f"{owner}.{name}"] = tensor

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory is (inside) a registered tensor's."""
        start = tensor.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == start for t in self._tensors.values())

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self._tensors.items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in saved.items():
            self._tensors[name].copy_(t)
