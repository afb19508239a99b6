"""ModelRunner: owns the model, KV cache, decode state and windows; executes a WindowPlan.

`execute(plan)` enqueues, in stream order: the staged row changes, the prefill of
newly admitted groups (which samples each row's first token into output column 0),
the decode window, and the async copy of the outputs. It returns without waiting.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import ForwardContext, PrefillMetadata, TorchAttentionBackend
from ..attention.kv_cache import allocate_kv_caches, copy_page
from ..compiled import cuda_kernels
from ..compiled.decode_state import DecodeState
from ..compiled.graphs import WindowGraphs
from ..models.loader import load_model
from ..compiled.sampler import RowCounts, Sampler
from ..compiled.torch_compile import CompiledForward
from ..compiled.window import sample_into
from ..ranges import annotate
from .pythonizer import PendingCopy, Pythonizer
from .row_staging import RowStaging
from .scheduler import PrefillGroup, WindowPlan


def make_backend(name: str, kv_caches, cfg, device):
    if name == "flashinfer":
        from ..attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, device=device)
    return TorchAttentionBackend(kv_caches, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


class ModelRunner:
    def __init__(self, config):
        cfg = config.model_config
        self.config = config
        self.device = config.torch_device
        self.page_size = config.page_size
        if self.device.type == "cuda":
            cuda_kernels.register()  # advance_step's CUDA kernel (the torch reference if it cannot be built)
        self.model = load_model(config.model, cfg, config.torch_dtype, self.device, config.max_model_len)
        self.kv_caches = allocate_kv_caches(
            cfg.num_layers, config.num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim,
            config.torch_dtype, self.device,
        )
        self.backend = make_backend(config.attention_backend, self.kv_caches, cfg, self.device)
        self.state = DecodeState(
            config.max_batch_size, config.max_pages_per_seq, config.max_stop_ids,
            config.num_decode_steps, config.max_logprobs, self.device,
        )
        self.staging = RowStaging(self.state, self.device)
        self.sampler = Sampler(cfg.vocab_size, self.device)
        logits_fn = self.model.decode_logits
        if config.compile:
            logits_fn = CompiledForward(logits_fn)
        self.windows = WindowGraphs(
            logits_fn, self.sampler, self.backend, self.state,
            buckets=config.buckets, steps=config.num_decode_steps, page_size=config.page_size,
            max_logprobs=config.max_logprobs, use_graphs=config.cuda_graphs,
        )
        self.pythonizer = Pythonizer(self.state, self.device)
        with torch.inference_mode():
            if config.cuda_graphs:
                self.windows.capture_all()
            elif config.compile:
                self.windows.warm_up()

    def execute(self, plan: WindowPlan) -> PendingCopy | None:
        self.staging.flush(self.state)
        if plan.empty:
            return None
        if plan.prefills:
            with annotate("graphdecode.prefill"):
                self.prefill(plan.prefills)
        if plan.steps:
            with annotate("graphdecode.window"):
                self.windows.run(plan.bucket, plan.steps, plan.variant, plan.kv_width)
        return self.pythonizer.enqueue(plan.bucket, with_logprobs=plan.variant.num_logprobs > 0)

    # ---------------------------------------------------------------- prefill
    def prefill(self, groups: list[PrefillGroup]) -> None:
        page_size = self.page_size
        query_lens = [len(g.token_ids) for g in groups]
        width = max(len(g.seqs[0].pages) for g in groups)
        table = np.zeros((len(groups), width), dtype=np.int32)
        positions, slots = [], []
        for i, g in enumerate(groups):
            pages = np.asarray(g.seqs[0].pages, dtype=np.int64)
            table[i, : len(pages)] = pages
            pos = np.arange(query_lens[i], dtype=np.int64)
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        tokens = np.fromiter((t for g in groups for t in g.token_ids), dtype=np.int64, count=sum(query_lens))
        cu = np.zeros(len(groups) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        table_host = self._host(table)
        meta = PrefillMetadata(
            cu_query_lens=self._send(cu),
            seq_lens=self._send(np.asarray(query_lens, dtype=np.int32)),
            block_table=table_host.to(self.device, non_blocking=True),
            slot_mapping=self._send(np.concatenate(slots)),
            query_lens_host=query_lens,
            seq_lens_host=query_lens,
            block_table_host=table_host,
        )
        self.backend.plan_prefill(meta)
        ctx = ForwardContext(self.backend, prefill=meta)
        hidden = self.model(self._send(tokens), self._send(np.concatenate(positions)), ctx)
        last = hidden[meta.cu_query_lens[1:].long() - 1]  # [G, hidden]
        logits = self.model.compute_logits(last)  # [G, V]

        seqs = [s for g in groups for s in g.seqs]
        group_of_row = np.repeat(np.arange(len(groups)), [len(g.seqs) for g in groups])
        rows = self._send(np.asarray([s.row for s in seqs], dtype=np.int64))
        next_pos = self._send(np.repeat(np.asarray(query_lens, dtype=np.int64), [len(g.seqs) for g in groups]))
        variant = RowCounts(self.config.max_logprobs, (s.request.params for s in seqs)).variant()
        row_logits = logits[self._send(group_of_row.astype(np.int64))]
        tokens = sample_into(self.state, self.sampler, row_logits, rows, 0, next_pos, variant, None)
        self.state.input_ids[rows] = tokens
        copies = [c for g in groups for c in g.page_copies]
        if copies:
            src, dst = zip(*copies)
            copy_page(self.kv_caches, self._send(np.asarray(src)), self._send(np.asarray(dst)))

    def _host(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _send(self, array: np.ndarray) -> torch.Tensor:
        return self._host(array).to(self.device, non_blocking=True)
