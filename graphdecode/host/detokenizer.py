"""Incremental detokenization and stop strings, one Detokenizer per sequence.

Text grows by decoding a short sliding window of token ids with the Rust tokenizer
(the prefix/read-offset scheme): the new text is what `decode(window)` adds over
`decode(window without the new ids)`. While the decoded window ends in an
incomplete UTF-8 character the ids are held back, so no delta ever carries a broken
character; `finish()` flushes whatever is held when the sequence ends, so the final
text equals decoding all output tokens. Work per call is proportional to the new
tokens and a few ids of context, never to the sequence's history.

Stop strings are matched on the host as text grows, across token boundaries. The
last `max(len(stop)) - 1` characters are held back from streaming (`stable_len`)
until it is certain they do not start a stop string, so text handed out never has
to be taken back. Grouped stop token ids (host/stop_sequences.py) hold back the text of
the last `hold_tokens` tokens the same way, and `drop_tokens` takes a matched group's
text out.
"""

from __future__ import annotations

from collections import deque

PROMPT_CONTEXT_TOKENS = 6  # prompt tail kept as context so the first word decodes with its space
REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool, stop: tuple[str, ...], include_stop: bool,
                 hold_tokens: int = 0):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])  # context + ids not yet turned into text
        self._read = len(self._ids)  # ids[:read] decode to text already emitted: context for the rest
        self._context_text = self._decode(self._ids)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        # len(text) before each of the last hold_tokens + 1 tokens, while a group's text could be dropped
        self._marks = deque(maxlen=hold_tokens + 1) if hold_tokens and not include_stop else None

    def add(self, token_ids: list[int]) -> None:
        """Append tokens without stop-string matching."""
        if self._marks is None:
            self._ids.extend(token_ids)
            self._emit(final=False)
            return
        for token_id in token_ids:  # one at a time: each token's text is where a group's can start
            self._marks.append(len(self.text))
            self._ids.append(token_id)
            self._emit(final=False)

    def drop_tokens(self, n: int) -> None:
        """Take the text of the last n tokens out (a matched stop group, n <= hold_tokens + 1)."""
        if self._marks is not None:
            self.finish()  # the group's ids leave nothing held behind them
            self.text = self.text[: self._marks[-n]]

    def add_and_match(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is then truncated)."""
        before = len(self.text)
        self.add([token_id])
        return self._match(before) if len(self.text) > before else None

    def finish(self) -> None:
        """The sequence ended: emit held-back ids even if they end in an incomplete character."""
        self._emit(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _emit(self, final: bool) -> None:
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._context_text) or (new_text.endswith(REPLACEMENT) and not final):
            return
        self.text += new_text[len(self._context_text) :]
        # the ids just emitted become the context; older ids are no longer needed
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._context_text = self._decode(self._ids)

    def _match(self, before: int) -> str | None:
        best = None
        for stop in self.stop:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def stable_len(self, finished: bool) -> int:
        """How much of `text` can be streamed now without risking a take-back."""
        if finished:
            return len(self.text)
        stable = max(0, len(self.text) - self.holdback)
        if self._marks:  # the text of the last hold_tokens tokens may yet be a group's
            stable = min(stable, self._marks[-min(len(self._marks), self._marks.maxlen - 1)])
        return stable
