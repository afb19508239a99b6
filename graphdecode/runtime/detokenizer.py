"""Incremental detokenization and stop strings, one Detokenizer per sequence.

Built on tokenizers' DecodeStream (Rust), which holds back partial UTF-8 until a
character is complete, so no delta ever carries a broken character. Work per call
is proportional to the new tokens, never to the sequence's history.

Stop strings are matched on the host as text grows, across token boundaries. The
last `max(len(stop)) - 1` characters are held back from streaming (`stable_len`)
until it is certain they do not start a stop string, so text handed out never has
to be taken back.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 6  # prompt tail given to the decoder so the first word gets its space right


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids, skip_special_tokens: bool, stop: tuple[str, ...], include_stop: bool):
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def add(self, token_ids: list[int]) -> None:
        """Append tokens without stop-string matching (the sequence has none)."""
        chunk = self._stream.step(self._tokenizer, token_ids)
        if chunk:
            self.text += chunk

    def add_and_match(self, token_id: int) -> str | None:
        """Append one token; return the stop string it completed (text is then truncated)."""
        before = len(self.text)
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return None
        self.text += chunk
        return self._match(before)

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
        return len(self.text) if finished else max(0, len(self.text) - self.holdback)
