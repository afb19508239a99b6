"""When a window speculates: the host's choice, per window, from measured acceptance and cost.

A speculative window emits 1 + a tokens per row and round, where a is the mean number of
accepted drafts per verify; it costs c plain windows, where c = (speculative window
time) / (plain window time) at the same bucket. It pays when 1 + a >= c. Both are
measured, not assumed: the speculative windows report their acceptance one window late,
and every decode window reports its own time (device time from CUDA events on a GPU,
where a verify of d + 1 tokens costs about what one decode step does, so c is near 1;
wall time on a CPU, where the verify's matmuls grow with d + 1 and c is 1.1 to 5). A graph's window
(a GPU's, or a compiled one) costs its bucket's shape whatever its rows hold, so c is the bucket's
measured ratio. An eager CPU window runs its live rows alone, and of a verify only the queries a
row drafted: what speculating adds is its drafted queries times a query's cost, measured as the
speculative windows' time over the plain windows' (brought to as many live rows) per drafted
query, and expected for a window from the rows it holds and the drafts a row makes a verify (an
n-gram row that finds no match drafts none): a one-row tail's verify costs little where a full
bucket's costs twice a plain window.

The policy keeps exponential averages of a and of each (bucket, kind) window time, the kinds
plain or speculative and greedy or sampled (a window with a row at temperature > 0 pays for its
noise and, speculating, for rejection sampling's distributions: its ratio is its own, the greedy
one standing in until both sampled kinds have run). With
no acceptance report yet it launches one speculative window (a probe) and then plain
ones until that report arrives; afterwards it speculates while
a >= max(min_accepted, c (1 + headroom) - 1) (headroom 10%: a near-even bet is not worth the noise
of its measures), and
otherwise runs plain windows with a probe now and then, to notice when drafting starts to
pay. A probe at a bucket whose cost ratio is measured loses (c - 1 - a) plain windows of
that bucket's time; it runs once the bucket's plain time since its last probe, times
`probe_budget` (1%), covers that loss: losing probes take about 1% of each bucket's time,
a probe that nearly paid comes back within a few windows and one that would lose a whole
window after 100 (a draft head's upkeep in plain windows takes about 1% more, so a workload
whose drafts never pay stays within 2-3% of plain decoding). Acceptance is the requests'
property, not the engine's: a stretch of text a head cannot predict must not keep speculation
off for whatever comes next, and one request's copying must not make its batch company speculate. So each sequence keeps its own
average (`Sequence.spec_acceptance`, from its rows of the speculative windows' reports), and a
window weighs the rows it holds; a row with no report yet counts as the engine-wide average (the
prior). With requests waiting for a row, the mean (a row finishing early makes room for one: the
window's tokens are what count); with none waiting, the batch lasts as long as its longest row, and
speculating must not make that row later: the acceptance of the rows that bound the batch (with
equal remaining tokens, the least accepting one), where f rows not yet measured count on the least
of f draws from the recent rows' acceptance (its 1 / (f + 1) quantile), not on its mean. The window
is chosen once its rows are known (the scheduler asks after admitting this step's joiners). Where
the ratio is not measured yet at a bucket, it is estimated, so that the first speculative window at
a bucket does not lose what a measure would have spared: a forward over R rows costs m + R b (m the
weights' read, b a row's arithmetic), so a speculative window at bucket B costs a plain one plus
k B d b (its verifies run B (d + 1) rows where plain steps run B). b comes from the prefills
(t = m + P b over P prompt tokens) and m from the smallest bucket's measured plain window; a bucket
without a plain measure takes k (m + B b) as its plain window. On two AVX2 cores it puts a batch-16
window with d = 4 at 2.9-3.0 plain ones, where 3.3-3.4 were measured; on a GPU b is small and the
estimate near 1. Without an estimate either (no prefill timed yet; a first window of each kind
is not timed where it may capture a graph or compile: on a GPU, with compile=True or the CPU graph
twin), the next probe comes after `probe_every` plain windows, twice that after each probe that
did not pay (the cost unknown, up to 8% of the windows could be losing probes otherwise); after
`max_probe_every` plain windows, always (this count only where the loss is unknown: a probe
whose loss is known waits for the budget, however long, so an expensive bucket's probes stay at
1% of its time and never lose several plain windows at once off schedule).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Sequence


def any_sampled(rows: Iterable[Sequence]) -> bool:
    """Whether some of these sequences sample (temperature > 0): a window of them is a sampled one."""
    return any(not seq.request.params.is_greedy for seq in rows)


class SpecPolicy:
    def __init__(self, enabled: bool, min_accepted: float = 0.5, probe_every: int = 16,
                 max_probe_every: int = 256, smoothing: float = 0.5, probe_budget: float = 0.01,
                 first_window_untimed: bool = True, draft_tokens: int = 0, steps_per_window: int = 1,
                 headroom: float = 0.1, live_queries: bool = False):
        self.enabled = enabled
        # an eager CPU window runs its live rows' drafted queries alone, so its cost follows them; a graph's (or a
        # compiled window's) is its bucket's shape, whatever its rows hold
        self.live_queries = live_queries
        self.headroom = headroom  # speculate where 1 + a >= c (1 + headroom): a near-even bet is not worth its noise
        self.draft_tokens = draft_tokens  # d: a verify runs d + 1 rows per row (0: no estimate of the cost)
        self.steps_per_window = steps_per_window  # k: steps (rounds) a window runs
        # a bucket's first window of each kind may capture a graph or compile: not a measure of its cost (eager
        # CPU windows have no first-time work, and their first window is timed)
        self.first_window_untimed = first_window_untimed
        self.min_accepted = min_accepted
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.smoothing = smoothing
        self.probe_budget = probe_budget
        self.accepted_per_verify: float | None = None  # unknown until a speculative window reports
        # (bucket, speculative, sampled) -> average: a sampled window (some row at temperature > 0) pays for its
        # noise and, speculating, for rejection sampling's distributions: its own cost ratio
        self.window_seconds: dict[tuple[int, bool, bool], float] = {}
        # (bucket, sampled) -> averages of the measured speculative windows' (drafted queries, live rows)
        self._spec_shape: dict[tuple[int, bool], tuple[float, float]] = {}
        self.drafts_per_verify: float | None = None  # a row's drafts per verify (n-gram rows may draft fewer than d)
        self._seen: set[tuple[int, bool, bool]] = set()  # keys whose first (warm-up, maybe compiling) window passed
        self._probing = False  # a probe window is in flight: wait for its report
        self._plain_since = 0  # plain windows since the last probe
        self._plain_seconds: dict[int, float] = {}  # per bucket: the plain time since its last probe
        self.interval = probe_every  # plain windows between probes while the cost is not measured
        self._prefill: tuple[float, float] | None = None  # averages of a timed prefill's tokens and seconds
        self.waiting = 0  # requests waiting for a row when the window is chosen
        self._row_samples: deque[float] = deque(maxlen=256)  # recent rows' acceptance in a window, one per report
        self.min_samples = 8  # ... before their quantiles stand in for rows without a report

    def cost_ratio(self, bucket: int, sampled: bool = False, rows: int | None = None) -> float | None:
        """A speculative window's time over a plain one's at this bucket, for windows with sampled rows or
        without, holding `rows` live rows (default: the bucket's): measured once both kinds are (else the
        other sampling kind's measure), else estimated (None: neither)."""
        cost = self._cost(bucket, sampled, rows)
        return None if cost is None or cost[0] <= 0 else 1.0 + cost[1] / cost[0]

    def plain_seconds(self, bucket: int, sampled: bool = False, rows: int | None = None) -> float | None:
        """A plain window's time at this bucket (of `rows` live rows): measured (this kind's, else the other's),
        else estimated from the row costs."""
        for kind in (sampled, not sampled):
            measured = self.window_seconds.get((bucket, False, kind))
            if measured is not None:
                return self._scaled(measured, bucket, rows)
        line = self.row_costs()
        return None if line is None else self._scaled(self._plain_estimate(bucket, line), bucket, rows)

    def _cost(self, bucket: int, sampled: bool, rows: int | None) -> tuple[float, float] | None:
        """(plain seconds, what speculating adds) for a window of `rows` live rows at this bucket. What it adds
        is its drafted queries times a query's cost: measured as a speculative window's time over a plain one's
        of as many live rows, per drafted query; estimated as the prefills' per-row cost."""
        queries = self._queries(bucket, rows)
        for kind in (sampled, not sampled):
            spec, plain = self.window_seconds.get((bucket, True, kind)), self.window_seconds.get((bucket, False, kind))
            if spec is not None and plain is not None:
                measured_queries, measured_rows = self._spec_shape[(bucket, kind)]
                per_query = max(spec - self._scaled(plain, bucket, measured_rows), 0.0) / measured_queries
                return self._scaled(plain, bucket, rows), queries * per_query
        line = self.row_costs()
        if line is None or not self.draft_tokens:
            return None
        plain = self.window_seconds.get((bucket, False, sampled))
        plain = self._plain_estimate(bucket, line) if plain is None else plain
        return self._scaled(plain, bucket, rows), queries * line[1]

    def _queries(self, bucket: int, rows: int | None) -> float:
        """The drafted (verify) queries a speculative window runs beyond a plain one: its live rows' expected
        drafts on an eager CPU, its bucket's every draft position in a graph."""
        per_row = max(self.draft_tokens, 1)
        if not self.live_queries:
            return float(self.steps_per_window * bucket * per_row)
        if self.drafts_per_verify is not None:
            per_row = self.drafts_per_verify
        return self.steps_per_window * (bucket if rows is None else rows) * per_row

    def _scaled(self, plain: float, bucket: int, rows: float | None) -> float:
        """A bucket's plain window time brought to `rows` live rows where a window runs its live rows alone (an
        eager CPU's: m + R b a step, from the row costs); a graph's costs its bucket's shape."""
        if not self.live_queries or rows is None or rows >= bucket:
            return plain
        line = self.row_costs()
        if line is None or line[0] + bucket * line[1] <= 0:
            return plain
        return plain * (line[0] + rows * line[1]) / (line[0] + bucket * line[1])

    def _plain_estimate(self, bucket: int, line: tuple[float, float]) -> float:
        return self.steps_per_window * (line[0] + bucket * line[1])

    def row_costs(self) -> tuple[float, float] | None:
        """(m, b): seconds a target forward costs per step and per row, from the prefills' average
        (t = m + P b) and the smallest measured plain bucket's window (k (m + B b)); None before both."""
        plain = [(bucket, sampled) for bucket, speculative, sampled in self.window_seconds if not speculative]
        if self._prefill is None or not plain:
            return None
        tokens, seconds = self._prefill
        smallest, sampled = min(plain)  # the smallest bucket's plain windows (greedy ones where both ran)
        step = self.window_seconds[(smallest, False, sampled)] / self.steps_per_window
        if tokens <= smallest:
            return None  # the prefills ran no more rows than the window: no slope
        per_row = max((seconds - step) / (tokens - smallest), 0.0)
        return max(step - smallest * per_row, 0.0), per_row

    def observe_queue(self, waiting: int) -> None:
        """Requests waiting for a row as the next window is chosen (expected_acceptance weighs rows by it)."""
        self.waiting = waiting

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A step's prefill: its tokens and time (the target's rate over many rows)."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._prefill is None:
            self._prefill = (float(tokens), seconds)
        else:
            self._prefill = (self._average(self._prefill[0], tokens), self._average(self._prefill[1], seconds))

    def expected_acceptance(self, rows: Iterable[Sequence] = ()) -> float | None:
        """Accepted drafts per verify a window of these rows should count on: each row's own average (the
        engine-wide one, the prior, for rows without a report and for a window of no rows). With requests
        waiting for a row, a row that finishes early makes room for one, so the window's tokens are what
        count: the mean. With none waiting, the batch lasts as long as its longest row: the acceptance at
        which plain windows would finish the batch as soon as speculative ones, its rows' remaining tokens
        n at 1 + a a round (max n / max(n / (1 + a)) - 1; with equal n the least accepting row's a). There
        the f rows without a report count on the least of f draws, not on the mean: the 1 / (f + 1)
        quantile of the rows' recent per-window acceptance (the prior while there are few)."""
        prior = self.accepted_per_verify
        if prior is None:
            return None
        rows = list(rows)
        if not rows:
            return prior
        if self.waiting:
            return sum(prior if seq.spec_acceptance is None else seq.spec_acceptance for seq in rows) / len(rows)
        fresh = sum(seq.spec_acceptance is None for seq in rows)
        unknown = prior
        if fresh and len(self._row_samples) >= self.min_samples:
            ranked = sorted(self._row_samples)
            unknown = ranked[len(ranked) // (fresh + 1)]
        left = [max(seq.max_len - seq.num_tokens, 1) for seq in rows]
        return max(left) / max(n / (1.0 + (unknown if seq.spec_acceptance is None else seq.spec_acceptance))
                               for n, seq in zip(left, rows)) - 1.0

    def pays(self, bucket: int, accepted: float | None, sampled: bool = False, rows: int | None = None) -> bool:
        if accepted is None:
            return False
        ratio = self.cost_ratio(bucket, sampled, rows)
        need = self.min_accepted if ratio is None else max(self.min_accepted, ratio * (1.0 + self.headroom) - 1.0)
        return accepted >= need

    def probe_loss(self, bucket: int, accepted: float | None, sampled: bool = False,
                   rows: int | None = None) -> float | None:
        """Seconds a probe at this bucket (of `rows` live rows) is expected to lose against a plain window
        (None: not measured)."""
        cost = self._cost(bucket, sampled, rows)
        if cost is None or accepted is None:
            return None
        return max(cost[1] - accepted * cost[0], 0.0)

    def probe_due(self, bucket: int, accepted: float | None, sampled: bool = False, rows: int | None = None) -> bool:
        """Where the probe's loss is measured or estimated, once the budget covers it, however long that
        takes (a forced probe at a bucket whose verify costs several plain windows would lose them in
        one go); else after `interval` plain windows (at most max_probe_every)."""
        loss = self.probe_loss(bucket, accepted, sampled, rows)
        if loss is None:
            return self._plain_since >= self.interval
        return self._plain_seconds.get(bucket, 0.0) * self.probe_budget >= loss

    def speculate(self, bucket: int, rows: Iterable[Sequence] = ()) -> bool:
        """Whether the next decode window, at this bucket and over these running sequences, speculates (at
        the cost ratio of sampled windows where some row samples)."""
        if not self.enabled:
            return False
        rows = list(rows)
        sampled, live = any_sampled(rows), len(rows) or None
        accepted = self.expected_acceptance(rows)
        if self.pays(bucket, accepted, sampled, live):
            return True
        if self._probing:
            return False
        if accepted is not None:
            self._plain_since += 1
            if not self.probe_due(bucket, accepted, sampled, live):
                return False
        self._plain_since = 0
        self._plain_seconds[bucket] = 0.0
        self._probing = True
        return True

    def observe(self, verifies: int, accepted: int, rows: Iterable[tuple[Sequence, int, int]] = (),
                drafted: int | None = None) -> None:
        """A speculative window's report: row-rounds verified and drafts accepted (and drafted), in all and per
        sequence (rows: each sequence with its own verifies and accepted drafts)."""
        probe, self._probing = self._probing, False
        if drafted is not None and verifies > 0:
            self.drafts_per_verify = self._average(self.drafts_per_verify, drafted / verifies)
        for seq, row_verifies, row_accepted in rows:
            if row_verifies > 0:
                seq.spec_acceptance = self._average(seq.spec_acceptance, row_accepted / row_verifies)
                self._row_samples.append(row_accepted / row_verifies)
        if verifies <= 0:
            return
        self.accepted_per_verify = self._average(self.accepted_per_verify, accepted / verifies)
        if self.accepted_per_verify >= self.min_accepted:
            self.interval = self.probe_every
        elif probe:  # while the cost is not measured, each probe that did not pay doubles the wait
            self.interval = min(2 * self.interval, self.max_probe_every)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * old + (1 - self.smoothing) * new

    def withdraw(self) -> None:
        """The window chosen to speculate ran plain (a row needed penalties): no report will come."""
        self._probing = False

    def observe_window(self, bucket: int, speculative: bool, seconds: float, sampled: bool = False,
                       full: bool = True, drafted: int | None = None, row_steps: int | None = None,
                       live_steps: int | None = None) -> None:
        """A decode window's measured time (the first of each kind and bucket may be skipped: it may compile);
        `sampled`: some of its rows at temperature > 0; `full`: it held more rows than half its bucket. A tail's
        window (a batch's last rows in a bucket their slots keep) counts toward the probe budget's plain time but
        not toward the bucket's average: a CPU window leaves inert rows out, so a bucket-4 window with one row left
        costs about a one-row window, and one such speculative window against plain windows of four rows would
        measure a ratio below 1. A speculative window's `drafted` queries and live `row_steps` (its report) give
        its shape where the cost follows the live queries (`live_queries`); one that drafted nothing measures no
        query's cost. `live_steps`: the steps (rounds) its longest-lived row ran; a window whose rows all ended
        before its k-th (a request's last, where a row's last steps are skipped: a d = 2 window with 6 of 8 rounds
        measured 134 ms against 161-183) is no measure of a whole window either, and counts only toward the
        probe budget: one plain window of 4 ms, nothing live in it, halved the bucket's plain average and put the
        cost ratio at 2.8 (the next speculative window then needed 2.1 accepted drafts)."""
        reported = speculative and self.live_queries and drafted is not None and row_steps is not None
        if reported and drafted <= 0:
            return
        if live_steps is not None and live_steps < self.steps_per_window:
            full = False
        key = (bucket, speculative, sampled)
        if self.first_window_untimed and key not in self._seen:
            self._seen.add(key)
            return
        if not speculative:
            self._plain_seconds[bucket] = self._plain_seconds.get(bucket, 0.0) + seconds
        if full:
            self.window_seconds[key] = self._average(self.window_seconds.get(key), seconds)
            if speculative:
                shape = (float(drafted), row_steps / self.steps_per_window) if reported else \
                    (float(self._queries(bucket, None)), float(bucket))
                old = self._spec_shape.get((bucket, sampled))
                self._spec_shape[(bucket, sampled)] = shape if old is None else (
                    self._average(old[0], shape[0]), self._average(old[1], shape[1]))
