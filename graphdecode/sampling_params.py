"""SamplingParams: what a request asks for, validated when it is made.

Mirrors vLLM's names and meanings. Every bad value raises ValueError naming the
field, before the engine sees the request.

Penalties (all applied on the device, inside the decode window, in this order, the
order of vLLM and transformers):
* `logit_bias` ({token id: bias in [-100, 100]}) is added to the logits, and
  `bad_words` are masked: each word is tokenized as vLLM does (without and with a
  leading space); a word's last token cannot be generated right after its other tokens
  (a one-token word never), judged on the output tokens;
* `repetition_penalty` (> 0; vLLM / transformers): the logit of every token seen in the
  prompt or the output is divided by it when positive, multiplied when negative;
* `frequency_penalty` and `presence_penalty` (in [-2, 2]; OpenAI): subtract
  count * frequency_penalty + (count > 0) * presence_penalty, counting OUTPUT tokens only;
* then min_tokens' stop masking, temperature and the filters.
Logprobs stay raw (the model's log_softmax, before all of this), which is vLLM's
default (`logprobs_mode="raw_logprobs"`).

Outputs: `prompt_logprobs` (N: each prompt token's logprob given the ones before it,
plus the top N; None for the first token; computed in prefill, so such a request
does not read the prefix cache), `detokenize=False` (no text, token ids only; stop
strings need text), `output_kind` for LLM.stream: "delta" (each output carries what is
new, the default), "cumulative" (everything so far) or "final_only" (one output at the
end). `seed`: any Python int; the whole integer is hashed, so two different seeds never
share a stream by truncation.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(str, enum.Enum):
    """What LLM.stream yields for a request (vLLM's names)."""

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind | str = RequestOutputKind.DELTA
    # internal: bad_words as token id sequences, filled by the engine's InputProcessor (a copy of
    # the params per request), like vLLM's `_bad_words_token_ids`
    _bad_words_token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disable it), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be a list of token ids >= 0, got {ids!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0 or None, got {self.prompt_logprobs!r}")
        try:
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            kinds = ", ".join(k.value for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}, got {self.output_kind!r}") from None
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        rep = self.repetition_penalty
        if not _is_number(rep) or not math.isfinite(rep) or not rep > 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 disables it), got {rep!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
                if not _is_number(bias) or not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")

        if not self.detokenize and stops:
            raise ValueError("stop: stop strings need text; they cannot be used with detokenize=False")

    def clone(self) -> SamplingParams:
        """An independent copy (vLLM's SamplingParams.clone)."""
        return dataclasses.replace(
            self, stop=list(self.stop) if isinstance(self.stop, list) else self.stop,
            stop_token_ids=list(self.stop_token_ids) if self.stop_token_ids is not None else None,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            bad_words=list(self.bad_words) if self.bad_words is not None else None,
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filter(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def needs_token_counts(self) -> bool:
        """Whether the logits depend on which tokens were seen (repetition, presence, frequency)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_penalties(self) -> bool:
        """Whether the sampler's penalty path must run for this request (any penalty, bias or bad word)."""
        return self.needs_token_counts or bool(self.logit_bias) or bool(self.bad_words)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """bad_words as token id sequences (empty until the engine has tokenized them)."""
        return self._bad_words_token_ids or ()
