"""A draft model for speculative decoding (`speculative_config={"method": "draft_model", "model": DIR}`).

A smaller checkpoint of a supported family with the target's vocabulary, loaded beside the
target on the same device in the same dtype, replicated on every tensor-parallel rank (it is
small; each rank drafts the same tokens from the same inputs). Its KV caches have the target
pool's geometry (num_pages x page_size, its own layers and heads), so a row's block table
indexes both: the draft's K/V lives in the row's own pages, freed with them, shared with them
on a prefix-cache hit, copied with them when n > 1 forks a page, rebuilt with them after a
preemption. The pool's bytes per page count both models (config.py sizes it).

The draft runs only in speculative windows. After windows that ran plain (the policy's choice,
or a row needing penalties) its K/V misses their tokens; before the next speculative window the
runner calls `catch_up`, one eager forward that rewrites the draft's K/V over each such row's
last positions from the row's history on the device (like a prefill chunk, outside the graph),
so plain windows cost nothing extra.

Its attention is always the torch backend (the CPU kernels on a CPU): a graph-capturable verify
over the block table, with no per-shape plans, so the draft's two query shapes per round need
nothing planned; the target keeps its own backend.
"""

from __future__ import annotations

import torch

from ..attention import ForwardContext, PrefillMetadata, TorchAttentionBackend
from ..attention.kv_cache import allocate_kv_caches, copy_page
from ..models.loader import load_model
from .drafters import ModelDrafter
from .speculative import verify_metadata
from .torch_compile import CompiledForward


class DraftModel:
    def __init__(self, config, device: torch.device):
        cfg = config.draft_model_config
        self.model = load_model(config.draft_model, cfg, config.torch_dtype, device, config.max_model_len,
                                batch_invariant=config.batch_invariant, huge_pages=config.cpu_huge_pages)
        self.kv_caches = allocate_kv_caches(cfg.num_layers, config.num_pages, config.page_size, cfg.num_kv_heads,
                                            cfg.head_dim, config.torch_dtype, device)
        self.backend = TorchAttentionBackend(self.kv_caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             specs=getattr(self.model, "attention_specs", None))
        logits_fn = self.model.decode_logits
        self.logits_fn = CompiledForward(logits_fn) if config.compile else logits_fn

    def drafter(self, sampler) -> ModelDrafter:
        return ModelDrafter(self.logits_fn, self.backend, sampler)

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, meta: PrefillMetadata) -> None:
        """The draft's K/V for the chunk's tokens (the target's prefill metadata: same pages and slots,
        the same partial-prefix copies, applied to the draft's layers)."""
        self.backend.plan_prefill(meta)
        self.model(tokens, positions, ForwardContext(self.backend, prefill=meta))

    def catch_up(self, state, bucket: int, behind: torch.Tensor, span: int, page_size: int, kv_width: int) -> None:
        """The draft's K/V at positions p - span - 1 .. p - 1 of the rows with `behind` [B] > 0 (span >= the
        steps any row's last windows ran without the draft), from the rows' history: the span plain windows
        decoded, and the position before it, the last token of a speculative round whose every draft was
        accepted (the next round's first forward rewrites it, but the next window ran plain). Queries at or
        past p are inert (limit p: they write the scratch slot)."""
        position = state.positions[:bucket]
        span += 1
        start = (position - span).clamp(min=0)
        live = ~state.done[:bucket] & (behind > 0)
        meta = verify_metadata(state, bucket, span, page_size, kv_width, live, start=start, limit=position)
        if state.bounds is not None:
            state.bounds.verify(state, bucket, meta, start=start)
        history = state.speculation.history[:bucket]
        index = (start[:, None] + torch.arange(span, device=start.device)).clamp(max=history.shape[1] - 1)
        tokens = history.gather(1, index)
        self.model(tokens.reshape(-1), meta.query_positions.reshape(-1), ForwardContext(self.backend, verify=meta))

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_page(self.kv_caches, src, dst)

    def window_tensors(self) -> dict[str, torch.Tensor | None]:
        return self.model.window_tensors()
