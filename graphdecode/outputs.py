"""RequestOutput / CompletionOutput, as vLLM shapes them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.time() seconds), as vLLM reports them."""

    arrival_time: float
    first_scheduled_time: float | None = None  # admitted: its prefill began
    first_token_time: float | None = None  # its first output token reached the host
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times its sequences were preempted (and recomputed)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token
    metrics: RequestMetrics | None = None
    # prompt tokens found in the prefix cache at the request's first admission (vLLM's name);
    # None until it is admitted, or when the engine does not record it
    num_cached_tokens: int | None = None
