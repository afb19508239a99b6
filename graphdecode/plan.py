"""StepPlan: the scheduler's only word to the runner, once per engine step.

Typed records of everything the runner must apply, in this order: rows that left the
batch (cleared), rows that join it (started: pages, sampling parameters, stop state),
block tables that grew (lookahead pages), then the prefill chunks to compute, then the
decode window. The runner alone turns these into staged device rows and launches; the
scheduler never touches staging, device buffers, backends or the sampler.

`readout` is for the engine's postprocessing, not the runner: which row's output
columns belong to which sequence once this step's copy arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:  # readouts carry the host's sequences back to it; the device never looks inside
    from .host.sequence import Sequence

SCRATCH_PAGE = 0  # page 0: never handed to a sequence; padded and finished rows write their K/V there


@dataclass(frozen=True, slots=True)
class RowStart:
    """A sequence joins the decode batch at `row`; its first token is sampled by this step's prefill."""

    row: int
    position: int  # index of the token the row feeds next (the one the prefill samples)
    pages: tuple[int, ...]  # its block table
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    max_len: int  # total tokens at which it is done
    min_len: int  # stop ids are masked while fewer tokens are held
    # for params with penalties only (else empty): the tokens so far, prompt first, from which the
    # runner stages the row's token counts and recent output tokens (after a preemption too)
    token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    structured: object = None  # a constrained row's TablePlacement (host/structured_store.py), else None
    state_slot: int = 0  # a hybrid's recurrent-state slot (attention/state_cache.py); 0: the scratch slot
    lora_slot: int = 0  # its LoRA adapter's device slot (lora/); 0: none


@dataclass(frozen=True, slots=True)
class LoRALoad:
    """Before this step's prefill: the adapter `adapter` (a lora.adapter.LoadedAdapter) goes into device slot
    `slot`, replacing what the slot held (no launched or planned row reads that any more)."""

    slot: int
    adapter: object


@dataclass(frozen=True, slots=True)
class TableGrowth:
    """Pages that now sit at block-table columns start, start + 1, ... of `row`."""

    row: int
    start: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixCopy:
    """A partial prefix-cache hit: the first `num_tokens` slots of cached page `source` hold
    the K/V of the sequence's tokens that follow its full-page hits; they are copied into
    `destination` (the sequence's own page there) in every layer, after the forward writes
    its K/V and before it attends, so `source` may be computed by that very forward."""

    source: int
    destination: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Compute K/V for tokens [start, start + len(token_ids)) of one sequence.

    Attention sees every earlier token (cached prefix pages, earlier chunks). Only a
    sequence's last chunk is sampled: into `sample_rows` (n rows for n > 1), after which
    `page_copies` give each child its own copy of the prompt's partial last page. A
    sequence's first chunk may carry a `prefix_copy` (a partial-page cache hit).
    """

    token_ids: tuple[int, ...]
    start: int
    pages: tuple[int, ...]  # the block table covering start + len(token_ids) tokens
    sample_rows: tuple[int, ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()  # (source page, destination page)
    prompt_logprobs: int | None = None  # top-N of prompt logprobs to compute (None: none)
    targets: tuple[int, ...] = ()  # the prompt tokens its first len(targets) positions predict
    prefix_copy: PrefixCopy | None = None
    next_token: int | None = None  # the token after the chunk where it is known (an EAGLE-3 head reads it)
    # a hybrid's recurrent state: the slot the chunk continues; for a sequence's first chunk, what the slot
    # starts from (0: zeros; s > 0: a copy of snapshot slot s, a prefix hit; None: a later chunk, it continues);
    # the slot it is copied into after the chunk (a prefix-cache snapshot; 0: none); and the n > 1 children's
    # slots that receive a copy after the last chunk
    state_slot: int = 0
    state_from: int | None = None
    state_snapshot: int = 0
    state_forks: tuple[int, ...] = ()
    lora_slot: int = 0  # the sequence's LoRA adapter's device slot (0: none)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class WindowSpec:
    bucket: int  # padded rows the window (and the output copy) covers
    decode: bool  # run the k decode steps (False: only the prefill's first tokens are read out)
    # the engine's speculation policy chose a speculative window (set before the plan reaches
    # any rank, so every tensor-parallel rank runs the same graph); it runs plain when a row
    # needs penalties, which would have to count every draft
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class Readout:
    """Row `row` of this step's output belongs to `seq` if its epoch still matches.

    Columns first_column..last: 0 is the prefill's first token, 1..k the window's steps.
    """

    row: int
    seq: Sequence
    epoch: int
    first_column: int


@dataclass(frozen=True, slots=True)
class PromptReadout:
    """A chunk's prompt logprobs belong to `request`'s prompt tokens start + 1 .. start + count."""

    request: object  # runtime.sequence.Request
    start: int
    count: int


@dataclass(slots=True)
class StepPlan:
    cleared_rows: list[int] = field(default_factory=list)
    started_rows: list[RowStart] = field(default_factory=list)
    grown_tables: list[TableGrowth] = field(default_factory=list)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    window: WindowSpec | None = None
    readout: list[Readout] = field(default_factory=list)
    prompt_readout: list[PromptReadout] = field(default_factory=list)  # chunks with prompt logprobs, in order
    # constraint tables placed since the last plan (host/structured_store.py), uploaded before any row starts
    table_uploads: list = field(default_factory=list)
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters into device slots, before anything else

    @property
    def launches(self) -> bool:
        """Whether the runner has device work to launch (rows to stage alone is not launching)."""
        return bool(self.prefill_chunks) or self.window is not None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefill_chunks)
