"""The OpenAI wire format: request models and the SamplingParams they ask for.

Requests are parsed and validated in one pass with pydantic (`model_validate_json`,
strict types: a string where a number belongs is a 400, as at OpenAI), unknown fields
are ignored like OpenAI and vLLM do, and every failure becomes an `APIError` (errors.py) carrying
the OpenAI error body

    {"error": {"message": ..., "type": "invalid_request_error", "param": "temperature", "code": null}}

whose `param` names the offending field in the request's own terms (`max_completion_tokens`
or `top_logprobs` for chat, `max_tokens` or `logprobs` for completions). Values are checked
by SamplingParams and by the engine's InputProcessor (the same checks LLM runs); their
ValueErrors name the field first, which is mapped back here.

Responses are NOT pydantic models: the server builds plain dicts and json.dumps them,
since the per-chunk cost of model validation would sit on the streaming path.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ..generation_defaults import capped_max_tokens
from ..host.inputs import truncation_size
from ..sampling_params import SamplingParams
from . import tools as tool_calls
from .constraints import ConstraintSource, response_format_source, structured_outputs_source
from .errors import APIError, param_of
from .reply_constraint import reply_source


# ------------------------------------------------------------------ requests
class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk too (with include_usage)


class _SamplingRequest(_Base):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0  # vLLM's: with --scheduling-policy priority, lower runs first
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int | list[int]] | None = None  # vLLM: a list inside is a multi-token stop sequence
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end truncate_prompt_tokens cuts
    cache_salt: str | None = None  # vLLM's: prefix-cache pages are shared only among requests with the same salt
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint_sources(self) -> list[ConstraintSource]:
        """Every structured-output constraint the request asks for (the server refuses more than one)."""
        sources = []
        if self.response_format is not None:
            source = response_format_source(self.response_format)
            if source is not None:
                sources.append(source)
        if self.structured_outputs is not None:
            sources.append(structured_outputs_source(self.structured_outputs))
        for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                sources.append(ConstraintSource(name, name, {field: value}))
        return sources

    def constraint_source(self) -> ConstraintSource | None:
        """The request's one constraint, or None; a 400 naming the fields when there are several."""
        sources = self.constraint_sources()
        if len(sources) > 1:
            names = ", ".join(s.param for s in sources)
            raise APIError(f"{sources[1].param}: give at most one structured-output constraint per request "
                           f"(got {names})", param=sources[1].param)
        return sources[0] if sources else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's rule, only together with include_usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def truncate(self, ids: list[int], n: int) -> list[int]:
        """The n prompt tokens truncate_prompt_tokens keeps: the last (truncation_side "left", the default)
        or the first ("right")."""
        return ids[:n] if self.truncation_side == "right" else ids[-n:]

    def truncation(self, max_model_len: int) -> int | None:
        """truncate_prompt_tokens resolved (host/inputs.truncation_size): keep the last N prompt tokens (-1:
        max_model_len; None: no truncation); a 400 naming the field."""
        try:
            return truncation_size(self.truncate_prompt_tokens, max_model_len)
        except ValueError as exc:
            raise APIError(str(exc), param="truncate_prompt_tokens") from None

    def salted(self, prompt: dict) -> dict:
        """The engine prompt with the request's cache_salt (checked: a non-empty string)."""
        if self.cache_salt is None:
            return prompt
        if not self.cache_salt:
            raise APIError("cache_salt: must be a non-empty string if given", param="cache_salt")
        return {**prompt, "cache_salt": self.cache_salt}

    def _check_unsupported(self) -> None:
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:  # vLLM's bound (a C long)
            raise APIError(f"seed: must be a 64-bit signed integer, got {self.seed}", param="seed")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("best_of is not supported (only best_of = n)", param="best_of")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs not in (None, 0):  # vLLM's rule: a stream has no place for them
            raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def _common_params(self, vocab_size: int | None = None, defaults: dict | None = None) -> dict:
        """SamplingParams keyword arguments for the fields given; a sampling field left out takes the model's
        recommended default (`defaults`, generation_defaults.py) where it has one, else SamplingParams'."""
        given = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
        for name in ("n", "temperature", "top_p", "seed", "top_k", "min_p", "min_tokens", "ignore_eos",
                     "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None:
                given[name] = value
        if self.stop is not None:  # [] is no stop; "" is refused by SamplingParams, as by the API (vLLM's rule)
            given["stop"] = self.stop if self.stop != [] else None
        # penalties, bias and bad words: passed when this engine's SamplingParams has them
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words"):
            value = getattr(self, name)
            if value is None:
                continue
            if name not in _SAMPLING_FIELDS:
                if value != _NEUTRAL[name]:
                    raise APIError(f"{name} is not supported by this engine", param=name)
                continue
            given[name] = value
        if self.logit_bias:
            if "logit_bias" not in _SAMPLING_FIELDS:
                raise APIError("logit_bias is not supported by this engine", param="logit_bias")
            given["logit_bias"] = logit_bias_ids(self.logit_bias, vocab_size)
        return given


def logit_bias_ids(bias: dict[str, float], vocab_size: int | None) -> dict[int, float]:
    """logit_bias keyed by token id; one 400 naming every bad key (not an integer, negative,
    outside the vocabulary) rather than the first."""
    out, bad = {}, []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            bad.append(f"{key!r} (not an integer token id)")
            continue
        if token < 0:
            bad.append(f"{key!r} (negative)")
        elif vocab_size is not None and token >= vocab_size:
            bad.append(f"{key!r} (outside the vocabulary [0, {vocab_size}))")
        else:
            out[token] = value
    if bad:
        raise APIError(f"logit_bias: {len(bad)} invalid key{'s' if len(bad) > 1 else ''}, keys must be token ids: "
                       + ", ".join(bad), param="logit_bias")
    return out





_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "bad_words": []}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions, and SamplingParams'
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts as the engine takes them: str or {"prompt_token_ids": [...]}."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError("prompt: the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        if isinstance(prompt[0], str):
            return list(prompt)
        for i, ids in enumerate(prompt):
            if not ids:
                raise APIError(f"prompt[{i}]: the prompt is empty (no tokens)", param="prompt")
        return [{"prompt_token_ids": ids} for ids in prompt]

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (vLLM): the prompt alone comes back; the engine generates one token, unreturned."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> int | None:
        """vLLM's rule: prompt_logprobs as given, else with echo the prompt gets `logprobs` like the completion."""
        if self._explicit_prompt_logprobs:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @property
    def _explicit_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and not (self.stream and self.prompt_logprobs == 0)

    def renames(self) -> dict[str, str]:
        """graphdecode's field names -> this request's (prompt_logprobs taken from logprobs is `logprobs`)."""
        derived = not self._explicit_prompt_logprobs and self.echo and self.logprobs is not None
        return {"logprobs": "logprobs", "max_tokens": "max_tokens",
                "prompt_logprobs": "logprobs" if derived else "prompt_logprobs"}

    def sampling_params(self, vocab_size: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the model's recommended sampling defaults; their max_tokens caps the request's."""
        self._check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        given = self._common_params(vocab_size, defaults)
        given["max_tokens"] = 1 if self.echo_only else capped_max_tokens(defaults or {}, self.max_tokens)
        if self.logprobs is not None:
            given["logprobs"] = self.logprobs
        if self.wants_prompt_logprobs is not None:
            given["prompt_logprobs"] = self.wants_prompt_logprobs
        return build_sampling_params(given, self.renames())


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... reach the template

    role: str  # any role reaches the template as it is ("developer", "tool", "ipython", ...), as in vLLM
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        out = dict(self.__pydantic_extra__ or {})
        out["role"] = self.role
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out["content"] = content if content is not None else ""
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI, still accepted
    max_completion_tokens: int | None = None
    logprobs: Annotated[bool | None, Field(strict=False)] = False  # "true" as vLLM's (lax) models read it
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; "required" allows one or more calls either way
    functions: list[Any] | None = None
    # vLLM's extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False
    # the checked tools (their function definitions) and tool_choice: "none" / "auto" / "required" / a function
    _functions: list[dict] | None = PrivateAttr(default=None)
    _tool_choice: str | dict = PrivateAttr(default="none")
    _reply: tuple[bool, bool, bool] = PrivateAttr(default=(False, False, False))  # see reply_format

    def check_tools(self) -> None:
        """tools and tool_choice checked (400s naming the field); see tool_mode."""
        if self.functions:
            raise APIError("functions (deprecated by OpenAI) is not supported; use tools", param="functions")
        try:
            self._functions = tool_calls.check_tools(self.tools) if self.tools else None
            self._tool_choice = tool_calls.check_tool_choice(self.tool_choice, self._functions)
        except ValueError as exc:
            message = str(exc)
            raise APIError(message, param=message.split(":", 1)[0]) from None
        if self.tool_mode in ("required", "named") and self.echo:
            raise APIError("echo cannot be used with tool_choice 'required' or a named function (the reply is "
                           "tool calls, not content)", param="echo")

    @property
    def tool_mode(self) -> str | None:
        """How the reply is read: None (no tools, or tool_choice "none": content), "auto"
        (<tool_call> blocks parsed out), "required" or "named" (constrained to calls)."""
        choice = self._tool_choice
        if isinstance(choice, dict):
            return "named"
        return None if choice == "none" else choice

    @property
    def checked_tools(self) -> list[dict] | None:
        """The checked tool definitions ({"name", "description", "parameters"}), after check_tools."""
        return self._functions

    @property
    def named_function(self) -> str | None:
        return self._tool_choice["name"] if isinstance(self._tool_choice, dict) else None

    def constraint_sources(self) -> list[ConstraintSource]:
        sources = super().constraint_sources()
        if self.tool_mode == "named":
            function = self._tool_choice
            i = next(i for i, f in enumerate(self._functions) if f is function)
            where = f"tools[{i}].function.parameters"
            sources.append(ConstraintSource("tool_choice", where, {"json": tool_calls.parameters_schema(function)},
                                            where))
        elif self.tool_mode == "required":
            try:
                schema = tool_calls.required_schema(self._functions)
            except ValueError as exc:
                raise APIError(str(exc), param=str(exc).split(":", 1)[0]) from None
            sources.append(ConstraintSource("tool_choice", "tools (the calls' schema for tool_choice 'required')",
                                            {"json": schema}, "tools"))
        return sources

    def reply_format(self, auto_calls: str | None, reasoning: bool, opened: bool) -> None:
        """How the reply is constrained beyond its own fields (reply_constraint.py): "auto" calls in a format
        the constraint can write, room for reasoning before a JSON answer or calls (the prompt opened it)."""
        self._reply = (auto_calls, reasoning, opened)

    @property
    def builds_regex(self) -> bool:
        """Whether constraint_source() turns schemas into a regex itself (then it runs off the event loop)."""
        auto_calls, reasoning, _ = self._reply
        return bool(auto_calls and self._functions and self.tool_mode == "auto") or (
            reasoning and bool(super().constraint_sources() or self.tool_mode in ("required", "named")))

    def constraint_source(self) -> ConstraintSource | None:
        auto_calls, reasoning, opened = self._reply
        return reply_source(super().constraint_source(), self._functions,
                            auto_calls if self.tool_mode == "auto" else None, reasoning, opened)

    def tool_parameter_sources(self) -> list[ConstraintSource]:
        """Each tool's parameters as a constraint of its own (to find the bad one when the joined
        schema of tool_choice "required" fails)."""
        out = []
        for i, function in enumerate(self._functions or ()):
            where = f"tools[{i}].function.parameters"
            out.append(ConstraintSource("tool_choice", where, {"json": tool_calls.parameters_schema(function)},
                                        where))
        return out

    def template_tools(self) -> list | None:
        """The tools as the chat template gets them (as sent; also with tool_choice "none", as vLLM does)."""
        return self.tools or None

    @property
    def response_role(self) -> str:
        """vLLM's: "assistant" after a generation prompt, else the last message's role (it is continued)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def wants_prompt_logprobs(self) -> int | None:
        """prompt_logprobs as given, else with echo top_logprobs (vLLM's rule); a stream never carries them."""
        if self.stream:
            return None
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.top_logprobs if self.echo and self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        self.check_tools()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        return tool_calls.template_messages([m.as_template_dict() for m in self.messages])

    def renames(self) -> dict[str, str]:
        derived = self.prompt_logprobs is None and self.wants_prompt_logprobs is not None
        return {"max_tokens": self.max_tokens_param, "logprobs": "top_logprobs", "prompt": "messages",
                "prompt_logprobs": "top_logprobs" if derived else "prompt_logprobs"}

    def sampling_params(self, max_tokens: int | None, vocab_size: int | None = None,
                        defaults: dict | None = None) -> SamplingParams:
        """`max_tokens`: the resolved limit (None: up to max_model_len, vLLM's default for chat); `defaults`: the
        model's recommended sampling defaults for the fields the request leaves out."""
        self._check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
        given = self._common_params(vocab_size, defaults)
        given["max_tokens"] = max_tokens
        if self.logprobs:
            given["logprobs"] = self.top_logprobs or 0
        if self.wants_prompt_logprobs is not None:
            given["prompt_logprobs"] = self.wants_prompt_logprobs
        return build_sampling_params(given, self.renames())


def build_sampling_params(given: dict, renames: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**given)
    except (ValueError, TypeError) as exc:
        raise APIError(str(exc), param=param_of(str(exc), renames)) from None


class BatchChatCompletionRequest(_Base):
    """vLLM's /v1/chat/completions/batch body: a chat request whose `messages` is a list of
    conversations; every other field is shared by all of them. Not streamed, no tools, n = 1
    (vLLM's limits: they are 400s naming the field here, not ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)
    messages: list[Annotated[list[dict[str, Any]], Field(min_length=1)]] = Field(min_length=1)

    def shared(self) -> dict[str, Any]:
        """The fields every conversation's chat request gets, checked against the batch's limits."""
        shared = dict(self.model_extra or {})
        if shared.get("stream"):
            raise APIError("stream: batch chat completions are not streamed (omit it or set it false)",
                           param="stream")
        if shared.get("tools") or shared.get("tool_choice") not in (None, "none"):
            param = "tools" if shared.get("tools") else "tool_choice"
            raise APIError(f"{param}: batch chat completions do not take tools", param=param)
        if shared.get("n") not in (None, 1):
            raise APIError(f"n: batch chat completions give one choice per conversation (n must be 1), got "
                           f"{shared['n']!r}", param="n")
        if shared.get("use_beam_search"):
            raise APIError("use_beam_search: beam search is not supported", param="use_beam_search")
        return shared
