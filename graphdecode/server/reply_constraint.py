"""The constraint a chat reply runs under, as one automaton on the device: the request's own constraint, tool
calls that are constrained from the moment they start, and room for the reasoning before both.

* `tool_choice="auto"` with a call format of call_formats.py (every `--tool-call-parser` but harmony): the
  reply is free text that never starts a call (for Hermes, text without the marker `<tool_call>`: `avoiding`;
  for llama3_json and pythonic, whose calls are the whole output, text that starts otherwise), then zero or
  more calls, each one of the tools' calls in that format with its parameters schema. The automaton is free
  (every token allowed but those that would complete a marker out of place) until a call starts; from there
  the call is constrained token by token, in the window, with no host round trip, so a model cannot write a
  malformed call even at temperature 1. With a response_format too, the reply is either content in that format
  or calls. A format whose tags are special tokens (Mistral's `[TOOL_CALLS]`) has the constraint read them as
  their text (StructuredOutputsParams.special_tokens).
* With a reasoning parser, a JSON format (response_format, vLLM's json / json_object) and tool calls
  ("auto", "required", named) come after the reasoning: `<think>` (or nothing, when the template opened
  the block in the prompt), free text without `</think>`, `</think>`, at most two newlines, then the
  constrained answer. The block is optional where the output opens it, and must close where the prompt
  opened it. A regex or choice constrains the whole output as written (a think block included, if the
  pattern writes one).

Everything is a regular expression over the reply's text (outlines-core compiles it with the vocabulary, as
any constraint; the compile cache keys it), so the window runs it as it runs any constraint.
"""

from __future__ import annotations

from ..structured.compiler import constraint_regex, escape_literal
from .call_formats import CALL_FORMATS
from .constraints import ConstraintSource, build_constraint
from .reasoning import CLOSE, OPEN
from .text_regex import avoiding

REASONING_GAP = r"\n{0,2}"  # between </think> and the answer


def _regex(source: ConstraintSource) -> str:
    return constraint_regex(build_constraint(source))


def reasoning_prefix(opened: bool) -> str:
    """Room for the reasoning before a constrained answer (see the module docstring)."""
    body = f"{avoiding(CLOSE)}{escape_literal(CLOSE)}{REASONING_GAP}"
    return body if opened else f"(?:{escape_literal(OPEN)}{body})?"


def reply_source(user: ConstraintSource | None, functions: list[dict] | None, auto_calls: str | None,
                 reasoning: bool, opened: bool) -> ConstraintSource | None:
    """The reply's one constraint: `user` (the request's own, or tool_choice "required" / named) as it is, or
    with the "auto" calls beside it (`auto_calls`: the call format, a name in call_formats.CALL_FORMATS, whose
    calls the constraint writes; None: none) and room for reasoning before it; None when nothing constrains
    the reply."""
    calls = bool(auto_calls) and bool(functions)
    json_like = user is not None and any(k in user.kwargs for k in ("json", "json_object"))
    think = reasoning and (calls or json_like)
    if not calls and not think:
        return user
    specials = ()
    if calls:
        fmt = CALL_FORMATS[auto_calls]
        specials = fmt.specials
        call_regex, reply = fmt.build(functions)
        # with the request's own format: that, or calls; else free text, then (once a call starts) calls
        body = f"(?:{_regex(user)}|{call_regex})" if user is not None else reply
    else:
        body = _regex(user)
    regex = (reasoning_prefix(opened) if think else "") + body
    kwargs = {"regex": regex, "special_tokens": specials} if specials else {"regex": regex}
    if user is not None:
        return ConstraintSource(user.param, user.label, kwargs, user.error_param)
    return ConstraintSource("tools", "tools (the calls' constraint for tool_choice 'auto')", kwargs, "tools")
