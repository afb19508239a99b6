"""Scheduler: admissions, prefill chunks, lookahead pages, preemption; its plan is its only output.

Sequence-native. State: a queue of waiting groups (by arrival or by priority), the admitted groups still
prefilling (admission order), the running sequences by row (admission order), and a
free-row heap. Per call the work is O(running + admitted + preempted + chunked):
nothing here walks the waiting queue or finished requests.

A group is a list of sequences that share their tokens at admission: the n children of
a fresh request (prefilled once by seqs[0], then forked) or one preempted sequence
(recomputed from its prompt and the tokens it produced).

Admission: the leader's full pages found in the prefix cache count as computed (never
its last token: it is recomputed for the logits), and so do the first tokens of its next
page when a cached page there starts with them (a partial hit: its first chunk copies
their K/V, see plan.PrefixCopy; the source page is held until the step is planned); the
group then gets every page it needs for its tokens, its first sampled token and one
window (children share the leader's full pages and get their own copy of a partial last
page), and rows are reserved for it. Its tokens are then prefilled in chunks: per step at most
`max_num_batched_tokens` prefill tokens over all groups, oldest group first. The decode
window of the running rows launches in every step regardless, so a long prompt never
stalls them. The last chunk samples the first token of every sequence of the group,
which then take their rows and join that same step's window.

Before a window every running sequence holds pages for `num_scheduled_tokens + k`
tokens, so the device never needs the host inside a window. When pages run out, work is
preempted: with scheduling_policy "fcfs" the most recently admitted (a prefilling group
first, else the newest running sequence), with "priority" the lowest-priority work
(the highest `priority` value, then the latest arrival, then the latest admission)
among the prefilling groups and running sequences, an O(running) choice. The victim
frees its pages (those in the prefix cache stay findable) and goes back to the queue
(host/waiting_queue.py: the front for FCFS, its own place by priority); in-flight
tokens of a running victim are discarded (its row epoch no longer matches) and
recomputed, which gives the same tokens because sampling noise depends only on (seed,
position, token). The waiting queue admits in arrival order (FCFS) or by (priority,
arrival).

The plan (plan.py) says all of it to the runner: rows cleared since the last
plan (finished, aborted, preempted, retired), rows started, block tables grown,
prefill chunks, the window's bucket.

Pages enter the prefix cache as soon as the work that computes them is scheduled: a
prefill chunk's full pages when the chunk is planned, a running sequence's pages when
the host has seen the token after their last one (a token's K/V is written when it is
fed back). A request admitted later in the same step may therefore hit pages that this
step's prefill computes: its chunk comes after theirs in the same forward, whose every
layer writes all of the batch's K/V before any of it attends (and makes its partial-hit
copies in between), and everything of a later step follows in stream order. So a hit
never reads K/V that is not yet written, and 200 requests arriving together with one
long prefix compute it once.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..plan import PrefillChunk, PrefixCopy, PromptReadout, Readout, RowStart, StepPlan, TableGrowth, WindowSpec
from .lora_slots import LoRASlots
from .page_pool import PagePool, page_key
from .sequence import Sequence
from .state_slots import StateSlots
from .waiting_queue import make_waiting_queue


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def group_pages(num_tokens: int, n: int, max_len: int, page_size: int, window_tokens: int) -> int:
    """Pages a group needs at admission without cache hits: tokens + first token + one window."""
    total = pages_for(min(num_tokens + 1 + window_tokens, max_len), page_size)
    shared = num_tokens // page_size if n > 1 else 0
    return total + (n - 1) * (total - shared)


def _count_preemption(seq: Sequence) -> None:
    metrics = seq.request.metrics
    if metrics is not None:
        metrics.num_preemptions += 1


@dataclass(eq=False, slots=True)
class PrefillGroup:
    seqs: list[Sequence]  # seqs[0], the leader, computes the chunks; the others fork at the last one
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # (leader's partial page, child's copy)
    prefix_copy: PrefixCopy | None = None  # a partial prefix hit, copied by the first chunk
    # a hybrid's recurrent state: where the first chunk starts from (0: zeros; s: snapshot slot s), and the
    # token counts after which its state is snapshotted (host/state_slots.py)
    state_from: int | None = 0
    snapshot_at: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config, pool: PagePool, tables=None):
        self.tables = tables  # the structured-outputs table store: its uploads travel in the plan (or None)
        self.window_tokens = config.window_tokens  # most tokens a row gains per window (k, or k (d + 1))
        self.num_decode_steps = config.num_decode_steps  # ... and the fewest (one per round)
        self.spec_history = config.spec_history  # rows need their token history on the device
        self.page_size = config.page_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.pool = pool
        buckets = config.buckets
        self._bucket_of = [next(b for b in buckets if b >= size) for size in range(buckets[-1] + 1)]
        self.waiting = make_waiting_queue(config.scheduling_policy)
        self.by_priority = config.scheduling_policy == "priority"
        self.prefilling: dict[int, PrefillGroup] = {}  # leader seq_id -> group, admission order
        self._group_of: dict[int, PrefillGroup] = {}  # seq_id -> its prefilling group
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, oldest admission first
        self._free_rows = list(range(config.max_batch_size))  # a heap: lowest row first keeps buckets small
        # a hybrid's recurrent-state slots and the prefix cache's state snapshots (host/state_slots.py)
        self.states = None
        if config.model_config.linear is not None:
            self.states = StateSlots(config.max_batch_size, config.num_state_snapshots, config.page_size)
            pool.on_forget = self.states.forget
        # a LoRA engine's adapters in the device's slots (host/lora_slots.py)
        self.loras = LoRASlots(config.max_loras) if config.enable_lora else None
        self._reserved_rows = 0  # rows promised to prefilling groups
        self._epoch = 0
        self._cleared: list[int] = []  # rows released since the last plan
        self._copy_sources: list[int] = []  # pages partial hits copy from in this step's prefill
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # tokens found there

    # ----------------------------------------------------------------- queue
    def add(self, group: list[Sequence]) -> None:
        if group[0].request.lora is not None:
            self.loras.arrived(group[0].request)
        self.waiting.push(group)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.prefilling) or bool(self.running)

    def group_pages(self, num_tokens: int, n: int, max_len: int) -> int:
        return group_pages(num_tokens, n, max_len, self.page_size, self.window_tokens)

    # -------------------------------------------------------------- schedule
    def schedule(self, speculate: Callable[[int, list[Sequence]], bool] | None = None) -> StepPlan:
        """speculate: the speculation policy, asked once the window's bucket and rows are known (rows
        joining this step included) whether the window speculates (None: it does not). With a policy,
        the lookahead covers k (d + 1) tokens a row, as the window may speculate; the counters
        advance by what the chosen window can add."""
        plan = StepPlan()
        if self.states is not None:
            self.states.commit()
        if self.tables is not None:  # constraints placed since the last plan, uploaded before their rows start
            plan.table_uploads = self.tables.take_uploads()
        self._retire_drained()
        if not self._reserve_lookahead(plan, self._adds(speculate is not None)):
            self._schedule_prefills(plan)
        decode = any(not s.is_draining for s in self.running.values())
        started = {start.row for start in plan.started_rows}
        if decode or started:
            top = max(s.row for s in self.running.values()) + 1
            bucket = self._bucket_of[top]
            speculative = decode and speculate is not None and speculate(bucket, list(self.running.values()))
            plan.window = WindowSpec(bucket=bucket, decode=decode, speculative=speculative)
            if decode:
                window_tokens = self._adds(speculative)
                for seq in self.running.values():
                    seq.num_scheduled_tokens = min(seq.num_scheduled_tokens + window_tokens, seq.max_len)
                    seq.num_assured_tokens = min(seq.num_assured_tokens + self.num_decode_steps, seq.max_len)
                plan.readout += [Readout(s.row, s, s.epoch, 1) for s in self.running.values() if s.row not in started]
        plan.cleared_rows, self._cleared = self._cleared, []
        if self.loras is not None:  # adapters this step's admissions load, before anything of the step runs
            plan.lora_loads = self.loras.take_loads()
        # what later steps allocate is written after this step's copies, in stream order
        self.pool.free(self._copy_sources)
        self._copy_sources.clear()
        return plan

    def _retire_drained(self) -> None:
        """Release sequences whose every remaining token is already covered by launched work.

        The device finishes them inside the windows in flight (done flags freeze them), so
        their row and pages can serve the next window right away: stream order puts any
        reuse after those windows, and their outputs were already copied out. They stay
        unfinished on the host (epoch unchanged) until their tokens are pythonized.
        """
        for seq in [s for s in self.running.values() if s.is_draining]:
            self._release(seq)

    def _adds(self, speculative: bool) -> int:
        """The most tokens a decode window adds to a row: k (d + 1) speculating, else k."""
        return self.window_tokens if speculative else self.num_decode_steps

    def _reserve_lookahead(self, plan: StepPlan, window_tokens: int) -> int:
        """Pages for one more window (window_tokens per row) for every running sequence; returns
        the number of preemptions."""
        preempted = 0
        for seq in list(self.running.values()):
            if not seq.is_running:
                continue
            need = pages_for(min(seq.num_scheduled_tokens + window_tokens, seq.max_len), self.page_size)
            need -= len(seq.pages)
            if need <= 0:
                continue
            while self.pool.num_free < need and seq.is_running:
                self._preempt()
                preempted += 1
            if seq.is_running:
                start = len(seq.pages)
                new_pages = self.pool.allocate(need)
                seq.pages.extend(new_pages)
                plan.grown_tables.append(TableGrowth(seq.row, start, tuple(new_pages)))
        return preempted

    def _schedule_prefills(self, plan: StepPlan) -> None:
        budget = self.max_num_batched_tokens
        for group in list(self.prefilling.values()):
            if budget <= 0:
                return
            budget -= self._chunk(group, budget, plan)
        while budget > 0 and self.waiting:
            group = self.waiting.peek()
            if all(s.is_finished for s in group):  # aborted while waiting
                self.waiting.pop()
                continue
            admitted = self._admit(group)
            if admitted is None:
                return
            self.waiting.pop()
            budget -= self._chunk(admitted, budget, plan)

    # -------------------------------------------------------------- admission
    def _admit(self, group: list[Sequence]) -> PrefillGroup | None:
        """Pages and reserved rows for a waiting group, cache hits first; None if they do not fit."""
        if len(self._free_rows) - self._reserved_rows < len(group):
            return None
        leader = group[0]
        num_tokens, size = leader.num_tokens, self.page_size
        hits, source, partial = [], 0, 0
        # prompt logprobs come from prefill's logits: such a request computes its whole prompt
        if not leader.request.needs_prompt_logprobs and self.pool.enable_caching:
            hits = self.pool.lookup(self._keys(leader, (num_tokens - 1) // size))
            start = len(hits) * size  # then the tokens of the next page, short of the last token
            parent = leader.page_keys[len(hits) - 1] if hits else leader.request.cache_root
            source, partial = self.pool.partial_lookup(parent, leader.token_ids[start : min(start + size, num_tokens) - 1])
        state_from, cached = 0, len(hits) * size
        if self.states is not None:  # a hybrid: pages ending in a state snapshot, and no partial page (mid-page state)
            usable, state_from = self.states.usable_hits(hits, leader.page_keys)
            hits, source, partial = hits[:usable], 0, 0
        # the most one window can add (k (d + 1) with speculation): the window the group joins
        # may be speculative, and the lookahead reserved for it does not cover joining rows
        total = pages_for(min(num_tokens + 1 + self.window_tokens, leader.max_len), size)
        shared = num_tokens // size if len(group) > 1 else 0
        new = total - len(hits) + (len(group) - 1) * (total - shared)
        held = hits + [source] if partial else hits
        if self.pool.free_after_sharing(held) < new:
            return None
        request = leader.request
        if request.lora is not None:
            if not self.loras.acquire(group, request.lora, request.lora_adapter):
                return None  # every adapter slot is held by other adapters' rows: it waits for one
            self.loras.left_queue(request)
        self.pool.share(held)
        if partial:  # held until this step is planned: no allocation of this step may take it
            self._copy_sources.append(source)
        computed = len(hits) * size + partial
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += computed
        if leader.request.num_cached_tokens is None:  # vLLM's: the first admission's hits
            leader.request.num_cached_tokens = computed
        leader.pages = hits + self.pool.allocate(total - len(hits))
        leader.num_computed_tokens = computed
        leader.num_cached_pages = len(hits)
        placed = PrefillGroup(seqs=group)
        if partial:
            placed.prefix_copy = PrefixCopy(source, leader.pages[len(hits)], partial)
        for child in group[1:]:
            self.pool.share(leader.pages[:shared])
            own = self.pool.allocate(total - shared)
            if num_tokens % size:
                placed.page_copies.append((leader.pages[shared], own[0]))
            child.pages = leader.pages[:shared] + own
        self._reserved_rows += len(group)
        if self.states is not None:  # never short: every holder holds a row or a reserved one
            for seq in group:
                self.states.take(seq)
            placed.state_from = state_from
            if self.pool.enable_caching:
                placed.snapshot_at = self.states.boundaries(computed, cached, num_tokens)
        metrics = leader.request.metrics
        if metrics is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.time()
        self.prefilling[leader.seq_id] = placed
        for seq in group:
            self._group_of[seq.seq_id] = placed
        return placed

    def _chunk(self, group: PrefillGroup, budget: int, plan: StepPlan) -> int:
        """Schedule the group's next chunk within `budget` tokens; returns its length."""
        leader = group.seqs[0]
        start, num_tokens = leader.num_computed_tokens, leader.num_tokens
        end = min(num_tokens, start + budget)
        if group.snapshot_at and group.snapshot_at[0] < end:
            end = group.snapshot_at[0]  # a chunk ends where a state snapshot is taken
        leader.num_computed_tokens = end
        self._cache_pages(leader)  # later admissions of this step may hit them: see the module docstring
        snapshot = 0
        if group.snapshot_at and group.snapshot_at[0] == end:
            group.snapshot_at.pop(0)
            snapshot = self.states.reserve(self._keys(leader, end // self.page_size)[-1])
        rows = ()
        if end == num_tokens:
            self._list_partial_page(leader)
            for child in group.seqs[1:]:
                child.page_keys = list(leader.page_keys)  # same tokens so far: the same keys
            rows = tuple(self._start(seq, plan) for seq in group.seqs)
            del self.prefilling[leader.seq_id]
            for seq in group.seqs:
                del self._group_of[seq.seq_id]
        request, top, targets = leader.request, None, ()
        if request.needs_prompt_logprobs:  # position j predicts prompt token j + 1
            top = request.params.prompt_logprobs
            targets = tuple(request.prompt_token_ids[start + 1 : min(end, len(request.prompt_token_ids) - 1) + 1])
            plan.prompt_readout.append(PromptReadout(request, start, len(targets)))
        plan.prefill_chunks.append(PrefillChunk(
            token_ids=tuple(leader.token_ids[start:end]),
            start=start,
            pages=tuple(leader.pages[: pages_for(end, self.page_size)]),
            sample_rows=rows,
            page_copies=tuple(group.page_copies) if rows else (),
            prompt_logprobs=top,
            targets=targets,
            prefix_copy=group.prefix_copy,
            next_token=leader.token_ids[end] if end < len(leader.token_ids) else None,
            state_slot=leader.state_slot,
            state_forks=tuple(child.state_slot for child in group.seqs[1:]) if rows and leader.state_slot else (),
            state_from=group.state_from if leader.state_slot else None,
            state_snapshot=snapshot,
            lora_slot=leader.lora_slot,
        ))
        group.prefix_copy = None
        group.state_from = None
        return end - start

    def _start(self, seq: Sequence, plan: StepPlan) -> int:
        """The sequence takes a row: its first token is sampled by this step's prefill."""
        row = heapq.heappop(self._free_rows)
        self._reserved_rows -= 1
        params = seq.request.params
        seq.row = row
        seq.epoch = self._epoch
        self._epoch += 1
        seq.num_computed_tokens = seq.num_tokens
        seq.num_scheduled_tokens = seq.num_assured_tokens = seq.num_tokens + 1
        self.running[seq.seq_id] = seq
        plan.started_rows.append(RowStart(
            row=row,
            position=seq.num_tokens,
            pages=tuple(seq.pages),
            params=params,
            seed=seq.seed,
            stop_ids=seq.stop_ids,
            max_len=seq.max_len,
            min_len=seq.num_prompt_tokens + params.min_tokens,
            token_ids=tuple(seq.token_ids) if params.needs_penalties or self.spec_history
            or seq.request.placement is not None else (),
            num_prompt_tokens=seq.num_prompt_tokens,
            structured=seq.request.placement,
            state_slot=seq.state_slot,
            lora_slot=seq.lora_slot,
        ))
        plan.readout.append(Readout(row, seq, seq.epoch, 0))
        return row

    # ------------------------------------------------------------ prefix cache
    def _keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The prefix-cache keys of the sequence's first `count` full pages (computed once)."""
        keys, size = seq.page_keys, self.page_size
        while len(keys) < count:
            i = len(keys)
            parent = keys[-1] if keys else seq.request.cache_root
            keys.append(page_key(parent, seq.token_ids[i * size : (i + 1) * size]))
        return keys[:count]

    def _cache_pages(self, seq: Sequence) -> None:
        """Offer the sequence's computed full pages to the prefix cache."""
        full = min(seq.num_computed_tokens // self.page_size, len(seq.pages))
        if seq.num_cached_pages >= full or not self.pool.enable_caching:
            return
        keys, size = self._keys(seq, full), self.page_size
        for i in range(seq.num_cached_pages, full):
            parent = keys[i - 1] if i else seq.request.cache_root
            self.pool.cache_page(seq.pages[i], keys[i], parent, seq.token_ids[i * size : (i + 1) * size],
                                 seq.request.lora)
        seq.num_cached_pages = full

    def _list_partial_page(self, seq: Sequence) -> None:
        """A prompt's last, partial page becomes a partial-hit candidate once its prefill is
        planned: requests sharing a prefix that ends inside it (arriving with it, or while it
        is held) copy those tokens instead of computing them."""
        full, size = seq.num_tokens // self.page_size, self.page_size
        if seq.num_tokens % size and self.pool.enable_caching:
            parent = self._keys(seq, full)[full - 1] if full else seq.request.cache_root
            self.pool.list_child(seq.pages[full], parent, seq.token_ids[full * size : seq.num_tokens])

    def cache_decoded(self, seqs, launched: StepPlan | None = None) -> None:
        """After pythonizing: a token's K/V is written once it is fed back, so every token but
        the last one the host holds is computed. launched: the plan launched since, whose window
        every running row that did not start in it is in: the device will hold at most what that
        window can add to what the host now holds, so the upper bound comes down to that (a
        speculative window reserved k (d + 1) tokens a row and may have kept k: pages are
        reserved against the bound)."""
        adds, started = None, set()
        if launched is not None:
            window = launched.window
            adds = self._adds(window.speculative) if window is not None and window.decode else 0
            started = {start.row for start in launched.started_rows}
        for seq in seqs:
            if seq.pages and seq.is_running:
                seq.num_computed_tokens = max(seq.num_computed_tokens, seq.num_tokens - 1)
                if adds is not None and seq.row not in started:
                    seq.num_scheduled_tokens = min(seq.num_scheduled_tokens, seq.num_tokens + adds)
                self._cache_pages(seq)

    # ------------------------------------------------------- leaving the batch
    def finish(self, seq: Sequence) -> None:
        if seq.request.lora_waiting:  # it ends before its first admission (aborted while waiting)
            self.loras.left_queue(seq.request)
        if seq.is_running:
            seq.num_computed_tokens = max(seq.num_computed_tokens, seq.num_tokens - 1)
            self._cache_pages(seq)
            self._release(seq)
            return
        group = self._group_of.get(seq.seq_id)
        if group is not None and all(s.is_finished for s in group.seqs):  # aborted while prefilling
            self._drop_group(group)

    def _preempt(self) -> None:
        """Preempt one victim (see the module docstring for which)."""
        group, seq = self._victim()
        if group is not None:
            self._drop_group(group)
            for s in group.seqs:
                s.num_computed_tokens = 0
            self.waiting.push_front(group.seqs)
            _count_preemption(group.seqs[0])
        else:
            _count_preemption(seq)
            self._release(seq)
            seq.epoch = -1  # tokens of windows in flight are void: they will be recomputed
            seq.num_computed_tokens = 0
            seq.num_scheduled_tokens = seq.num_assured_tokens = seq.num_tokens
            self.waiting.push_front([seq])
        self.num_preemptions += 1

    def _victim(self) -> tuple[PrefillGroup | None, Sequence | None]:
        """(a prefilling group, None) or (None, a running sequence)."""
        if not self.by_priority:
            if self.prefilling:
                return next(reversed(self.prefilling.values())), None
            return None, next(reversed(self.running.values()))
        best, best_key = (None, None), None
        for group in self.prefilling.values():  # admission order: on ties the later one wins
            key = (group.seqs[0].request.priority, group.seqs[0].request.arrival)
            if best_key is None or key >= best_key:
                best, best_key = (group, None), key
        for seq in self.running.values():
            key = (seq.request.priority, seq.request.arrival)
            if best_key is None or key >= best_key:
                best, best_key = (None, seq), key
        return best

    def _drop_group(self, group: PrefillGroup) -> None:
        """A prefilling group leaves: its pages go back (cached ones stay findable), its rows unreserved."""
        del self.prefilling[group.seqs[0].seq_id]
        self._reserved_rows -= len(group.seqs)
        for seq in group.seqs:
            del self._group_of[seq.seq_id]
            self.pool.free(seq.pages)
            seq.pages = []
            seq.num_cached_pages = 0
            self._free_state(seq)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.pages)
        seq.pages = []
        seq.num_cached_pages = 0
        self._free_state(seq)
        self._cleared.append(seq.row)
        heapq.heappush(self._free_rows, seq.row)
        seq.row = None
        del self.running[seq.seq_id]

    def _free_state(self, seq: Sequence) -> None:
        """A hybrid sequence's state slot goes back (a later admission zeroes it before its first chunk), and its
        hold on its LoRA adapter's slot."""
        if self.states is not None:
            self.states.give_back(seq)
        if self.loras is not None:
            self.loras.release(seq)

    @property
    def num_free_state_slots(self) -> int | None:
        """State slots not held by a sequence (None: not a hybrid model)."""
        return None if self.states is None else self.states.num_free
