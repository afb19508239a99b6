"""Builds RequestOutputs from sequences: whole (generate) or as stream deltas.

A delta carries what a sequence gained since its last delta: new token ids, the
new stable text (text that can no longer be taken back by a stop string) and new
logprobs. Concatenating a sequence's deltas gives exactly its final output, and
exactly one of them carries its finish_reason.

`DeltaQueue` routes: each consumer of streamed outputs (an LLM.stream iterator, the
async engine core) owns one for its requests; whoever steps the engine pushes every
changed sequence to its request's queue, and the consumer builds the deltas when it
reads, so a consumer that reads late gets one merged delta, never a gap.
"""

from __future__ import annotations

from ..outputs import CompletionOutput, RequestOutput
from .sequence import Request, Sequence


def final_output(request: Request) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=seq.logprobs,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            )
            for seq in request.seqs
        ],
        finished=request.finished,
        prompt_logprobs=request.prompt_logprobs,
        metrics=request.metrics,
        num_cached_tokens=request.num_cached_tokens,
    )


def take_delta(seq: Sequence) -> CompletionOutput | None:
    """What the sequence gained since its last delta (advances its stream cursors)."""
    if seq.finish_streamed:
        return None
    finished = seq.is_finished
    seq.finish_streamed = finished
    text = seq.output_text
    stable = seq.detokenizer.stable_len(finished) if seq.detokenizer is not None else 0
    new_text = text[seq.num_streamed_chars : stable] if stable > seq.num_streamed_chars else ""
    tokens = seq.token_ids[seq.num_prompt_tokens + seq.num_streamed_tokens :]
    logprobs = None
    if seq.logprobs is not None:
        logprobs = seq.logprobs[seq.num_streamed_logprobs :]
        seq.num_streamed_logprobs = len(seq.logprobs)
    if not new_text and not tokens and not finished:
        return None
    seq.num_streamed_chars = max(seq.num_streamed_chars, stable)
    seq.num_streamed_tokens = seq.num_output_tokens
    return CompletionOutput(
        index=seq.index,
        text=new_text,
        token_ids=tokens,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=logprobs,
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
    )


def delta_outputs(changed: list[Sequence]) -> list[RequestOutput]:
    """One RequestOutput per request among the changed sequences, in first-seen order."""
    by_request: dict[int, RequestOutput] = {}
    for seq in changed:
        delta = take_delta(seq)
        if delta is None:
            continue
        request = seq.request
        out = by_request.get(id(request))
        if out is None:
            prompt_logprobs = None
            if request.prompt_logprobs is not None and not request.prompt_logprobs_streamed:
                prompt_logprobs, request.prompt_logprobs_streamed = request.prompt_logprobs, True  # with the first delta
            out = by_request[id(request)] = RequestOutput(
                request.request_id, request.prompt, request.prompt_token_ids, [], False,
                prompt_logprobs=prompt_logprobs, metrics=request.metrics,
                num_cached_tokens=request.num_cached_tokens,
            )
        out.outputs.append(delta)
        out.finished = request.finished
    return list(by_request.values())


class DeltaQueue:
    """The sequences of some requests that changed since their consumer last read."""

    __slots__ = ("_changed",)

    def __init__(self):
        self._changed: dict[int, Sequence] = {}  # seq_id -> sequence, first change first

    def push(self, seq: Sequence) -> None:
        self._changed.setdefault(seq.seq_id, seq)

    def __bool__(self) -> bool:
        return bool(self._changed)

    def take(self) -> list[RequestOutput]:
        """One delta RequestOutput per request that changed, in first-change order."""
        changed = list(self._changed.values())
        self._changed.clear()
        return delta_outputs(changed)
