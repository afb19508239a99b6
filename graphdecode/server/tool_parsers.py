"""The formats tool_choice "auto" reads a model's calls in (`--tool-call-parser`, vLLM's names).

Every parser has HermesCalls' interface (tools.py): `feed(text) -> (content, tool-call deltas)`, `finish()`,
`num_calls`; `markers` is the text that opens a call and `special_markers` says whether it is a special
token the detokenizer drops unless `skip_special_tokens` is off (the server turns it off for "auto" then).

* `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5 / Qwen3).
"""

from __future__ import annotations

from .tools import HermesCalls


class Hermes(HermesCalls):
    markers = ("<tool_call>",)
    special_markers = False
    constrained = True  # "auto" calls are constrained from their marker on (reply_constraint.py)

    def __init__(self, functions: list[dict] | None = None):
        super().__init__()


TOOL_PARSERS: dict[str, type] = {"hermes": Hermes}


def tool_parser(name: str, functions: list[dict] | None):
    """A fresh parser of one reply in format `name`; ValueError naming --tool-call-parser otherwise."""
    try:
        return TOOL_PARSERS[name](functions)
    except KeyError:
        raise ValueError(f"--tool-call-parser: {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}") from None
