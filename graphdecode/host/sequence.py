"""Request and Sequence: the host's view of work, as counters with derived properties.

A Request holds n Sequences (n > 1 = parallel sampling). Everything per token is
per Sequence (sequence-native); the Request only groups outputs.

Counters:
* `num_tokens`: tokens the host has seen (prompt + pythonized outputs).
* `num_computed_tokens`: tokens whose K/V is in the cache or being written by work
  already scheduled: prefix-cache hits plus prefill chunks while prefilling; once the
  last chunk is scheduled it is all of the prompt, and later the host advances it to
  `num_tokens - 1` as tokens arrive (a token's K/V is written when it is fed back).
* `num_scheduled_tokens`: an upper bound on the tokens the device will hold once all
  launched work has run (prefill adds 1, each window adds up to k, or k (d + 1) when
  speculating, capped at max_len). Pages are reserved against it.
* `num_assured_tokens`: a lower bound on the same (each window adds at least k: one
  token per round, speculating or not). Once it reaches max_len the launched work
  surely finishes the sequence, which can give up its row and pages (draining).
* `num_cached_pages`: its leading pages already offered to the prefix cache.
Derived: a sequence is waiting, prefilling (admitted: it holds pages and
`num_computed_tokens < num_tokens`, no row yet), running (it holds a `row`), retired
(launched work covers all it can produce, so its row and pages went to others and its
last tokens are on their way) or finished (it has a `finish_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..outputs import RequestMetrics
from ..sampling_params import SamplingParams
from .detokenizer import Detokenizer
from .stop_sequences import StopSequences


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    priority: int = 0  # scheduling_policy "priority": lower first
    cache_root: bytes = b""  # the key its first page hashes under (page_pool.cache_root: a cache_salt's own)
    seqs: list["Sequence"] = field(default_factory=list)
    num_finished: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list | None = None  # [None, {token: Logprob, ...}, ...] as prefill computes them
    prompt_logprobs_streamed: bool = False
    num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
    automaton: object = None  # its structured-outputs constraint, compiled (structured.TokenAutomaton)
    placement: object = None  # where the constraint's tables sit on the device while it is in flight
    lora: object = None  # the LoRARequest it runs with (None: the base model)
    lora_adapter: object = None  # that adapter's files, read (lora.adapter.LoadedAdapter)
    lora_waiting: bool = False  # counted among its adapter's waiting requests (host/lora_slots.py)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs that prefill has not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.seqs)


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request: Request
    index: int  # child index within the request (OpenAI `index`)
    token_ids: list[int]
    num_prompt_tokens: int
    seed: int  # this child's effective seed
    stop_ids: tuple[int, ...]  # ids that end it on the device (eos unless ignored, stop_token_ids)
    stop_sequences: StopSequences | None  # grouped stop_token_ids, matched on the host
    max_len: int  # total tokens at which it ends with "length"
    detokenizer: Detokenizer | None
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_assured_tokens: int = 0
    num_cached_pages: int = 0
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages, as computed
    pages: list[int] = field(default_factory=list)
    row: int | None = None
    state_slot: int = 0  # a hybrid's recurrent-state slot while admitted (0: none)
    lora_slot: int = 0  # its LoRA adapter's device slot while admitted (0: none)
    epoch: int = -1  # which admission the row belongs to; stale window rows are skipped
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    spec_acceptance: float | None = None  # accepted drafts per verify, averaged over its speculative windows
    # streaming cursors: what has been handed out as deltas so far
    num_streamed_tokens: int = 0
    num_streamed_chars: int = 0
    num_streamed_logprobs: int = 0
    finish_streamed: bool = False  # its finished delta has been handed out (exactly once)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_running(self) -> bool:
        return self.row is not None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_draining(self) -> bool:
        """All tokens it can still produce are already covered by launched work."""
        return self.num_assured_tokens >= self.max_len

    @property
    def output_text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""
