"""Turns a pythonized window into sequence progress: tokens, text, stops, finishes.

For each row the window held, it takes the row's new tokens and applies, on the
host, exactly the stop rules the device applied (stop ids, max_len), plus the
host-only stop strings and grouped stop ids. Tokens after the first stop are discarded, so tokens a row
produced past its stop inside a window never reach the user. Work is proportional to
the rows in the window and the tokens they produced.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..outputs import Logprob
from .sequence import Sequence
from .stop_sequences import stop_reason as stop_sequence_reason

if TYPE_CHECKING:  # what the executor's pending copy returns
    from ..device.pythonizer import WindowResult


class OutputProcessor:
    def __init__(self, tokenizer, on_finish):
        self.tokenizer = tokenizer
        self.on_finish = on_finish  # (sequence) -> None: frees its row and pages
        self._pieces: dict[int, str] = {}  # token id -> its decoded text

    def process(self, readout, decode: bool, result: WindowResult, stats) -> list[Sequence]:
        """readout: the step's Readout records; `decode`: a window ran, and each row wrote
        columns 1..counts[row] (k, or up to k (d + 1) when speculating); without one only
        the prefill's column 0 is new. Returns the sequences that changed."""
        changed = []
        now = time.time()
        for r in readout:
            seq = r.seq
            if seq.is_finished or seq.epoch != r.epoch:
                continue  # finished, aborted or preempted since launch: its tokens are void
            end = 1 + int(result.counts[r.row]) if decode else 1
            tokens = result.tokens[r.row, r.first_column : end].tolist()
            metrics = seq.request.metrics
            if metrics is not None and tokens:
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
            accepted = self._accept(seq, tokens)
            if result.lp_sampled is not None and seq.logprobs is not None:
                self._logprobs(seq, result, r.row, r.first_column, accepted)
            first_token = r.first_column == 0 and accepted > 0
            stats.decode_tokens += accepted - first_token
            if first_token:
                stats.first_token_prompt_tokens += seq.num_prompt_tokens
            stats.generated_tokens += accepted
            changed.append(seq)
        return changed

    def _accept(self, seq: Sequence, tokens: list[int]) -> int:
        """Append tokens up to the first stop; returns how many were taken."""
        params = seq.request.params
        taken = []
        reason = stop_reason = group = None
        groups = seq.stop_sequences
        for tok in tokens:
            taken.append(tok)
            seq.token_ids.append(tok)
            if groups is not None and seq.num_output_tokens > params.min_tokens:
                group = groups.match(seq.token_ids, seq.num_output_tokens)
                if group is not None:  # before the single ids: a group wins a tie (vLLM)
                    reason, stop_reason = "stop", stop_sequence_reason(group)
                    break
            if tok in seq.stop_ids:
                reason = "stop"
                stop_reason = tok if tok in params.single_stop_token_ids else None
                break
            if seq.num_tokens >= seq.max_len:
                reason = "length"
                break
        detok = seq.detokenizer
        if detok is not None:
            text_tokens = taken
            if reason == "stop" and not params.include_stop_str_in_output and group is None:
                text_tokens = taken[:-1]  # the stop token's own text is not output
            if detok.stop:
                # token by token, so the sequence ends at the token that completed the stop string
                for i, tok in enumerate(text_tokens):
                    produced = seq.num_output_tokens - len(taken) + i + 1
                    hit = detok.add_and_match(tok) if produced > params.min_tokens else detok.add([tok])
                    if hit is not None:
                        del seq.token_ids[seq.num_tokens - len(taken) + i + 1 :]
                        taken = taken[: i + 1]
                        reason, stop_reason, group = "stop", hit, None
                        break
            elif text_tokens:
                detok.add(text_tokens)
            if group is not None and not params.include_stop_str_in_output:
                detok.drop_tokens(len(group))  # the group's text, some of it from earlier windows
        if reason is not None:
            seq.finish_reason = reason
            seq.stop_reason = stop_reason
            self.on_finish(seq)
        return len(taken)

    def _logprobs(self, seq: Sequence, result: WindowResult, row: int, first: int, count: int) -> None:
        """The sampled token first (with its rank), then the top `logprobs` not already in
        (vLLM's layout: logprobs=0 gives the sampled token alone, the whole vocabulary at -1)."""
        wanted = seq.request.params.logprobs
        piece = self._piece if seq.request.params.detokenize else _no_text
        tokens = seq.token_ids[seq.num_tokens - count :]
        columns = slice(first, first + count)
        sampled = result.lp_sampled[row, columns].tolist()
        ranks = result.lp_rank[row, columns].tolist()
        top_ids = result.lp_top_ids[row, columns, :wanted].tolist()
        top = result.lp_top[row, columns, :wanted].tolist()
        for i, tok in enumerate(tokens):
            entry = {tok: Logprob(sampled[i], ranks[i], piece(tok))}
            for rank, (tid, tlp) in enumerate(zip(top_ids[i], top[i]), 1):
                if tid not in entry:
                    entry[tid] = Logprob(tlp, rank, piece(tid))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += sampled[i]

    def prompt_logprobs(self, readout, results) -> None:
        """Prompt logprobs computed by this step's prefill chunks, onto their requests (in order)."""
        for r, host in zip(readout, results):
            request = r.request
            if request.prompt_logprobs is None:
                continue
            chosen, rank = host[0].tolist(), host[1].tolist()
            top_lp, top_ids = (host[2].tolist(), host[3].tolist()) if len(host) > 2 else ([], [])
            decode = request.params.detokenize
            del request.prompt_logprobs[r.start + 1 :]  # a recomputed prefix replaces what it covers
            targets = request.prompt_token_ids[r.start + 1 : r.start + 1 + r.count]
            for i, token in enumerate(targets):
                entry = {token: Logprob(chosen[i], rank[i], self._piece(token) if decode else None)}
                for place, (tid, lp) in enumerate(zip(top_ids[i] if top_ids else (), top_lp[i] if top_lp else ())):
                    if tid not in entry:
                        entry[tid] = Logprob(lp, place + 1, self._piece(tid) if decode else None)
                request.prompt_logprobs.append(entry)

    def _piece(self, token_id: int) -> str | None:
        """A token's text, decoded once per token id (whole-vocabulary logprobs ask for every one)."""
        text = self._pieces.get(token_id)
        if text is None and self.tokenizer is not None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return text


def _no_text(token_id: int) -> None:
    return None
