"""What each choice of a response accumulates as its engine deltas arrive.

`Choices` holds one `Choice` per choice of a response (index `prompt_index * n + i`) and what
the response learns per prompt (its prompt logprobs, its tokens found in the prefix cache).
Every response, streamed or whole, of either endpoint, folds each engine delta into its choice
(`Choices.fold`): the choice counts its tokens (for usage), keeps its finish and stop reasons
and, for a whole response (`keep`), its text, token ids and logprob entries. The fold returns
the delta as the response shows it (`Delta`): a stream sends it at once, a whole response is
built from what its choices kept once all of them are done.

With tools, each choice has its own tool-call parser (tools.py): a stream feeds it each delta
(`stream_calls`), a whole response its whole text once (`whole_calls`); the content and calls
are the same. Their finish_reason is OpenAI's ("tool_calls" for a reply of complete calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from . import tools as tool_calls

if TYPE_CHECKING:
    from ..outputs import CompletionOutput, RequestOutput
    from .serving import Job


class Delta(NamedTuple):
    """One engine delta of a choice, as its response shows it."""

    text: str
    token_ids: Sequence[int]
    logprobs: Sequence | None  # the engine's entries for token_ids (None: not asked for)
    finish_reason: str | None
    stop_reason: int | str | None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _tool_parser(tool_mode: str, tool_name: str | None):
    """A fresh parser of one choice's output into content and tool calls (tools.py)."""
    if tool_mode == "auto":
        return tool_calls.HermesCalls()
    if tool_mode == "required":
        return tool_calls.RequiredCalls()
    return tool_calls.NamedCall(tool_name)


class Choice:
    """One choice: its deltas folded in. `started` and `offset` are a stream's (its first chunk
    went out; the text_offset of its next completions token)."""

    __slots__ = ("index", "prompt", "text", "token_ids", "logprobs", "num_tokens", "finish_reason", "stop_reason",
                 "started", "offset", "tool_mode", "tools", "_keep", "_blank")

    def __init__(self, index: int, prompt: int, keep: bool, blank: bool = False, tool_mode: str | None = None,
                 tool_name: str | None = None):
        self.index, self.prompt = index, prompt
        self._keep = keep  # a whole response's: the text, token ids and logprob entries are kept
        self._blank = blank  # completions' echo with max_tokens 0: the one token generated is not returned
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # the engine's entries, one per token
        self.num_tokens = 0  # tokens returned so far (usage)
        self.finish_reason = None
        self.stop_reason = None
        self.started = False
        self.offset = 0
        self.tool_mode = tool_mode  # None, "auto", "required" or "named" (ChatCompletionRequest.tool_mode)
        self.tools = _tool_parser(tool_mode, tool_name) if tool_mode else None

    def fold(self, out: CompletionOutput) -> Delta:
        """Take in one engine delta; returns it as the response shows it."""
        if self._blank:
            delta = Delta("", (), (), out.finish_reason, out.stop_reason)
        else:
            delta = Delta(out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason)
        self.num_tokens += len(delta.token_ids)
        if self._keep:
            if delta.text:
                self.text.append(delta.text)
            self.token_ids.extend(delta.token_ids)
            if delta.logprobs:
                self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        return delta

    def whole_text(self) -> str:
        return "".join(self.text)

    # ------------------------------------------------------------- tool calls
    def stream_calls(self, delta: Delta) -> tuple[str, list[dict], str | None]:
        """Streamed, with tools: the delta's content and tool-call deltas, and its finish_reason
        (the last delta brings what the parser held back)."""
        content, calls = self.tools.feed(delta.text)
        finish_reason = delta.finish_reason
        if finish_reason is not None:
            more, last = self.tools.finish()
            content, calls = content + more, calls + last
            finish_reason = self._finish_reason(finish_reason)
        return content, calls, finish_reason

    def whole_calls(self) -> tuple[str, list[dict], str | None]:
        """Whole, with tools: the reply's content and tool_calls, and its finish_reason."""
        content, calls = tool_calls.parse_all(self.tools, self.whole_text())
        return content, calls, self._finish_reason(self.finish_reason)

    def _finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the reply's calls are complete ("auto" that made some, or
        "required"); a named function's call ends with "stop", a cut one with "length"."""
        if engine_reason == "stop" and self.tools.num_calls and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


class Choices:
    """All the choices of one response, in index order, with what it learns per prompt and its usage."""

    def __init__(self, job: Job, prefix_caching: bool, keep: bool = False):
        n = self.n = job.n
        self.prompt_lens = job.prompt_lens
        self.prefix_caching = prefix_caching  # usage reports prompt_tokens_details
        self.by_index = {p * n + i: Choice(p * n + i, p, keep, job.echo_only, job.tool_mode, job.tool_name)
                         for p in range(len(job.prompt_lens)) for i in range(n)}
        self.prompt_logprobs: dict[int, list] = {}  # per prompt, with its request's first delta
        self.cached: dict[int, int] = {}  # per prompt: its tokens found in the prefix cache

    def __iter__(self):
        return iter(self.by_index.values())

    def fold(self, prompt: int, out: RequestOutput) -> list[tuple[Choice, Delta]]:
        """Take in one RequestOutput of prompt `prompt`; returns its choices' deltas, in order."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = out.prompt_logprobs
        if out.num_cached_tokens is not None:
            self.cached[prompt] = out.num_cached_tokens
        folded = []
        for c in out.outputs:
            choice = self.by_index[prompt * self.n + c.index]
            folded.append((choice, choice.fold(c)))
        return folded

    def usage(self) -> dict:
        """OpenAI's usage, over all prompts and choices; with prefix caching on,
        prompt_tokens_details.cached_tokens once the engine reported it for every prompt."""
        usage = _usage(sum(self.prompt_lens), sum(choice.num_tokens for choice in self))
        if self.prefix_caching and len(self.cached) == len(self.prompt_lens):
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self.cached.values())}
        return usage

    def running_usage(self, choice: Choice) -> dict:
        """vLLM's continuous usage stats: the choice's prompt tokens and its tokens so far."""
        return _usage(self.prompt_lens[choice.prompt], choice.num_tokens)
