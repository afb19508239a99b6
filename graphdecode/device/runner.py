"""ModelRunner: owns the model, KV cache, decode state and windows; applies a StepPlan.

`execute(plan)` is the runner's whole interface to the scheduler. It applies the plan's
rows (cleared, started, grown block tables) to the staging mirrors, enqueues, in stream
order, the staged copies, the prefill chunks (the last chunk of a sequence samples its
first token into output column 0), the decode window and the async copy of the
outputs, and returns without waiting.

What the device needs is decided here, from the rows the runner holds: the sampler
variant (one RowCounts over the live rows; another over a prefill's sampled rows) and
the KV width an eager torch-reference window gathers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..attention import ForwardContext, PrefillMetadata, TorchAttentionBackend
from ..attention.kv_cache import allocate_kv_caches, copy_page
from ..attention.state_cache import StateCache
from ..lora.model import LoRAModel
from ..models.cpu_linear import packed_bytes
from ..models.loader import load_model
from ..models.moe import moe_stats
from ..models.parallel import TPGroup, local_kv_heads
from ..models.weight_update import WeightWriter
from ..plan import PrefillChunk, StepPlan
from ..ranges import annotate
from .advance_step import use_cuda_kernel
from .bounds import BoundsCheck
from .decode_state import DecodeState
from .draft_head import DraftHead
from .draft_model import DraftModel
from .drafters import NgramDrafter
from .graphs import WindowGraphs
from .host_memory import keep_freed_host_memory
from .pythonizer import PendingCopy, Pythonizer
from .row_staging import RowStaging
from .sampler import RowCounts, Sampler
from .torch_compile import CompiledForward
from .window import sample_into
from .window_writes import WindowWrites


def make_backend(name: str, kv_caches, num_heads: int, num_kv_heads: int, head_dim: int, device, specs=None,
                 dtype=None, batch_invariant: bool = True):
    """dtype: the model's (the queries'); None: the caches' (an FP8 cache needs it named). batch_invariant:
    FlashInfer's prefill plans never split the KV (its decode and verify plans never do)."""
    if name == "flashinfer":
        from ..attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(kv_caches, num_heads, num_kv_heads, head_dim, device=device, specs=specs, dtype=dtype,
                                 batch_invariant=batch_invariant)
    return TorchAttentionBackend(kv_caches, num_heads, num_kv_heads, head_dim, specs=specs, dtype=dtype)


class ModelRunner:
    def __init__(self, config, tp: TPGroup = TPGroup()):
        """tp: this rank of a tensor-parallel group (its shard of the weights and KV heads);
        every rank's runner applies the same plans and holds the same decode state."""
        cfg = config.model_config
        self.config = config
        self.tp = tp
        self.device = config.torch_device
        if tp.size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # its local index (tp_rank.init_rank)
        self.page_size = config.page_size
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # this process's (a rank's) torch threads
            keep_freed_host_memory()  # CPU windows reuse freed memory instead of faulting it in again
        if self.device.type == "cuda":
            use_cuda_kernel()  # advance_step's CUDA kernel (the torch reference if it cannot be built)
        self.model = load_model(config.model, cfg, config.torch_dtype, self.device, config.max_model_len, tp,
                                batch_invariant=config.batch_invariant, huge_pages=config.cpu_huge_pages)
        # a LoRA engine's projections take each row's adapter (lora/model.py): before any forward is captured
        self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, config.batch_invariant) \
            if config.enable_lora else None
        num_heads, num_kv_heads = cfg.num_heads // tp.size, local_kv_heads(cfg.num_kv_heads, tp)
        self.kv_caches = allocate_kv_caches(
            cfg.num_layers, config.num_pages, config.page_size, num_kv_heads, cfg.head_dim,
            config.kv_torch_dtype, self.device, cfg.kv_layers_of(tp.stage.layers),  # a stage: its layers' pages
        )
        # a hybrid's recurrent states: a slot per admitted sequence (every one holds a row or a reserved row)
        self.states = None
        if cfg.linear is not None:
            self.states = StateCache(cfg.linear.local(tp.size), len(self.model.linear_layers),  # a stage's own
                                     config.max_batch_size + 1 + config.num_state_snapshots, config.torch_dtype,
                                     self.device)
            self.model.bind_states(self.states)
            if config.num_speculative_tokens:
                self.model.hold_verified(config.max_batch_size, config.num_speculative_tokens + 1)
        self.backend = make_backend(config.attention_backend, self.kv_caches, num_heads, num_kv_heads, cfg.head_dim,
                                    self.device, getattr(self.model, "attention_specs", None), config.torch_dtype,
                                    config.batch_invariant)
        self.state = DecodeState(
            config.max_batch_size, config.max_pages_per_seq, config.max_stop_ids,
            config.num_decode_steps, config.logprobs_width, self.device,
            vocab_size=cfg.vocab_size, max_logit_bias=config.max_logit_bias,
            bad_word_slots=2 * config.max_bad_words, max_bad_word_tokens=config.max_bad_word_tokens,
            spec_tokens=config.num_speculative_tokens,
            history_len=config.max_model_len + config.num_speculative_tokens + 1 if config.spec_history else 0,
            structured_max_states=config.structured_max_states,
            structured_max_exceptions=config.structured_max_exceptions,
            lora=config.enable_lora,
        )
        if config.check_bounds:
            self.state.bounds = BoundsCheck(config.max_model_len, config.page_size, config.num_pages,
                                            config.max_batch_size + 1 if self.states is not None else 0,
                                            config.max_loras + 1 if config.enable_lora else 0)
        self.staging = RowStaging(self.state, self.device)
        self.row_counts = RowCounts(config.logprobs_width)  # what the live rows need of the sampler
        self._row_params: list = [None] * config.max_batch_size  # each live row's SamplingParams
        self._row_pages = np.zeros(config.max_batch_size, dtype=np.int64)  # block-table length per row
        self._prompt_results: list = []  # this step's prompt logprobs (device tensors), copied out with it
        self.sampler = Sampler(cfg.vocab_size, self.device, config.logprobs_mode)
        self.window_writes = WindowWrites()  # everything a window may write (KV cache aside)
        self.window_writes.register("state", self.state.window_tensors())
        self.window_writes.register("model", self.model.window_tensors())
        # speculative windows' drafts: a draft model, an EAGLE-3 head or the target's MTP layer (their own K/V in
        # the rows' pages), or the rows' history
        method = config.speculative_method
        self.draft = (DraftModel(config, self.device) if method == "draft_model"
                      else DraftHead(config, self.model, self.device) if method in ("eagle3", "mtp") else None)
        self.head = self.draft if isinstance(self.draft, DraftHead) else None
        if self.draft is not None:
            self.window_writes.register("draft", self.draft.window_tensors())
        self._draft_behind = np.zeros(config.max_batch_size, dtype=np.int64)  # steps each row ran without it
        drafter = (self.draft.drafter(self.sampler) if self.draft is not None
                   else NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min))
        # a draft head reads the target's hidden states from every window forward
        logits_fn = self.model.decode_logits if self.head is None else self.head.logits_fn(self.model)
        if config.compile:
            logits_fn = CompiledForward(logits_fn)
        self.windows = WindowGraphs(
            logits_fn, self.sampler, self.backend, self.state,
            buckets=config.buckets, num_decode_steps=config.num_decode_steps, page_size=config.page_size,
            use_graphs=config.cuda_graphs, writes=self.window_writes,
            drafter=drafter,
            commit_states=self.model.commit_verified if self.states is not None else None,
            # micro-batched plain windows, but where a draft head follows every plain step (draft_head.py)
            pipeline=(self.model, config.pp_micro_batches)
            if tp.stage.size > 1 and config.pp_micro_batches > 1 and self.head is None else None,
        )
        self.pythonizer = Pythonizer(self.state, self.device)
        with torch.inference_mode():
            if config.cuda_graphs:
                self.windows.capture_all()
            elif config.compile:
                self.windows.warm_up()

    def execute(self, plan: StepPlan) -> PendingCopy | None:
        self._apply_rows(plan)
        self.staging.flush(self.state)
        if plan.prefill_chunks:
            with annotate("graphdecode.prefill"):
                self.pythonizer.start_prefill()
                self.prefill(plan.prefill_chunks)
                self.pythonizer.end_prefill(sum(len(c.token_ids) for c in plan.prefill_chunks))
        window, prompt_results = plan.window, self._prompt_results
        self._prompt_results = []
        if window is None and not prompt_results:
            return None  # nothing sampled this step (prefill chunks that are not a sequence's last)
        variant = self.row_counts.variant()
        if window is not None and window.decode:
            if window.speculative and not variant.penalties:  # penalties would count every draft
                variant = dataclasses.replace(variant, speculative=True)
            with annotate("graphdecode.window"):
                width = self._kv_width()
                if isinstance(self.draft, DraftModel):
                    self._keep_draft_current(window.bucket, variant.speculative, width)
                self.pythonizer.start_window()
                self.windows.run(window.bucket, variant, width, self._ragged(window.bucket, width))
        bucket = window.bucket if window is not None else 0
        return self.pythonizer.enqueue(bucket, with_logprobs=variant.num_logprobs > 0, extras=prompt_results,
                                       speculative=variant.speculative)

    def stats(self) -> dict:
        """The device side's counters (EngineStats' names; engine.stats() merges them)."""
        windows = self.windows
        out = {
            "seconds_blocked": self.pythonizer.seconds_blocked,
            "staged_rows": self.staging.num_rows_staged,
            "staging_flushes": self.staging.num_flushes,
            "staging_seconds_blocked": self.staging.seconds_blocked,
            "compile_seconds": windows.compile_seconds,
            "compile_warm_start": getattr(windows.logits_fn, "warm_start", None),
            "capture_seconds": windows.capture_seconds,
            "graphs_captured": len(windows.graphs),
            "graph_memory_bytes": windows.graph_memory_bytes,
            "cpu_attention_kernels": self.backend.reads_pages_in_place,  # CPU: pages read in place
        }
        out.update(moe_stats(self.model))
        return out

    def update_weights(self, weights) -> tuple[list[str], list[str]]:
        """New values for this rank's weights, in place (models/weight_update.py): every tensor checked before any
        is written; (names written, names skipped). Only between windows: the engine drains them first."""
        return self.write_weights(*self.check_weights(weights))

    def check_weights(self, weights) -> tuple[WeightWriter, list, list[str]]:
        """(the writer, its targets, names skipped): every tensor checked (ValueError naming it), none written."""
        writer = WeightWriter(self.model)
        return writer, *writer.check(weights)

    def write_weights(self, writer: WeightWriter, targets: list, skipped: list[str]) -> tuple[list[str], list[str]]:
        with torch.inference_mode():
            writer.write(targets)
        return list(dict.fromkeys(target.key for target in targets)), skipped

    def memory_sizes(self) -> dict:
        """Bytes this rank holds: its weights and its KV cache."""
        models, caches = [self.model], list(self.kv_caches)
        if self.draft is not None:
            models.append(self.draft.model)
            caches += self.draft.kv_caches
        return {
            "weight_bytes": sum(_tensor_bytes(m.parameters()) + packed_bytes(m) for m in models)
            + (self.lora.nbytes if self.lora is not None else 0),  # a LoRA engine's adapter slots
            "kv_cache_bytes": _tensor_bytes(caches),
            "state_cache_bytes": self.states.nbytes if self.states is not None else 0,
        }

    # ------------------------------------------------------------ device rows
    def _apply_rows(self, plan: StepPlan) -> None:
        for load in plan.lora_loads:  # after every launched window that read the slot, in stream order
            self.lora.load(load.slot, load.adapter)
        for upload in plan.table_uploads:  # before the rows that read them, in stream order
            self.state.constraints.upload(upload)
        for row in plan.cleared_rows:
            params = self._row_params[row]
            if params is not None:
                self.row_counts.remove(params)
                self._row_params[row] = None
            self._row_pages[row] = 0
            self.staging.clear_row(row)
        for start in plan.started_rows:
            self._draft_behind[start.row] = 0  # its prefill writes the draft's K/V too
            self.staging.set_row(start)
            self.row_counts.add(start.params)
            self._row_params[start.row] = start.params
            self._row_pages[start.row] = len(start.pages)
        for growth in plan.grown_tables:
            self.staging.set_pages(growth.row, growth.start, growth.pages)
            self._row_pages[growth.row] = growth.start + len(growth.pages)

    def _keep_draft_current(self, bucket: int, speculative: bool, width: int) -> None:
        """Before a speculative window, the draft model catches up on what plain windows decoded without
        it (at most k tokens a row per window); a plain window adds k to each held row's count."""
        behind = self._draft_behind[:bucket]
        if not speculative:
            behind[[p is not None for p in self._row_params[:bucket]]] += self.config.num_decode_steps
            return
        span = min(int(behind.max()), self.config.max_model_len)  # no row is behind by more than it holds
        if span:
            with annotate("graphdecode.draft_catch_up"):
                self.draft.catch_up(self.state, bucket, self._send(behind), span, self.page_size, width)
            behind[:] = 0

    def _ragged(self, bucket: int, width: int) -> bool:
        """Eager CPU windows of the gathering reference attend ragged when padding to the longest
        row would more than double the pages gathered (compiled forwards and graphs keep static
        shapes; the CPU kernel reads each row's own pages anyway)."""
        if self.windows.compiled or self.windows.use_graphs or self.device.type != "cpu" \
                or self.backend.reads_pages_in_place:
            return False
        return bucket * width > 2 * int(self._row_pages[:bucket].sum())

    def _kv_width(self) -> int:
        """Pages an eager torch-attention window gathers per row: the longest block table,
        rounded up to a power of two, and at least 2 (a compiled forward specialises a
        dimension of size 1, so width 1 would compile again). Graphs, and a backend that
        reads pages in place, take every column (static shapes, nothing gathered)."""
        if self.backend.reads_pages_in_place:
            return self.state.max_pages
        longest = int(self._row_pages.max())
        return min(max(2, 1 << max(longest - 1, 0).bit_length()), self.state.max_pages)

    # ---------------------------------------------------------------- prefill
    def prefill(self, chunks: list[PrefillChunk]) -> None:
        page_size = self.page_size
        query_lens = [len(c.token_ids) for c in chunks]
        kv_lens = [c.end for c in chunks]
        width = max(len(c.pages) for c in chunks)
        table = np.zeros((len(chunks), width), dtype=np.int32)
        positions, slots = [], []
        for i, c in enumerate(chunks):
            pages = np.asarray(c.pages, dtype=np.int64)
            table[i, : len(pages)] = pages
            pos = np.arange(c.start, c.end, dtype=np.int64)
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        tokens = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=sum(query_lens))
        cu = np.zeros(len(chunks) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=cu[1:])
        table_host = self._host(table)
        copies = [c.prefix_copy for c in chunks if c.prefix_copy is not None]
        copy_src = copy_dst = None
        if copies:  # partial prefix hits: made in every layer between write and attend
            src, dst = _copy_slots(copies, page_size)
            copy_src, copy_dst = self._send(src), self._send(dst)
        meta = PrefillMetadata(
            cu_query_lens=self._send(cu),
            seq_lens=self._send(np.asarray(kv_lens, dtype=np.int32)),
            block_table=table_host.to(self.device, non_blocking=True),
            slot_mapping=self._send(np.concatenate(slots)),
            query_lens_host=query_lens,
            seq_lens_host=kv_lens,
            block_table_host=table_host,
            copy_src=copy_src,
            copy_dst=copy_dst,
            state_slots_host=[c.state_slot for c in chunks],
            lora_slots=self._send(np.repeat(np.asarray([c.lora_slot for c in chunks], dtype=np.int64), query_lens))
            if self.lora is not None else None,
        )
        if self.states is not None:  # a sequence's first chunk starts from zeros, or from a prefix hit's snapshot
            fresh = [c.state_slot for c in chunks if c.state_from == 0]
            if fresh:
                self.states.reset(self._send(np.asarray(fresh, dtype=np.int64)))
            self._copy_states([(c.state_from, c.state_slot) for c in chunks if c.state_from])
        self.backend.plan_prefill(meta)
        ctx = ForwardContext(self.backend, prefill=meta)
        token_ids, position_ids = self._send(tokens), self._send(np.concatenate(positions))
        if self.head is not None:  # the head's K/V over the same positions, reading the target's hidden states
            hidden, aux = self.model.forward_for_head(token_ids, position_ids, ctx, self.head.reads)
            following = [c.next_token if c.next_token is not None else c.token_ids[-1] for c in chunks]
            ahead = np.fromiter((t for c, last in zip(chunks, following) for t in (*c.token_ids[1:], last)),
                                dtype=np.int64, count=len(tokens))
            self.head.prefill(self._send(ahead), aux, position_ids, meta)
        else:
            hidden = self.model(token_ids, position_ids, ctx)
        if isinstance(self.draft, DraftModel):  # the draft's K/V for the same tokens, in the same pages
            self.draft.prefill(token_ids, position_ids, meta)
        for i, c in enumerate(chunks):
            if c.prompt_logprobs is not None:
                self._prompt_results.append(self._prompt_logprobs(c, hidden, int(cu[i])))
        # prefix-cache snapshots of the chunks' final states; n > 1: each child continues from the prompt's
        self._copy_states([(c.state_slot, c.state_snapshot) for c in chunks if c.state_snapshot]
                          + [(c.state_slot, child) for c in chunks for child in c.state_forks])
        sampled = [i for i, c in enumerate(chunks) if c.sample_rows]
        if sampled:
            self._sample_first_tokens([chunks[i] for i in sampled], hidden, cu[1:][sampled] - 1)
        copies = [copy for c in chunks for copy in c.page_copies]
        if copies:
            src, dst = zip(*copies)
            src, dst = self._send(np.asarray(src)), self._send(np.asarray(dst))
            copy_page(self.kv_caches, src, dst)
            if self.draft is not None:
                self.draft.copy_pages(src, dst)
        if self.head is not None and sampled:  # the head at each new row's last prompt position, in its own pages
            counts = [len(chunks[i].sample_rows) for i in sampled]
            rows = self._send(np.asarray([r for i in sampled for r in chunks[i].sample_rows], dtype=np.int64))
            last = self._send(np.repeat(cu[1:][sampled] - 1, counts).astype(np.int64))
            ends = self._send(np.repeat([chunks[i].end - 1 for i in sampled], counts).astype(np.int64))
            self.head.start_rows(self.state, rows, ends, aux[last])

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy recurrent-state slots (source, destination) in every linear layer."""
        if pairs:
            src, dst = zip(*pairs)
            self.states.copy(self._send(np.asarray(src, dtype=np.int64)), self._send(np.asarray(dst, dtype=np.int64)))

    def _prompt_logprobs(self, chunk: PrefillChunk, hidden, offset: int):
        """Raw logprobs of the prompt tokens the chunk's positions predict, their ranks and the top N."""
        count = len(chunk.targets)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[offset : offset + count]), dim=-1)  # [c, V]
        targets = self._send(np.asarray(chunk.targets, dtype=np.int64))
        chosen = logprobs.gather(1, targets[:, None])[:, 0]
        rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        top, top_ids = logprobs.topk(chunk.prompt_logprobs, dim=-1) if chunk.prompt_logprobs else (None, None)
        return (chosen, rank) + ((top, top_ids) if top is not None else ())

    def _sample_first_tokens(self, chunks: list[PrefillChunk], hidden, last_index: np.ndarray) -> None:
        """Each chunk's last position gives the first token of its sequences (n > 1: n rows)."""
        logits = self.model.compute_logits(hidden[self._send(last_index.astype(np.int64))])  # [G, V]
        counts = [len(c.sample_rows) for c in chunks]
        row_list = [row for c in chunks for row in c.sample_rows]
        rows = self._send(np.asarray(row_list, dtype=np.int64))
        next_pos = self._send(np.repeat(np.asarray([c.end for c in chunks], dtype=np.int64), counts))
        variant = RowCounts(self.config.logprobs_width, (self._row_params[r] for r in row_list)).variant()
        row_logits = logits[self._send(np.repeat(np.arange(len(chunks)), counts).astype(np.int64))]
        tokens = sample_into(self.state, self.sampler, row_logits, rows, 0, next_pos, variant, None)
        self.state.input_ids[rows] = tokens

    def _host(self, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(array)
        return host.pin_memory() if self.device.type == "cuda" else host

    def _send(self, array: np.ndarray) -> torch.Tensor:
        return self._host(array).to(self.device, non_blocking=True)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _copy_slots(copies, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Slot pairs of the plan's partial-hit copies, which apply in plan order: a copy whose
    source slot an earlier copy of the same forward fills reads that copy's source (one
    gather then one scatter would otherwise read the slot before it is filled)."""
    root: dict[int, int] = {}  # destination slot -> the slot its K/V comes from
    src, dst = [], []
    for copy in copies:
        base_src, base_dst = copy.source * page_size, copy.destination * page_size
        for i in range(copy.num_tokens):
            s = root.get(base_src + i, base_src + i)
            root[base_dst + i] = s
            src.append(s)
            dst.append(base_dst + i)
    return np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
