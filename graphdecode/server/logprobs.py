"""Logprobs in the API's formats, from the engine's entries (per token, {token id: Logprob}, the
sampled token first, then the top alternatives with their ranks).

* /v1/completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (the sampled
  token's entry, then up to `logprobs` others), the echoed prompt's tokens first when `echo`
  (its first token has no logprob: null); `text_offset` counts on token by token, or comes from
  `token_offsets` for an echoed prompt.
* /v1/chat/completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`, the
  alternatives by rank, up to `top_logprobs`.
* `prompt_logprobs` (vLLM's, both endpoints): per prompt token, null (the first) or
  {token id: {"logprob", "rank", "decoded_token"}}.

JSON has no infinities: a -inf logprob is reported as -9999.0 (vLLM's convention).
"""

from __future__ import annotations

import itertools

from ..host.detokenizer import Detokenizer


def finite(value: float) -> float:
    """JSON has no infinities: -inf logprobs are reported as -9999.0 (vLLM's convention)."""
    return value if value > -9999.0 else -9999.0


def _piece(lp, token_id: int, as_ids: bool = False) -> str:
    if not as_ids and lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return f"token_id:{token_id}"


class LogprobFormat:
    """One request's logprobs: `top_n` alternatives per token (-1: all the engine sent), tokens
    as "token_id:123" when `as_ids` (vLLM's return_tokens_as_token_ids). The tokenizer decodes
    an echoed prompt's first token, which has no entry."""

    __slots__ = ("top_n", "as_ids", "tokenizer")

    def __init__(self, top_n: int, as_ids: bool, tokenizer=None):
        self.top_n, self.as_ids, self.tokenizer = top_n, as_ids, tokenizer

    # ------------------------------------------------------------- /v1/completions
    def completion(self, token_ids, entries, offset: int, offsets: list[int] | None = None,
                   end: int = 0) -> tuple[dict, int]:
        """The completions format for these tokens, and the text_offset of the token after them:
        text_offset from `offsets` (then the next token starts at `end`) or counted on from
        `offset` by the length of each token's text."""
        tokens, values, top = self._lists(token_ids, entries)
        if offsets is None:
            offsets = []
            for piece in tokens:
                offsets.append(offset)
                offset += len(piece)
        else:
            offsets, offset = list(offsets), end
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": offsets}, offset

    def echo(self, ids: list[int], text: str, offsets: list[int] | None, prompt_logprobs) -> tuple[dict, int]:
        """The echoed prompt's part of a choice's logprobs (its first token has none; all of them
        none without prompt logprobs), and the text_offset of the first generated token."""
        entries = prompt_logprobs if prompt_logprobs is not None else [None] * len(ids)
        return self.completion(ids, entries, 0, offsets, len(text))

    def _lists(self, token_ids, entries) -> tuple[list, list, list]:
        """tokens, token_logprobs, top_logprobs (the sampled token's entry, then up to top_n others)."""
        top_n, as_ids = self.top_n, self.as_ids
        tokens, values, top = [], [], []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:  # the first prompt token: nothing before it predicts it
                tokens.append(f"token_id:{token_id}" if as_ids else self._decode_one(token_id))
                values.append(None)
                top.append(None)
                continue
            sampled = entry.get(token_id)
            tokens.append(_piece(sampled, token_id, as_ids))
            values.append(finite(sampled.logprob) if sampled is not None else None)
            items = entry.items() if top_n < 0 else itertools.islice(entry.items(), top_n + 1)
            top.append({_piece(lp, tid, as_ids): finite(lp.logprob) for tid, lp in items})
        return tokens, values, top

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    # ------------------------------------------------------------- /v1/chat/completions
    def chat(self, token_ids, entries) -> list[dict]:
        """The chat format's `content` list for these tokens."""
        top_n, as_ids = self.top_n, self.as_ids
        content = []
        for token_id, entry in zip(token_ids, entries):
            sampled = entry.get(token_id)
            piece = _piece(sampled, token_id, as_ids)
            top = sorted((lp.rank, tid, lp) for tid, lp in entry.items()
                         if lp.rank is not None and (top_n < 0 or lp.rank <= top_n))
            content.append({
                "token": piece,
                "logprob": finite(sampled.logprob) if sampled is not None else -9999.0,
                "bytes": list(piece.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {"token": (t := _piece(lp, tid, as_ids)), "logprob": finite(lp.logprob),
                     "bytes": list(t.encode("utf-8", errors="replace"))}
                    for _, tid, lp in top
                ],
            })
        return content


def joined(first: dict | None, second: dict) -> dict:
    """Two parts of one choice's completions logprobs, in order (`first`'s lists are extended)."""
    if first is None:
        return second
    for key, values in second.items():
        first[key].extend(values)
    return first


def prompt_logprobs_json(entries) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, null (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def token_offsets(tokenizer, ids: list[int], text: str, skip_special: bool) -> list[int] | None:
    """Where each token starts in `text` (an echoed prompt's text_offset), if decoding the ids
    incrementally gives exactly `text` (else None). A token that adds no text of its own (a
    skipped special token, the first bytes of a character) starts where the next text does."""
    detok = Detokenizer(tokenizer.backend_tokenizer, [], skip_special, (), False)
    offsets = []
    for token_id in ids:
        offsets.append(len(detok.text))
        detok.add([token_id])
    detok.finish()
    return offsets if detok.text == text else None
