"""Reasoning separated from the answer (`--reasoning-parser`, vLLM's names): a model that thinks in a
`<think>...</think>` block before it answers (Qwen3: `qwen3`; DeepSeek-R1: `deepseek_r1`).

Chat Completions returns the block's text as `reasoning_content` (streamed as deltas of that field), the
Responses API as a reasoning item, the Messages API as a thinking block; the rest is the answer, which the
tool-call parser then reads.

Where the reasoning starts: in the output when it begins with `<think>`, or already in the prompt when the
chat template opened the block itself (DeepSeek-R1's and Qwen3-Thinking's templates end the prompt with
`<think>\\n`; `opened_in_prompt` tells). It ends at `</think>`. What the two names differ in is an output
that never opens a block: for `qwen3` it is all answer (thinking was off: `enable_thinking=False`, or the
model skipped it); for `deepseek_r1` it is all reasoning until a `</think>`, which R1 sometimes writes without
the opening tag. An output cut short (max_tokens) inside the block is all reasoning. Whitespace between
`</think>` and the answer is dropped (the templates' formatting), so `<think>a</think>\\n\\nb` is reasoning
"a" and answer "b"; the reasoning is kept as written.

`glm45` (GLM-4.5 / 4.6 / 4.7, which think in the same block; their template writes an empty block when
thinking is off) reads as `qwen3` does.

`ReasoningParser.feed(text) -> (reasoning, answer)` takes the output as it streams (cut anywhere, also inside
a tag) and holds back only what could still be the start of a tag; `finish()` returns what was held.
Feeding the whole text at once gives the same two strings as feeding it in pieces.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1", "glm45")


def check_reasoning_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    return name


def opened_in_prompt(prompt_text: str | None) -> bool:
    """Whether the rendered prompt ends inside a `<think>` block the template opened."""
    if not prompt_text:
        return False
    at = prompt_text.rfind(OPEN)
    return at >= 0 and prompt_text.find(CLOSE, at) < 0


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """One output's reasoning and answer, as it streams."""

    def __init__(self, name: str, opened: bool = False):
        self.name = name
        # "start": nothing decided yet; "reasoning": inside the block; "answer": after it (or no block at all)
        self.state = "reasoning" if opened else "start"
        self.buf = ""
        self.strip = False  # drop the whitespace that follows </think>
        self.reasoning_tokens = 0  # set by the caller that counts them (usage)

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning" or (self.state == "start" and self.name == "deepseek_r1")

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, answer = [], []
        while self.buf:
            if self.state == "start":
                body = self.buf.lstrip()
                if body.startswith(OPEN):
                    self.buf, self.state = body[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(body):  # whitespace and maybe the start of <think>: wait
                    break
                # no block opens the output: qwen3's is all answer, deepseek_r1's reasoning until </think>
                self.state = "reasoning" if self.name == "deepseek_r1" else "answer"
                continue
            if self.state == "reasoning":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    reasoning.append(self.buf[:at])
                    self.buf, self.state, self.strip = self.buf[at + len(CLOSE):], "answer", True
                    continue
                keep = _partial(self.buf, CLOSE)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.strip:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.strip = False
            answer.append(self.buf)
            self.buf = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished tag is text of the part it was in."""
        held, self.buf = self.buf, ""
        if self.state == "start":  # whitespace or a bare "<thi": no block after all
            return (held, "") if self.name == "deepseek_r1" else ("", held)
        if self.state == "reasoning":
            return held, ""
        return "", held.lstrip() if self.strip else held


def split_reasoning(name: str, text: str, opened: bool = False) -> tuple[str, str]:
    """A whole output's (reasoning, answer)."""
    parser = ReasoningParser(name, opened)
    reasoning, answer = parser.feed(text)
    more_reasoning, more_answer = parser.finish()
    return reasoning + more_reasoning, answer + more_answer
