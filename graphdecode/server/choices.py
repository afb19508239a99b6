"""What each choice of a response accumulates as its engine deltas arrive.

`Choices` holds one `Choice` per choice of a response (index `prompt_index * n + i`) and what
the response learns per prompt (its prompt logprobs, its tokens found in the prefix cache).
Every response, streamed or whole, of either endpoint, folds each engine delta into its choice
(`Choices.fold`): the choice counts its tokens (for usage), keeps its finish and stop reasons
and, for a whole response (`keep`), its text, token ids and logprob entries. The fold returns
the delta as the response shows it (`Delta`): a stream sends it at once, a whole response is
built from what its choices kept once all of them are done.

With a reasoning parser (reasoning.py), each choice splits its text into reasoning and answer as it
arrives; with tools, the answer goes through the choice's own tool-call parser (tools.py,
tool_parsers.py): a stream feeds it each delta (`parts`), a whole response the whole answer once
(`whole_parts`); the content and calls are the same. Their finish_reason is OpenAI's ("tool_calls" for a
reply of complete calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from . import tools as tool_calls
from .reasoning import ReasoningParser
from .tool_parsers import tool_parser

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


def _tool_parser(job: Job):
    """A fresh parser of one choice's answer into content and tool calls (tools.py, tool_parsers.py)."""
    if job.tool_mode == "auto":
        return tool_parser(job.tool_parser, job.functions)
    if job.tool_mode == "required":
        return tool_calls.RequiredCalls()
    return tool_calls.NamedCall(job.tool_name)


class Choice:
    """One choice: its deltas folded in. `started` and `offset` are a stream's (its first chunk
    went out; the text_offset of its next completions token)."""

    __slots__ = ("index", "prompt", "text", "token_ids", "logprobs", "num_tokens", "finish_reason", "stop_reason",
                 "started", "offset", "tool_mode", "tools", "reasoning", "reasoning_tokens", "split", "answer",
                 "thought", "_keep", "_blank")

    def __init__(self, index: int, prompt: int, keep: bool, job: Job | None = None):
        self.index, self.prompt = index, prompt
        self._keep = keep  # a whole response's: the text, token ids and logprob entries are kept
        self._blank = job is not None and job.echo_only  # completions' echo, max_tokens 0: its token not returned
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []  # the engine's entries, one per token
        self.num_tokens = 0  # tokens returned so far (usage)
        self.finish_reason = None
        self.stop_reason = None
        self.started = False
        self.offset = 0
        self.tool_mode = job.tool_mode if job is not None else None  # None, "auto", "required" or "named"
        self.tools = _tool_parser(job) if self.tool_mode else None
        self.reasoning = (ReasoningParser(job.reasoning, job.reasoning_opened)
                          if job is not None and job.reasoning else None)
        self.reasoning_tokens = 0  # tokens generated inside the reasoning (usage)
        self.split = ("", "")  # the last delta's (reasoning, answer)
        self.thought: list[str] = []  # a whole response's reasoning and answer
        self.answer: list[str] = []

    def fold(self, out: CompletionOutput) -> Delta:
        """Take in one engine delta; returns it as the response shows it."""
        if self._blank:
            delta = Delta("", (), (), out.finish_reason, out.stop_reason)
        else:
            delta = Delta(out.text, out.token_ids, out.logprobs, out.finish_reason, out.stop_reason)
        self.num_tokens += len(delta.token_ids)
        if self.reasoning is not None:  # split as it arrives (its tokens counted while inside the reasoning)
            if self.reasoning.in_reasoning:
                self.reasoning_tokens += len(delta.token_ids)
            thought, answer = self.reasoning.feed(delta.text)
            if delta.finish_reason is not None:
                more_thought, more_answer = self.reasoning.finish()
                thought, answer = thought + more_thought, answer + more_answer
            self.split = (thought, answer)
            if self._keep:
                self.thought.append(thought)
                self.answer.append(answer)
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

    # ------------------------------------------------------------- reasoning and tool calls
    def parts(self, delta: Delta) -> tuple[str, str, list[dict], str | None]:
        """Streamed (after fold): the delta's reasoning, content and tool-call deltas, and its finish_reason
        (the last delta brings what the parsers held back)."""
        thought, text = self.split if self.reasoning is not None else ("", delta.text)
        if self.tools is None:
            return thought, text, [], delta.finish_reason
        content, calls = self.tools.feed(text)
        finish_reason = delta.finish_reason
        if finish_reason is not None:
            more, last = self.tools.finish()
            content, calls = content + more, calls + last
            finish_reason = self._finish_reason(finish_reason)
        return thought, content, calls, finish_reason

    def whole_parts(self) -> tuple[str, str, list[dict], str | None]:
        """Whole: the reply's reasoning, content and tool_calls, and its finish_reason."""
        thought, text = ("".join(self.thought), "".join(self.answer)) if self.reasoning is not None \
            else ("", self.whole_text())
        if self.tools is None:
            return thought, text, [], self.finish_reason
        content, calls = tool_calls.parse_all(self.tools, text)
        return thought, content, calls, self._finish_reason(self.finish_reason)

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
        self.by_index = {p * n + i: Choice(p * n + i, p, keep, job) for p in range(len(job.prompt_lens))
                         for i in range(n)}
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
