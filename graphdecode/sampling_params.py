"""SamplingParams: what a request asks for, validated when it is made.

Mirrors vLLM's names and meanings, mutability included. Every wrong type raises
TypeError and every bad value ValueError, naming the field, when the params are built
and again when a request is submitted (on the engine's own copy, `submitted()`).

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
`allowed_token_ids` (a non-empty list) masks every other token first, on the device too.
What logprobs report is the engine's `logprobs_mode`: by default raw (the model's
log_softmax, before all of this), which is vLLM's default ("raw_logprobs").
`logprobs=0` gives the sampled token's logprob alone; -1 the whole vocabulary (on an
engine with max_logprobs=-1).

Stops: `stop` strings (matched on the host as text grows), `stop_token_ids` (ids that
end a row on the device, masked before `min_tokens`) and, inside `stop_token_ids`,
groups (`[[a, b, c], d]`, vLLM's): a multi-token sequence that ends the output when it
ends with it, matched on the host after `min_tokens`; stop_reason is then `"[a, b, c]"`,
and, when one token completes both, a group wins over a single id. The stop tokens stay
in `token_ids`; their text is left out unless `include_stop_str_in_output`.

Prompts: `truncate_prompt_tokens` (vLLM's): only the last N prompt tokens are run (-1: the last
max_model_len), so a prompt longer than the context is cut rather than refused; the output's
`prompt_token_ids` are those run, its `prompt` the text as given.

Outputs: `prompt_logprobs` (N: each prompt token's logprob given the ones before it,
plus the top N; None for the first token; computed in prefill, so such a request
does not read the prefix cache), `detokenize=False` (no text, token ids only; stop
strings need text), `output_kind` for LLM.stream: "delta" (each output carries what is
new, the default), "cumulative" (everything so far) or "final_only" (one output at the
end). `seed`: any Python int; the whole integer is hashed, so two different seeds never
share a stream by truncation.

Ranges: the device holds counts and lengths as int32 and the floats as float32, so `n`,
`top_k`, `max_tokens`, `min_tokens`, `logprobs` and `prompt_logprobs` must be at most
INT32_MAX (2**31 - 1); `temperature` and `repetition_penalty` must be representable as
float32 (at most ~3.4e38), and `top_p` and `repetition_penalty` must not round to 0 in it.
Token ids (`stop_token_ids`, `allowed_token_ids`, `logit_bias` keys) are checked against
the model's vocabulary when a request is submitted (host/inputs.py), as are
`max_tokens` against the context, `n` against the batch and `logprobs` against
max_logprobs; there, on the engine's copy, a temperature below 1e-5 becomes greedy and
`min_tokens` past the end of the sequence is cut to the room left (inputs.GREEDY_BELOW).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from dataclasses import dataclass, field

INT32_MAX = 2**31 - 1  # counts, lengths and top_k are int32 on the device


class RequestOutputKind(str, enum.Enum):
    """What LLM.stream yields for a request (vLLM's names)."""

    DELTA = "delta"
    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_error(name: str, expected: str, value) -> TypeError:
    return TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def _int(name: str, value, expected: str = "an integer") -> None:
    if not _is_int(value):
        raise _type_error(name, expected, value)


def _number(name: str, value) -> None:
    """A real number, finite: NaN and infinities are values no field accepts (nor an int beyond any float)."""
    if not _is_number(value):
        raise _type_error(name, "a number", value)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large to be a float
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _at_most_int32(name: str, value: int) -> None:
    if value > INT32_MAX:
        raise ValueError(f"{name} must be at most {INT32_MAX} (2**31 - 1, the device holds it as int32), "
                         f"got {value!r}")


def _float32(name: str, value: float, positive: bool = False) -> None:
    """`value` survives the device's float32: it does not overflow and, with `positive`, does not round to 0."""
    (rounded,) = struct.unpack("f", struct.pack("f", value))
    if math.isinf(rounded):
        raise ValueError(f"{name} must be at most 3.4e38 (the device holds it as float32), got {value!r}")
    if positive and rounded == 0:
        raise ValueError(f"{name} must be at least 1.4e-45 (the smallest positive float32; 0 would change "
                         f"its meaning), got {value!r}")


def _int_list(name: str, value) -> None:
    if not isinstance(value, (list, tuple)):
        raise _type_error(name, "a list of integer token ids", value)
    bad = next((t for t in value if not _is_int(t)), None)
    if bad is not None:  # a list holding something else: a bad value (vLLM's ValueError), not a bad type
        raise ValueError(f"{name} must hold only integer token ids, got {bad!r} ({type(bad).__name__}) in "
                         f"{list(value)!r}")
    if any(t < 0 for t in value):
        raise ValueError(f"{name} must hold token ids >= 0, got {list(value)!r}")


def _stop_token_ids(value) -> None:
    """Token ids and groups of them (a non-empty list: a multi-token stop sequence)."""
    if not isinstance(value, (list, tuple)):
        raise _type_error("stop_token_ids", "a list of token ids or of lists of token ids", value)
    for item in value:
        if isinstance(item, (list, tuple)):
            if not item:
                raise ValueError(f"stop_token_ids: a grouped stop sequence must not be empty, got {list(value)!r}")
            _int_list("stop_token_ids", item)
        else:
            _int_list("stop_token_ids", [item])


@dataclass(slots=True)
class SamplingParams:
    """Mutable like vLLM's (`params.max_tokens = 10` takes effect for requests submitted
    after it); validated when built and again, on the engine's own copy, when a request
    is submitted. A wrong type is a TypeError and a bad value a ValueError, both naming the
    field (plain checks, not asserts: they hold under `python -O` too). An unknown
    attribute is an AttributeError (slots), so a misspelt field never goes unnoticed."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int | list[int]] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: object = None  # StructuredOutputsParams: json / regex / choice / json_object
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind | str = RequestOutputKind.DELTA
    # internal: bad_words as token id sequences, filled by the engine's InputProcessor (a copy of
    # the params per request), like vLLM's `_bad_words_token_ids`
    _bad_words_token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Check every field (TypeError for a wrong type, ValueError for a bad value, each
        naming the field); normalises `output_kind` to the enum."""
        _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        _at_most_int32("n", self.n)
        _number("temperature", self.temperature)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        _float32("temperature", self.temperature)
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _float32("top_p", self.top_p, positive=True)
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 disable it), got {self.top_k!r}")
        _at_most_int32("top_k", self.top_k)
        _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _int("seed", self.seed, "an integer or None")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, "an integer or None")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
            _at_most_int32("max_tokens", self.max_tokens)
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _at_most_int32("min_tokens", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
                raise _type_error("stop", "a string or a list of strings", self.stop)
            if not all(stops):  # vLLM's rule, for the API and the server alike
                raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}")
        if self.stop_token_ids is not None:
            _stop_token_ids(self.stop_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, "an integer or None")
                if value < -1:
                    raise ValueError(f"{name} must be an integer >= 0, or -1 for the whole vocabulary, "
                                     f"or None, got {value!r}")
                _at_most_int32(name, value)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, "an integer or None")
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1 for max_model_len, "
                                 f"or None, got {self.truncate_prompt_tokens!r}")
        if isinstance(self.output_kind, str):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                kinds = ", ".join(k.value for k in RequestOutputKind)
                raise ValueError(f"output_kind must be one of {kinds}, got {self.output_kind!r}") from None
        else:
            raise _type_error("output_kind", "a RequestOutputKind or its name", self.output_kind)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise _type_error(name, "a bool", getattr(self, name))
        _number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be a number > 0 (1 disables it), got {self.repetition_penalty!r}")
        _float32("repetition_penalty", self.repetition_penalty, positive=True)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _number(name, value)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _type_error("logit_bias", "a dict of token id -> bias", self.logit_bias)
            for token, bias in self.logit_bias.items():
                _int("logit_bias", token, "a dict keyed by integer token ids")
                if token < 0:
                    raise ValueError(f"logit_bias: keys must be token ids >= 0, got {token!r}")
                _number(f"logit_bias[{token}]", bias)
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                raise _type_error("bad_words", "a list of strings", words)
            if not all(w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {words!r}")
        if self.allowed_token_ids is not None:
            _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")

        if self.structured_outputs is not None:
            from .structured.params import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise _type_error("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)

        if not self.detokenize and stops:
            raise ValueError("stop: stop strings need text; they cannot be used with detokenize=False")

    def clone(self) -> SamplingParams:
        """An independent copy (vLLM's SamplingParams.clone): containers copied, not re-validated."""
        new = object.__new__(SamplingParams)
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, dict):
                value = value.copy()
            elif isinstance(value, list):  # grouped stop_token_ids are lists inside the list
                value = [v.copy() if isinstance(v, list) else v for v in value]
            object.__setattr__(new, name, value)
        return new

    def submitted(self) -> SamplingParams:
        """The engine's private copy of these params for one submission, validated again
        (a field set after construction is checked here, naming the field)."""
        new = self.clone()
        new.verify()
        return new

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def single_stop_token_ids(self) -> tuple[int, ...]:
        """The stop_token_ids that stop alone (on the device)."""
        return tuple(t for t in self.stop_token_ids or () if not isinstance(t, (list, tuple)))

    @property
    def multi_stop_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """The grouped stop_token_ids: sequences that stop when the output ends with them (on the host)."""
        return tuple(tuple(t) for t in self.stop_token_ids or () if isinstance(t, (list, tuple)))

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
    def constrained(self) -> bool:
        """Whether the row follows a constraint automaton (structured outputs or allowed_token_ids)."""
        return self.structured_outputs is not None or self.allowed_token_ids is not None

    @property
    def needs_penalties(self) -> bool:
        """Whether the sampler's penalty path must run for this request (any penalty, bias or bad word)."""
        return self.needs_token_counts or bool(self.logit_bias) or bool(self.bad_words)

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """bad_words as token id sequences (empty until the engine has tokenized them)."""
        return self._bad_words_token_ids or ()


_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
