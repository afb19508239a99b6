"""Prompt parsing and request validation, done before a request touches the engine.

`InputProcessor.prepare()` turns (prompt, SamplingParams) into a Request with its
Sequences, or raises ValueError naming the offending field. It has no side effects
on the engine, so a batch can be validated whole before any of it is admitted, and
a bad request never disturbs the others.
"""

from __future__ import annotations

import numbers
import threading
import time

from ..lora.cache import AdapterCache
from ..outputs import RequestMetrics
from ..sampling_params import SamplingParams
from ..structured.automaton import allowed_ids_automaton, restrict
from .detokenizer import Detokenizer
from .page_pool import cache_root
from .sequence import Request, Sequence
from .stop_sequences import StopSequences
from .structured_store import check_capacity

_M64 = (1 << 64) - 1
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): the sampler divides the float32
# logits by the temperature, which overflows to inf (and samples garbage) for tiny ones, while the
# distribution at such a temperature is the argmax anyway.
GREEDY_BELOW = 1e-5


def seed_key(seed: int) -> int:
    """A request seed as the 64-bit value the streams are keyed by.

    Seeds in [-2**63, 2**64) are used as they are (their streams never changed);
    larger ones are hashed whole, limb by limb, so 2**70 and 2**70 + 2**64 differ.
    """
    if -(1 << 63) <= seed < 1 << 64:
        return seed
    magnitude, limbs = abs(seed), []
    while magnitude:
        limbs.append(magnitude & _M64)
        magnitude >>= 64
    return mix64(0x5EED5EED, int(seed < 0), len(limbs), *limbs)


def mix64(*values: int) -> int:
    """splitmix64 over the values: derives per-request and per-child seeds."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & _M64)) & _M64
        x = (x + 0x9E3779B97F4A7C15) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x  # fits an int64 tensor


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def _wrong_prompt_type(i: int, prompt) -> str:
    hint = ""
    if isinstance(prompt, int) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int)):
        hint = "; token ids go in a dict: {'prompt_token_ids': [...]}"
    return (f"prompts[{i}] must be a str or a dict with 'prompt' or 'prompt_token_ids', "
            f"got {type(prompt).__name__}{hint}")


def _check_unicode(texts: list[str], slots: list[int]) -> None:
    """ValueError naming the first text that cannot be UTF-8 encoded (a lone surrogate)."""
    for slot, text in zip(slots, texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"prompts[{slot}]: the text is not valid Unicode: lone surrogate {text[e.start]!r} "
                f"at character {e.start}"
            ) from None


def truncation_size(keep: int | None, max_model_len: int) -> int | None:
    """truncate_prompt_tokens resolved, vLLM's rule for the API and the server alike: None, no truncation; -1,
    max_model_len; else an integer in [1, max_model_len] (a ValueError naming the field otherwise)."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len
    if keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for max_model_len, got {keep}")
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len}); select "
                         f"a smaller truncation size")
    return keep


class InputProcessor:
    def __init__(self, config, tokenizer, group_pages):
        self.config = config
        self.tokenizer = tokenizer  # transformers tokenizer or None
        self.vocab_size = config.model_config.vocab_size
        self.eos_ids = config.model_config.eos_token_ids
        self.group_pages = group_pages  # (num_tokens, n, max_len) -> pages needed at admission
        self._next_seq_id = 0
        self._fast_encode: bool | None = None  # decided by a probe at first use
        self.automata = None  # structured.AutomatonCache, made at the first constrained request
        self.loras = AdapterCache(config)  # LoRA adapters checked and read (lora/cache.py)
        self._automata_lock = threading.Lock()

    def tokenize_all(self, prompts: list) -> list[tuple[str | None, list[int]]]:
        """Parse prompts (str or {"prompt_token_ids"} / {"prompt"} dicts); text is batch-encoded.

        A prompt of the wrong type raises TypeError, a bad value ValueError; both name
        `prompts[i]` and the key, before anything is tokenized.
        """
        parsed: list = []
        texts, text_slots = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                texts.append(prompt)
                text_slots.append(i)
                parsed.append(None)
                continue
            if not isinstance(prompt, dict):
                raise TypeError(_wrong_prompt_type(i, prompt))
            unknown = [key for key in prompt if key not in _PROMPT_KEYS]
            if unknown:
                raise ValueError(
                    f"prompts[{i}]: unknown key {unknown[0]!r}; a prompt dict has 'prompt' (text) "
                    f"and/or 'prompt_token_ids' (a list of token ids), and optionally 'cache_salt'"
                )
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"prompts[{i}]['prompt'] must be a str, got {type(text).__name__}")
            if prompt.get("prompt_token_ids") is not None:
                parsed.append((text, self._checked_ids(i, prompt["prompt_token_ids"])))
            elif text is not None:
                texts.append(text)
                text_slots.append(i)
                parsed.append(None)
            else:
                raise ValueError(
                    f"prompts[{i}]: a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (a list of token ids)"
                )
        if texts:
            if self.tokenizer is None:
                raise ValueError(
                    f"prompts[{text_slots[0]}]: a text prompt needs a tokenizer, and the model directory has none; "
                    f"pass token ids as {{'prompt_token_ids': [...]}}"
                )
            try:
                encoded = self._encode(texts)
            except Exception:
                _check_unicode(texts, text_slots)  # the usual cause; otherwise the tokenizer's own error stands
                raise
            for slot, text, ids in zip(text_slots, texts, encoded):
                parsed[slot] = (text, list(ids))
        return parsed

    def _checked_ids(self, i: int, ids) -> list[int]:
        """prompt_token_ids as a list of ints in [0, vocab_size); the common case costs two C-level passes."""
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"prompts[{i}]['prompt_token_ids'] must be a list of ints, got {type(ids).__name__}")
        if not ids:
            raise ValueError(f"prompts[{i}]: prompt_token_ids is empty (the prompt has no tokens)")
        if not set(map(type, ids)) <= {int}:  # bools, floats, strings, or numpy ints (accepted)
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(
                        f"prompts[{i}]['prompt_token_ids'][{j}] must be an int, got {type(t).__name__} {t!r}"
                    )
            ids = [int(t) for t in ids]
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            j, t = next((j, t) for j, t in enumerate(ids) if not 0 <= t < self.vocab_size)
            raise ValueError(
                f"prompts[{i}]: prompt_token_ids[{j}] = {t} is outside the vocabulary [0, {self.vocab_size})"
            )
        return list(ids)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Batch-encode with the Rust tokenizer directly when it gives transformers' ids.

        transformers' __call__ converts every encoding to Python objects it then throws
        away (measured: 1.33-1.43 s against 1.14-1.19 s for 100k short prompts); the
        backend's encode_batch is used instead once a probe shows both add the same
        special tokens.
        """
        if self._fast_encode is None:
            probe = ["Hello world", " two  spaces"]
            self._fast_encode = [e.ids for e in self.tokenizer.backend_tokenizer.encode_batch(probe)] == [
                list(ids) for ids in self.tokenizer(probe)["input_ids"]
            ]
        if self._fast_encode:
            return [e.ids for e in self.tokenizer.backend_tokenizer.encode_batch(texts)]
        return self.tokenizer(texts)["input_ids"]

    @staticmethod
    def cache_salt(prompt, i: int = 0) -> str | None:
        """A prompt dict's `cache_salt` (vLLM's: requests share prefix-cache pages only with the same salt):
        a non-empty string, or None."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"prompts[{i}]: cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def prepare(self, request_id: str, prompt_text, prompt_ids: list[int], params, arrival: int,
                priority: int = 0, verified: bool = False, checked: bool = False,
                cache_salt: str | None = None, lora_request=None) -> Request:
        """Check a submission (`check`) and build its request. verified: `params` is already this
        submission's private copy (SamplingParams.submitted()); checked: `check` already ran on it
        (the engine core's requests: AsyncLLM checked them before sending), so it is not run again.
        lora_request: the LoRARequest it runs with (its adapter read here, lora/cache.py)."""
        automaton = None
        adapter = self.loras.load(lora_request) if lora_request is not None else None
        if not checked:
            params, automaton = self.check(prompt_ids, params, priority, verified)
        request = self._build(request_id, prompt_text, prompt_ids, params, arrival, priority, automaton)
        request.cache_root = cache_root(cache_salt, lora_request)
        request.lora, request.lora_adapter = lora_request, adapter
        return request

    def check(self, prompt_ids: list[int], params, priority: int = 0, verified: bool = False):
        """Every check of a submission, before any work: ValueError / TypeError naming the field.
        Returns (the engine's checked copy of params, its constraint automaton or None)."""
        cfg = self.config
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not verified:
            params = params.submitted()  # the engine's own copy: later changes by the caller do not reach it
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {type(priority).__name__} {priority!r}")
        if priority != 0 and cfg.scheduling_policy != "priority":
            raise ValueError(f"priority: got {priority}, but priority scheduling is not enabled "
                             f"(scheduling_policy={cfg.scheduling_policy!r}; use scheduling_policy='priority')")
        if not prompt_ids:
            raise ValueError("prompt: the prompt is empty (no tokens)")
        # before any O(prompt) scan; max_tokens past the context is vLLM's engine rule: generation stops at
        # max_model_len with "length" (the server refuses it first, as vLLM's server does: serving.check_length)
        self.check_length(len(prompt_ids), None)
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        stop_token_ids = params.single_stop_token_ids + sum(params.multi_stop_token_ids, ())
        bad = next((t for t in stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
        stop_ids = self._stop_ids(params)
        if len(stop_ids) > cfg.max_stop_ids:
            raise ValueError(
                f"stop_token_ids: {len(stop_ids)} stop ids (with EOS) exceed max_stop_ids ({cfg.max_stop_ids})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is None:
                continue
            uncapped = cfg.max_logprobs == -1 or cfg.max_logprobs >= self.vocab_size  # the whole vocabulary fits
            if not uncapped and (asked == -1 or asked > cfg.max_logprobs):
                shown = "the whole vocabulary (-1)" if asked == -1 else asked
                raise ValueError(f"{name}: {shown} exceeds max_logprobs ({cfg.max_logprobs}; -1 lifts the cap)")
            if asked == -1 or asked > self.vocab_size:
                setattr(params, name, self.vocab_size)  # on the engine's copy: every token of the vocabulary
        if params.allowed_token_ids is not None:
            bad = next((t for t in params.allowed_token_ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"allowed_token_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.logit_bias:
            if len(params.logit_bias) > cfg.max_logit_bias:
                raise ValueError(
                    f"logit_bias: {len(params.logit_bias)} entries exceed max_logit_bias ({cfg.max_logit_bias})"
                )
            bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: the model directory has no tokenizer to turn them into token ids")
            if len(params.bad_words) > cfg.max_bad_words:
                raise ValueError(f"bad_words: {len(params.bad_words)} words exceed max_bad_words ({cfg.max_bad_words})")
            sequences = []
            for word in params.bad_words:  # vLLM's rule: the word, and with a leading space if that is a new token
                plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
                spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
                variants = [plain]
                if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                    variants.append(spaced)
                for ids in variants:
                    if not ids or len(ids) > cfg.max_bad_word_tokens:
                        raise ValueError(
                            f"bad_words: {word!r} is {len(ids)} tokens; a bad word must be 1 to "
                            f"max_bad_word_tokens ({cfg.max_bad_word_tokens}) tokens"
                        )
                    bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                    if bad is not None:
                        raise ValueError(
                            f"bad_words: {word!r} gives token id {bad}, outside the vocabulary [0, {self.vocab_size})"
                        )
                    sequences.append(tuple(ids))
            params._bad_words_token_ids = tuple(sequences)  # on the engine's copy: the caller's stays as it is
        automaton = self._constraint(params)
        if params.n > cfg.max_batch_size:
            raise ValueError(f"n: {params.n} exceeds max_batch_size ({cfg.max_batch_size})")
        max_len = self._max_len(len(prompt_ids), params)
        # on the engine's copy: min_tokens past the end of the sequence means "never stop early", which
        # ending the sequence at max_len already gives, and it keeps min_len (int32 on the device) in range
        params.min_tokens = min(params.min_tokens, max_len - len(prompt_ids))
        if 0 < params.temperature < GREEDY_BELOW:
            params.temperature = 0.0  # on the engine's copy (see GREEDY_BELOW)
        if self.group_pages(len(prompt_ids), params.n, max_len) > cfg.num_pages - 1:
            raise ValueError(f"n: {params.n} sequences of this prompt do not fit in the KV cache ({cfg.num_pages} pages)")
        return params, automaton

    def _build(self, request_id: str, prompt_text, prompt_ids: list[int], params, arrival: int, priority: int,
               automaton) -> Request:
        """The request and its n sequences, from checked params (automaton: None to look it up again:
        a cache hit for a constraint this engine's inputs compiled)."""
        cfg = self.config
        if automaton is None and params.constrained:
            automaton = self._constraint(params)
        stop_ids, max_len = self._stop_ids(params), self._max_len(len(prompt_ids), params)
        groups = params.multi_stop_token_ids
        stop_sequences = StopSequences(groups) if groups else None
        request = Request(request_id, prompt_text, list(prompt_ids), params, arrival, priority=priority,
                          metrics=RequestMetrics(arrival_time=time.time()))
        request.automaton = automaton
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has none
        base_seed = seed_key(params.seed) if params.seed is not None else mix64(cfg.seed, arrival)
        for index in range(params.n):
            request.seqs.append(
                Sequence(
                    seq_id=self._next_seq_id,
                    request=request,
                    index=index,
                    token_ids=list(prompt_ids),
                    num_prompt_tokens=len(prompt_ids),
                    seed=mix64(base_seed, index),
                    stop_ids=stop_ids,
                    stop_sequences=stop_sequences,
                    max_len=max_len,
                    detokenizer=self._detokenizer(prompt_ids, params),
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
            self._next_seq_id += 1
        return request

    def _stop_ids(self, params) -> tuple[int, ...]:
        """The request's stop ids: its own, then EOS unless ignore_eos (duplicates once)."""
        return tuple(dict.fromkeys(params.single_stop_token_ids + (() if params.ignore_eos else self.eos_ids)))

    def _max_len(self, num_prompt_tokens: int, params) -> int:
        """Total tokens at which its sequences end."""
        if params.max_tokens is None:
            return self.config.max_model_len
        return min(self.config.max_model_len, num_prompt_tokens + params.max_tokens)

    def _constraint(self, params):
        """The request's constraint automaton: its structured outputs, its allowed_token_ids (one
        state), both (the first cut to the second), or None."""
        constraint, allowed = params.structured_outputs, params.allowed_token_ids
        automaton = self.compile_constraint(constraint) if constraint is not None else None
        if allowed is None:
            return automaton
        if automaton is None:
            return allowed_ids_automaton(allowed, self.vocab_size)
        return restrict(automaton, allowed)

    def compile_constraint(self, constraint, cancelled: threading.Event | None = None):
        """The constraint compiled for this model's tokenizer (cached in memory and on disk), under
        the engine's compile budget (structured/budget.py); cancelled: set when the request that
        asks for it goes away (the compile stops: structured.compile_worker.CompileCancelled)."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs: a constraint needs the model's tokenizer, and the model "
                             "directory has none")
        automaton = self._automata().get(constraint, self.tokenizer, self.vocab_size, self.eos_ids, cancelled)
        check_capacity(automaton, self.config.structured_max_states, self.config.structured_max_exceptions)
        return automaton

    def _automata(self):
        """This engine's compile cache (in memory; the disk cache is shared) and its compile workers."""
        with self._automata_lock:
            if self.automata is None:
                from ..structured import AutomatonCache
                from ..structured.budget import CompileBudget
                from ..structured.compile_worker import CompileWorkers

                cfg = self.config
                budget = CompileBudget(cfg.structured_compile_timeout, cfg.structured_compile_memory_bytes)
                self.automata = AutomatonCache(workers=CompileWorkers(budget))
            return self.automata

    def close(self) -> None:
        """Stop the compile workers."""
        if self.automata is not None:
            self.automata.close()

    def truncated(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt tokens a request runs: the last `params.truncate_prompt_tokens` (truncation_size) of a
        longer prompt, else all of them (vLLM's left truncation)."""
        keep = truncation_size(params.truncate_prompt_tokens, self.config.max_model_len)
        return prompt_ids[-keep:] if keep is not None and len(prompt_ids) > keep else prompt_ids

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """The context-length rule: the prompt leaves room to generate (the engine's, offline and async, as
        vLLM's engine), and with max_tokens given (the server's, as vLLM's server) the prompt plus
        max_tokens fits in max_model_len."""
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens leave no room to generate within max_model_len ({limit}): "
                f"this model's maximum context length is {limit} tokens"
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise ValueError(
                f"max_tokens is too large: {max_tokens}. This model's maximum context length is {limit} tokens "
                f"and the prompt has {num_prompt_tokens} tokens ({max_tokens} > {limit} - {num_prompt_tokens})"
            )

    def _detokenizer(self, prompt_ids, params) -> Detokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return Detokenizer(
            self.tokenizer.backend_tokenizer, prompt_ids, params.skip_special_tokens,
            params.stop_strings, params.include_stop_str_in_output,
            hold_tokens=max(map(len, params.multi_stop_token_ids), default=1) - 1,
        )
