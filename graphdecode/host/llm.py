"""LLM: the Python front end (vLLM-shaped): generate, stream, chat, stats.

Whoever steps the engine (a generate call, any stream iterator) routes every changed
sequence to the DeltaQueue of its request's stream, if it has one; each stream reads
only its own queue. So any number of streams, read in any interleaving, together with
generate calls, each get all of their own deltas and exactly one finished output.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterable, Iterator

from tqdm import tqdm

from ..config import EngineConfig
from ..engine_args import engine_kwargs
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .engine import Engine
from .output_builder import DeltaQueue, final_output
from .sequence import Request
from .weight_updates import WeightUpdate


@contextlib.contextmanager
def _cyclic_gc_paused():
    """No cyclic garbage collection during a generate() call.

    Every full collection walks every live object, and a large offline batch keeps
    hundreds of thousands of requests alive: measured at 100k prompts, the collector
    took 6% of the run (profiling/bench_scale.py --gc). The requests stay alive until
    the call returns anyway; what is left over is collected after it, as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        """`model`: a HuggingFace model directory (default: the built-in random Llama).

        `engine_args` are EngineConfig's fields (device, dtype, max_batch_size, buckets,
        num_decode_steps, page_size, num_pages, max_model_len, attention_backend, compile,
        cuda_graphs, seed, ...); their defaults and validation live there, once. vLLM's names
        for them are taken too (max_num_seqs, block_size, num_gpu_blocks_override, enforce_eager;
        trust_remote_code and enable_chunked_prefill, which graphdecode always honours). An
        unknown one is a TypeError naming it, before anything is built.
        """
        engine_args = engine_kwargs("LLM", engine_args)
        if model is None:
            from ..default_model import default_model_dir

            model = default_model_dir()
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = Engine(self.config)
        self._queues: dict[str, DeltaQueue] = {}  # request id -> the queue of the stream that owns it

    @property
    def llm_engine(self):
        """The engine (vLLM's name): `has_unfinished_requests()`, `get_num_unfinished_requests()`."""
        return self.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's (transformers) tokenizer, or None for a model directory without one."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams holding the model's recommended defaults (generation_config.json's temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens; EngineConfig's generation_config and
        override_generation_config): what a prompt with no SamplingParams runs with."""
        return SamplingParams(**self.config.sampling_defaults)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool | None = None,
                 lora_request=None, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        sampling_params: one SamplingParams for every prompt, a list of them (one per prompt), or None (for all,
        or in the list for one): `get_default_sampling_params()`, the model's recommended defaults.
        use_tqdm: a progress bar of finished requests (default: on for more than 8 prompts
        when stderr is a terminal). priority: one integer per prompt, or one for all of
        them (lower runs first), for an engine with scheduling_policy="priority".
        lora_request: a LoRARequest for every prompt, a list of them (None in it: the base model), or None;
        for an engine with enable_lora=True.
        """
        with _cyclic_gc_paused():
            requests = self._add(prompts, sampling_params, priority, lora_request)
            if use_tqdm is None:
                use_tqdm = len(requests) > 8 and sys.stderr.isatty()
            try:
                with tqdm(total=len(requests), unit="req", desc="generate", disable=not use_tqdm) as bar:
                    done = 0  # requests[:done] are finished: amortised O(1) per step however many wait
                    while done < len(requests):
                        self._step()
                        start = done
                        while done < len(requests) and requests[done].finished:
                            done += 1
                        if done > start:
                            bar.update(done - start)
            except BaseException:  # Ctrl-C or an engine error: this call leaves none of its requests behind
                for r in requests:
                    if not r.finished:
                        self.engine.abort_request(r.request_id)
                raise
            return [final_output(r) for r in requests]

    def chat(self, messages, sampling_params=None, use_tqdm: bool | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, priority: int | list[int] | None = None,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request=None) -> list[RequestOutput]:
        """Generate replies to conversations through the tokenizer's chat template (vLLM's arguments).

        messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        continue_final_message: the reply continues the last message (no generation prompt);
        tools: tool definitions the template shows the model; chat_template_kwargs: the template's own
        variables (e.g. {"enable_thinking": False} for Qwen3).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True "
                             "(the reply continues the last message; pass add_generation_prompt=False)")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer, and the model directory has none")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat_template: the tokenizer has no chat template; pass chat_template=...")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise TypeError(f"messages[{i}] must be a list of {{'role': ..., 'content': ...}} dicts")
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **extra,
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own specials
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)

    def stream(self, prompts, sampling_params=None, priority: int | list[int] | None = None,
               lora_request=None) -> Iterator[RequestOutput]:
        """Yield RequestOutput deltas of these prompts' requests as windows are pythonized.

        OpenAI semantics: a delta carries one request's new tokens per sequence (with its
        `index`); concatenated they give generate()'s output; the request's last delta has
        finished=True, exactly once. Other streams and generate calls may run meanwhile,
        in any interleaving. Closing the iterator early aborts the requests it started.

        A request's `output_kind` (SamplingParams) chooses what it yields: "delta" (the
        default, as above), "cumulative" (everything so far, each time it changes) or
        "final_only" (one output, when it finishes).
        """
        requests = self._add(prompts, sampling_params, priority, lora_request)
        queue = DeltaQueue()
        by_id = {r.request_id: r for r in requests}
        for r in requests:
            self._queues[r.request_id] = queue
        unfinished = len(requests)  # requests whose finished output has not been yielded yet
        try:
            while unfinished:
                if not queue:
                    self._step()
                    continue
                for out in queue.take():
                    unfinished -= out.finished
                    request = by_id[out.request_id]
                    kind = request.params.output_kind
                    if kind is RequestOutputKind.DELTA:
                        yield out
                    elif kind is RequestOutputKind.CUMULATIVE or out.finished:
                        yield final_output(request)
        finally:
            for r in requests:
                self._queues.pop(r.request_id, None)
                if not r.finished:
                    self.engine.abort_request(r.request_id)

    def _step(self) -> None:
        """One engine step; every changed sequence goes to its request's stream queue, if any."""
        changed = self.engine.step()
        if self._queues:
            for seq in changed:
                queue = self._queues.get(seq.request.request_id)
                if queue is not None:
                    queue.push(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.engine.abort_request(request_id)
        return final_output(request) if request is not None else None

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt page (vLLM's), e.g. between benchmark runs so each starts cold; False,
        doing nothing, while a request (a stream still open) holds pages."""
        return self.engine.reset_prefix_cache()

    def update_weights(self, weights, weight_version: str | None = None) -> WeightUpdate:
        """New values for the model's weights, in place, between generate calls (reinforcement learning: the
        policy after a training step; docs/weight_updates.md). `weights`: (name, tensor) pairs with the
        checkpoint's names, e.g. a trainer model's `named_parameters()`, or a mapping (`state_dict()`); any
        subset. Checked whole before anything is written (ValueError naming a tensor). The prefix cache is
        forgotten. RuntimeError while a stream is still open."""
        return self.engine.update_weights(weights, weight_version)

    def update_weights_from_disk(self, model_path, weight_version: str | None = None) -> WeightUpdate:
        """update_weights with every tensor of a checkpoint directory of the same architecture (a trainer's
        save_pretrained), read into host memory first."""
        return self.engine.update_weights_from_disk(model_path, weight_version)

    @property
    def weight_version(self) -> str:
        """The version of the weights the engine runs: "0" as loaded, then each update's."""
        return self.engine.weights.weight_version

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also at exit and on `with`."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _add(self, prompts, sampling_params, priority=None, lora_request=None) -> list[Request]:
        """Validate every prompt first; only then add them all (a bad one adds nothing).

        Errors name the argument and the prompt's index: `prompts[2]: ...`,
        `sampling_params[1] must be ...` (TypeError for a wrong type, ValueError for a bad value).
        Each distinct SamplingParams object is copied and checked once per call (its
        `submitted()` copy), however many prompts share it.
        """
        if isinstance(prompts, (str, dict)):
            prompt_list = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError(
                "prompts must be a str, a dict with 'prompt' or 'prompt_token_ids', or a list of them, "
                f"got {type(prompts).__name__}"
            )
        else:
            prompt_list = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(prompt_list)} prompts"
                )
            for i, params in enumerate(sampling_params):
                if params is not None and not isinstance(params, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
            default = self.get_default_sampling_params()
            params_list = [params if params is not None else default for params in sampling_params]
        elif sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
            params_list = [params] * len(prompt_list)
        else:
            hint = "; build one with SamplingParams(**...)" if isinstance(sampling_params, dict) else ""
            raise TypeError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                f"got {type(sampling_params).__name__}{hint}"
            )
        if priority is None:
            priorities = [0] * len(prompt_list)
        elif isinstance(priority, int) and not isinstance(priority, bool):  # vLLM's: one for every prompt
            priorities = [priority] * len(prompt_list)
        elif isinstance(priority, (list, tuple)) and len(priority) == len(prompt_list):
            priorities = list(priority)
        else:
            given = (f"{len(priority)} given" if isinstance(priority, (list, tuple))
                     else f"got {type(priority).__name__}")
            raise TypeError(f"priority must be an integer or a list of integers, one per prompt "
                            f"({len(prompt_list)}); {given}")
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != len(prompt_list):
                raise ValueError(f"lora_request: {len(lora_request)} given for {len(prompt_list)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompt_list)
        parsed = self.engine.inputs.tokenize_all(prompt_list)
        copies: dict[int, SamplingParams] = {}  # id(params) -> this call's checked copy
        requests = []
        for i, ((text, ids), params, prio, lora) in enumerate(zip(parsed, params_list, priorities, loras)):
            try:
                copy = copies.get(id(params))
                if copy is None:
                    copy = copies[id(params)] = params.submitted()
                salt = self.engine.inputs.cache_salt(prompt_list[i], i)
                ids = self.engine.inputs.truncated(ids, copy)
                requests.append(self.engine.prepare(text, ids, copy, priority=prio, verified=True, cache_salt=salt,
                                                    lora_request=lora))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        try:
            self.engine.add_requests(requests)  # constraint tables first: all of them fit, or nothing is added
        except ValueError as e:
            raise ValueError(f"prompts[{e.index}]: {e}") from None
        return requests
