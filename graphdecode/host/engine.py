"""Engine: the step loop. Each step is schedule -> run -> postprocess.

    plan    = scheduler.schedule(spec)    rows in/out, lookahead pages, prefill chunks, the window's bucket
                                          (spec: the speculation policy, asked about the window's rows)
    pending = executor.execute(plan)      stage rows, prefill, launch the window, copy out
                                          (with tensor parallelism the plan goes to every rank first)
    changed = postprocess(previous)       pythonize the PREVIOUS window while this one runs

Postprocessing lags one window behind the launch, so the device always has the next
window queued while the host turns tokens into text; `pending.result()` (the
pythonizer's wait) is where the host waits for the device's outputs (the only other wait
is the staging fence, device/row_staging.py, which returns at once in steady state).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from ..config import TOKENIZER_FILES
from ..device.executor import make_executor
from ..plan import Readout, StepPlan
from ..ranges import annotate
from .inputs import InputProcessor
from .output_processor import OutputProcessor
from .page_pool import PagePool
from .scheduler import Scheduler
from .sequence import Request, Sequence
from .spec_policy import SpecPolicy, any_sampled
from .structured_store import StructuredStore
from .weight_updates import WeightUpdate, check_version

logger = logging.getLogger("graphdecode")


def load_tokenizer(model_dir: str, tokenizer_dir: str | None = None):
    """The engine's tokenizer (transformers'): `tokenizer_dir`'s (EngineConfig.tokenizer, checked there), else
    the model directory's; None for a model directory without one (token ids in, token ids out)."""
    model_dir = str(tokenizer_dir or model_dir)
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError("tokenizer: graphdecode needs a fast (tokenizers-backed) tokenizer")
    return tokenizer


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # tokens run through prefill (prompts once per request, recomputes again)
    prefill_batches: int = 0  # steps that ran prefill chunks
    decode_tokens: int = 0  # tokens produced by decode windows that reached a user
    generated_tokens: int = 0  # all tokens that reached a user (prefill's first tokens included)
    first_token_prompt_tokens: int = 0  # each sequence's whole prompt, counted when its first token came out
    steps: int = 0  # engine steps (each launches at most one window)
    windows: int = 0  # decode windows launched
    window_rows: int = 0  # bucket rows over all windows (padding included)
    live_rows: int = 0  # rows holding a sequence over all windows
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (at admission)
    prefix_cache_hits: int = 0  # ... of which found there (not computed again)
    cached_pages: int = 0  # pages findable in the prefix cache now
    requests_finished: int = 0
    windows_per_bucket: dict = field(default_factory=dict)
    host_seconds_schedule: float = 0.0
    host_seconds_launch: float = 0.0
    host_seconds_pythonize: float = 0.0
    seconds_blocked: float = 0.0  # inside the pythonizer's wait (device not done yet)
    staged_rows: int = 0  # rows copied host -> device between windows
    staging_flushes: int = 0
    staging_seconds_blocked: float = 0.0  # waiting for a staging buffer's previous copy (two flushes old)
    compile_seconds: float = 0.0  # torch.compile (dynamo + inductor), at construction or lazily
    compile_warm_start: bool | None = None  # every compile's code came from the on-disk cache (None: no compile)
    capture_seconds: float = 0.0  # CUDA graph warm-ups and captures, compile time excluded
    graphs_captured: int = 0
    graph_memory_bytes: int = 0
    spec_windows: int = 0  # windows that ran the speculative variant
    spec_verifies: int = 0  # row-rounds of draft + verify
    spec_draft_tokens: int = 0  # drafts proposed
    spec_accepted_tokens: int = 0  # drafts accepted (emitted as plain decoding would have sampled them)
    spec_accepted_per_position: list[int] = field(default_factory=list)  # [d]: ... at each draft position


class Engine:
    def __init__(self, config):
        self.config = config
        self.tokenizer = load_tokenizer(str(config.model), config.tokenizer)
        self.executor = make_executor(config)  # the device side: one process, or every tensor-parallel rank
        self.pool = PagePool(config.num_pages, enable_caching=config.enable_prefix_caching)
        self.structured = StructuredStore(config.structured_max_states, config.structured_max_exceptions)
        self.scheduler = Scheduler(config, self.pool, self.structured)
        # speculative or plain, per window; eager CPU windows do no first-time work, so their first is timed too, and
        # run their live rows' queries alone (a compiled window keeps its bucket's shape)
        eager_cpu = config.torch_device.type == "cpu" and not config.compile
        self.spec_policy = SpecPolicy(enabled=config.num_speculative_tokens > 0, first_window_untimed=(
            not eager_cpu or bool(config.cuda_graphs)), live_queries=eager_cpu,
            draft_tokens=config.num_speculative_tokens, steps_per_window=config.num_decode_steps)
        self.inputs = InputProcessor(config, self.tokenizer, self.scheduler.group_pages)
        if config.sampling_defaults:
            logger.warning("graphdecode: a request that leaves a field out gets the model's recommended sampling "
                           "default %s (generation_config=%r; 'vllm' for SamplingParams' own)",
                           config.sampling_defaults, config.generation_config)
        self.outputs = OutputProcessor(self.tokenizer, self._on_finish)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self._inflight: tuple[StepPlan, object] | None = None  # the plan and its pending copy
        self._aborted: list[Sequence] = []  # ended by abort_request, reported by the next step
        self._arrivals = itertools.count()
        self._stats = EngineStats()
        self.weights = WeightUpdate("0", 0)  # the latest weight update (a fresh engine's weights: version "0")
        self._weight_updates = 0
        self.kv_events = None  # KV-cache events for routers (kv_events_config), published after each step
        if config.kv_events_config is not None:
            from .kv_events import KVEventPublisher

            self.pool.events = []
            self.kv_events = KVEventPublisher(config.kv_events_config, config.page_size, config.data_parallel_rank,
                                              "GPU" if config.torch_device.type == "cuda" else "CPU")

    # ------------------------------------------------------------- requests
    def prepare(self, prompt_text, prompt_ids, params, request_id=None, priority: int = 0,
                verified: bool = False, checked: bool = False, cache_salt: str | None = None,
                lora_request=None) -> Request:
        """Validate and build a request without adding it (raises ValueError or TypeError).
        verified: params is already a private copy (SamplingParams.submitted()); checked: the
        engine's checks already ran on it (host/inputs.py: Inputs.check), so they do not again."""
        arrival = next(self._arrivals)
        request_id = str(arrival) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        return self.inputs.prepare(request_id, prompt_text, prompt_ids, params, arrival, priority, verified, checked,
                                   cache_salt, lora_request)

    def add_request(self, prompt, params=None, request_id=None, priority: int = 0, lora_request=None) -> Request:
        (text, ids), = self.inputs.tokenize_all([prompt])
        salt = self.inputs.cache_salt(prompt)
        (request,) = self.add_requests([self.prepare(text, ids, params, request_id, priority, cache_salt=salt,
                                                     lora_request=lora_request)])
        return request

    def add_requests(self, requests: list[Request]) -> list[Request]:
        """Admit prepared requests, all or none: every constraint's tables are placed in the device's
        table store first (a ValueError naming the field, structured_outputs or allowed_token_ids, rolls back the ones placed before
        it; its `index` says which request did not fit); only then do the requests join the
        scheduler. The one admission call every front end makes."""
        for i, request in enumerate(requests):
            try:
                self.place_tables(request)
            except ValueError as e:
                for placed in requests[:i]:
                    self.release_tables(placed)
                e.index = i
                raise
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add(list(request.seqs))
        return requests

    def place_tables(self, request: Request) -> None:
        """Give a constrained request's automaton its room in the device's table store (ValueError
        naming its field when it does not fit beside the ones in flight)."""
        if request.automaton is not None and request.placement is None:
            request.placement = self.structured.acquire(request.automaton)

    def release_tables(self, request: Request) -> None:
        if request.placement is not None:
            self.structured.release(request.placement)
            request.placement = None

    def abort_request(self, request_id: str) -> Request | None:
        """End every unfinished sequence of the request with finish_reason 'abort'."""
        request = self.requests.get(str(request_id))
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._on_finish(seq)
                self._aborted.append(seq)
        return request

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's): the next prompts compute from scratch, as on a fresh engine; a
        router subscribed to KV events gets one AllBlocksCleared. Only between requests: while any sequence
        holds pages it does nothing and returns False. A window still in flight for requests already
        finished or aborted is pythonized first (its rows' pages are freed then)."""
        if self.requests:
            return False
        while self.has_unfinished():
            self.step()
        if not self.pool.reset_cache():
            return False
        if self.kv_events is not None:
            self.kv_events.publish(self.pool.take_events())
        return True

    def update_weights(self, weights, weight_version: str | None = None) -> WeightUpdate:
        """New values for the model's weights (reinforcement learning between rollouts; docs/weight_updates.md):
        `weights` pairs of checkpoint name and tensor (a trainer's named_parameters(), state_dict().items()) or a
        mapping, any subset of the weights. Every tensor is checked before any is written (ValueError naming it;
        the weights then stay as they were). Written in place, so graphs stay captured; the prefix cache is
        forgotten (its pages hold the old weights' K/V). Only between requests, as reset_prefix_cache: with a
        request unfinished it raises RuntimeError (AsyncLLM and the server wait for them). `weight_version`
        names the new weights (default: the count of updates, "1", "2", ...)."""
        return self._update_weights(lambda: self.executor.update_weights(weights), weight_version)

    def update_weights_from_disk(self, model_path, weight_version: str | None = None) -> WeightUpdate:
        """update_weights with every tensor of a checkpoint directory of the same architecture (a trainer's
        save_pretrained), read into host memory first (ValueError naming model_path if it is not one)."""
        return self._update_weights(lambda: self.executor.update_weights_from_disk(model_path), weight_version)

    def _update_weights(self, write, weight_version) -> WeightUpdate:
        version = check_version(weight_version)
        if self.requests:
            raise RuntimeError(f"update_weights: {len(self.requests)} request(s) are unfinished; update the "
                               f"weights between requests (AsyncLLM and the server wait for running ones)")
        while self.has_unfinished():  # a window still in flight for finished or aborted requests
            self.step()
        written, skipped = write()
        self.pool.reset_cache()
        if self.kv_events is not None:
            self.kv_events.publish(self.pool.take_events())
        self._weight_updates += 1
        self.weights = WeightUpdate(version or str(self._weight_updates), len(written), tuple(skipped))
        logger.info("graphdecode: weights updated to version %s (%d tensors, %d skipped)", self.weights.weight_version,
                    len(written), len(skipped))
        return self.weights

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished (vLLM's LLMEngine method)."""
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_unfinished(self) -> bool:
        """Work to schedule, a window to pythonize, or aborts not yet reported by a step."""
        return self.scheduler.has_work or self._inflight is not None or bool(self._aborted)

    # ------------------------------------------------------------------ step
    def step(self) -> list[Sequence]:
        """One window: returns the sequences that gained tokens or finished (aborts included)."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            with annotate("graphdecode.schedule"):
                plan = self.scheduler.schedule(self._speculate if self.spec_policy.enabled else None)
            t1 = time.perf_counter()
            with annotate("graphdecode.launch"):
                pending = self.executor.execute(plan)
            t2 = time.perf_counter()
            changed: list[Sequence] = []
            if self._inflight is not None:
                with annotate("graphdecode.pythonize"):
                    changed = self._postprocess(*self._inflight, launched=plan)
            t3 = time.perf_counter()
        self._inflight = (plan, pending) if pending is not None else None
        self._account(plan, t1 - t0, t2 - t1, t3 - t2)
        if self.kv_events is not None:
            self.kv_events.publish(self.pool.take_events())
        if self._aborted:
            changed = self._aborted + changed
            self._aborted = []
        return changed

    def _speculate(self, bucket: int, rows: list[Sequence]) -> bool:
        """The policy's choice for a window of these rows, asked by the scheduler once they are known; the
        requests still waiting for a row decide what a row finishing early is worth."""
        self.spec_policy.observe_queue(len(self.scheduler.waiting))
        return self.spec_policy.speculate(bucket, rows)

    @property
    def runner(self):
        """Rank 0's model runner, for tests and profiling (the engine speaks only to the executor)."""
        return self.executor.runner

    def close(self) -> None:
        """Stop the executor (tensor-parallel workers) and the constraint compile workers; the engine
        cannot step after it."""
        inputs = getattr(self, "inputs", None)  # None when construction failed before it
        if inputs is not None:
            inputs.close()
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.shutdown()

    def _postprocess(self, plan: StepPlan, pending, launched: StepPlan) -> list[Sequence]:
        """Pythonize the window of `plan` (`launched`: the step's plan, whose window is in flight)."""
        result = pending.result()
        if pending.extras:
            self.outputs.prompt_logprobs(plan.prompt_readout, pending.extras)
        decode = plan.window is not None and plan.window.decode
        timed = result.window_seconds is not None and self.spec_policy.enabled  # (the policy's only use of it)
        before = [r.seq.num_tokens for r in plan.readout] if timed and result.spec is None else None
        changed = self.outputs.process(plan.readout, decode, result, self._stats)
        if timed:
            if result.spec is None:  # a plain window: the steps its longest-lived row took tokens from
                live = max((r.seq.num_tokens - n - (r.first_column == 0) for r, n in zip(plan.readout, before)),
                           default=0)
                report = {}
            else:  # a speculative one: the rounds its longest-lived row verified
                live = max((int(result.spec[2, r.row]) for r in plan.readout if r.row < result.spec.shape[1]),
                           default=0)
                report = {"drafted": int(result.spec[0].sum()), "row_steps": int(result.spec[2].sum())}
            self.spec_policy.observe_window(pending.bucket, pending.speculative, result.window_seconds,
                                            any_sampled(r.seq for r in plan.readout),
                                            full=2 * len(plan.readout) > pending.bucket, live_steps=live, **report)
        if result.prefill_seconds is not None:
            self.spec_policy.observe_prefill(result.prefill_tokens, result.prefill_seconds)
        if decode and plan.window.speculative and not pending.speculative:
            self.spec_policy.withdraw()  # it ran plain (penalty rows): no report will come
        if result.spec is not None:
            self._account_speculation(result.spec, result.spec_positions, plan.readout)
        self.scheduler.cache_decoded(changed, launched)
        return changed

    def _account_speculation(self, spec, positions, readout: list[Readout]) -> None:
        drafted, accepted, rounds = (int(x) for x in spec.sum(axis=1))
        s = self._stats
        if not s.spec_accepted_per_position:
            s.spec_accepted_per_position = [0] * len(positions)
        for j, count in enumerate(positions):
            s.spec_accepted_per_position[j] += int(count)
        s.spec_windows += 1
        s.spec_draft_tokens += drafted
        s.spec_accepted_tokens += accepted
        s.spec_verifies += rounds
        rows = ((r.seq, int(spec[2, r.row]), int(spec[1, r.row])) for r in readout if r.row < spec.shape[1])
        self.spec_policy.observe(rounds, accepted, rows, drafted)

    def _on_finish(self, seq: Sequence) -> None:
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
        self.scheduler.finish(seq)
        request = seq.request
        request.num_finished += 1
        if request.finished:
            self.release_tables(request)
            self.requests.pop(request.request_id, None)
            self._stats.requests_finished += 1
            if request.metrics is not None:
                request.metrics.finished_time = time.time()

    def _account(self, plan: StepPlan, schedule_s: float, launch_s: float, pythonize_s: float) -> None:
        s = self._stats
        s.steps += 1
        s.host_seconds_schedule += schedule_s
        s.host_seconds_launch += launch_s
        s.host_seconds_pythonize += pythonize_s
        s.prefill_tokens += plan.num_prefill_tokens
        s.prefill_batches += bool(plan.prefill_chunks)
        window = plan.window
        if window is not None and window.decode:
            s.windows += 1
            s.window_rows += window.bucket
            s.live_rows += len(plan.readout)
            s.windows_per_bucket[window.bucket] = s.windows_per_bucket.get(window.bucket, 0) + 1

    def load(self) -> dict:
        """The cheap counters a server reports every step (O(1): no walk over requests, nothing from
        the device); stats() has everything."""
        s, sched, pool = self._stats, self.scheduler, self.pool
        usable = pool.num_pages - 1  # page 0 is the scratch page, held forever
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(sched.prefilling),
            "preemptions": sched.num_preemptions,
            "windows": s.windows,
            "prefill_tokens": s.prefill_tokens,
            "generated_tokens": s.generated_tokens,
            "first_token_prompt_tokens": s.first_token_prompt_tokens,
            "requests_finished": s.requests_finished,
            # vLLM's meanings: sequences in the batch (decoding, or admitted and prefilling), sequences not admitted
            "num_running_seqs": len(sched.running) + sum(len(g.seqs) for g in sched.prefilling.values()),
            "num_waiting_seqs": sched.waiting.num_seqs,  # O(1): kept by the queue
            "kv_pages_in_use": usable - pool.num_free,  # held by a sequence (cached pages nobody holds are free)
            "kv_pages": usable,
            "prefix_cache_queries": sched.prefix_cache_queries,
            "prefix_cache_hits": sched.prefix_cache_hits,
            "spec_verifies": s.spec_verifies,
            "spec_draft_tokens": s.spec_draft_tokens,
            "spec_accepted_tokens": s.spec_accepted_tokens,
            "spec_accepted_per_position": tuple(s.spec_accepted_per_position),
            "weight_version": self.weights.weight_version,
            **self._state_load(),
            **self._lora_load(),
        }

    def _state_load(self) -> dict:
        """A hybrid's recurrent-state slots held by sequences, and the prefix cache's state snapshots (zeros
        for a model without linear-attention layers)."""
        states = self.scheduler.states
        if states is None:
            return {"state_slots_in_use": 0, "state_slots": 0, "state_snapshots_cached": 0}
        slots = self.config.max_batch_size
        return {"state_slots_in_use": slots - states.num_free, "state_slots": slots,
                "state_snapshots_cached": states.num_cached_snapshots}

    def _lora_load(self) -> dict:
        """A LoRA engine's adapters by name, for vLLM's lora_requests_info (O(max_loras + waiting adapters))."""
        loras = self.scheduler.loras
        if loras is None:
            return {}
        return {"lora_running": loras.running, "lora_waiting": loras.waiting, "max_lora": self.config.max_loras}

    def stats(self) -> dict:
        s = self._stats
        s.preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.scheduler.prefix_cache_queries
        s.prefix_cache_hits = self.scheduler.prefix_cache_hits
        s.cached_pages = self.pool.num_cached
        device = self.executor.stats()
        for name in ("seconds_blocked", "staged_rows", "staging_flushes", "staging_seconds_blocked", "compile_seconds",
                     "compile_warm_start", "capture_seconds", "graphs_captured", "graph_memory_bytes"):
            setattr(s, name, device.pop(name))
        out = dict(vars(s))
        out["windows_per_bucket"] = dict(sorted(s.windows_per_bucket.items()))
        out["spec_accepted_per_position"] = list(s.spec_accepted_per_position)  # a snapshot, not the live list
        steps = max(s.steps, 1)
        for part in ("schedule", "launch", "pythonize"):
            out[f"host_ms_per_step_{part}"] = 1e3 * out[f"host_seconds_{part}"] / steps
        out["blocked_ms_per_step"] = 1e3 * s.seconds_blocked / steps
        out["padding_fraction"] = 1 - s.live_rows / s.window_rows if s.window_rows else 0.0
        out["spec_mean_accepted_per_verify"] = s.spec_accepted_tokens / s.spec_verifies if s.spec_verifies else 0.0
        out["spec_window_share"] = s.spec_windows / s.windows if s.windows else 0.0
        out["kv_pages_total"] = self.pool.num_pages - 1  # the scratch page aside
        out["kv_pages_free"] = self.pool.num_free  # an allocation could take them now (cached ones included)
        out["cpu_threads"] = torch.get_num_threads()  # in effect in the engine's process now
        out["weight_version"] = self.weights.weight_version
        out["weight_updates"] = self._weight_updates
        out.update(self._state_load())
        states = self.scheduler.states
        out["state_snapshots_taken"] = states.num_snapshots_taken if states is not None else 0
        automata = self.inputs.automata  # structured outputs: compiles (cold / cached) and the device store
        compiled = automata.stats().as_dict() if automata is not None else {}
        out["structured_compiles"] = compiled.get("compiled", 0)
        out["structured_cache_hits"] = compiled.get("memory_hits", 0) + compiled.get("disk_hits", 0)
        out["structured_compile_seconds"] = compiled.get("compile_seconds", 0.0)
        out["structured_uploads"] = self.structured.num_uploads
        out["structured_states_in_use"] = self.structured.states_in_use
        out.update(device)  # the rest of the device's: CPU kernels in use, MoE load
        return out
