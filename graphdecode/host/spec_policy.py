"""When a window speculates: the host's choice, per window, from measured acceptance and cost.

A speculative window emits 1 + a tokens per row and round, where a is the mean number of
accepted drafts per verify; it costs c plain windows, where c = (speculative window
time) / (plain window time) at the same bucket. It pays when 1 + a >= c. Both are
measured, not assumed: the speculative windows report their acceptance one window late,
and every decode window reports its own time (device time from CUDA events on a GPU,
where a verify of d + 1 tokens costs about what one decode step does, so c is near 1;
wall time on a CPU, where the verify's matmuls grow with d + 1 and c is 1.1 to 5).

The policy keeps exponential averages of a and of each (bucket, kind) window time. With
no acceptance report yet it launches one speculative window (a probe) and then plain
ones until that report arrives; afterwards it speculates while
a >= max(min_accepted, c - 1) (c where both times are known for the bucket), and
otherwise runs plain windows with a probe now and then, to notice when drafting starts to
pay. A probe at a bucket whose cost ratio is measured loses (c - 1 - a) plain windows of
that bucket's time; it runs once the bucket's plain time since its last probe, times
`probe_budget` (2%), covers that loss: losing probes take about 2% of each bucket's time,
a probe that nearly paid comes back within a few windows and one that would lose a whole
window after 50. Acceptance is the requests' property, not the engine's: a stretch of text
a head cannot predict must not keep speculation off for whatever comes next. Where the
ratio is not measured yet (a bucket's first window of each kind is not timed where it may
capture a graph or compile: on a GPU, with compile=True or the CPU graph twin), the next
probe comes after `probe_every` plain windows, twice that after each probe that did not
pay (the cost unknown, up to 8% of the windows could be losing probes otherwise); after
`max_probe_every` plain windows, always.
"""

from __future__ import annotations


class SpecPolicy:
    def __init__(self, enabled: bool, min_accepted: float = 0.5, probe_every: int = 16,
                 max_probe_every: int = 256, smoothing: float = 0.5, probe_budget: float = 0.02,
                 first_window_untimed: bool = True):
        self.enabled = enabled
        # a bucket's first window of each kind may capture a graph or compile: not a measure of its cost (eager
        # CPU windows have no first-time work, and their first window is timed)
        self.first_window_untimed = first_window_untimed
        self.min_accepted = min_accepted
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.smoothing = smoothing
        self.probe_budget = probe_budget
        self.accepted_per_verify: float | None = None  # unknown until a speculative window reports
        self.window_seconds: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> average
        self._seen: set[tuple[int, bool]] = set()  # keys whose first (warm-up, maybe compiling) window passed
        self._probing = False  # a probe window is in flight: wait for its report
        self._plain_since = 0  # plain windows since the last probe
        self._plain_seconds: dict[int, float] = {}  # per bucket: the plain time since its last probe
        self.interval = probe_every  # plain windows between probes while the cost is not measured

    def cost_ratio(self, bucket: int) -> float | None:
        """A speculative window's time over a plain one's at this bucket, once both are measured."""
        spec, plain = self.window_seconds.get((bucket, True)), self.window_seconds.get((bucket, False))
        if spec is None or plain is None or plain <= 0:
            return None
        return spec / plain

    def pays(self, bucket: int) -> bool:
        if self.accepted_per_verify is None:
            return False
        ratio = self.cost_ratio(bucket)
        need = self.min_accepted if ratio is None else max(self.min_accepted, ratio - 1.0)
        return self.accepted_per_verify >= need

    def probe_loss(self, bucket: int) -> float | None:
        """Seconds a probe at this bucket is expected to lose against a plain window (None: not measured)."""
        ratio = self.cost_ratio(bucket)
        if ratio is None or self.accepted_per_verify is None:
            return None
        return max(ratio - 1.0 - self.accepted_per_verify, 0.0) * self.window_seconds[(bucket, False)]

    def probe_due(self, bucket: int) -> bool:
        if self._plain_since >= self.max_probe_every:
            return True
        loss = self.probe_loss(bucket)
        if loss is None:
            return self._plain_since >= self.interval
        return self._plain_seconds.get(bucket, 0.0) * self.probe_budget >= loss

    def speculate(self, bucket: int) -> bool:
        if not self.enabled:
            return False
        if self.pays(bucket):
            return True
        if self._probing:
            return False
        if self.accepted_per_verify is not None:
            self._plain_since += 1
            if not self.probe_due(bucket):
                return False
        self._plain_since = 0
        self._plain_seconds[bucket] = 0.0
        self._probing = True
        return True

    def observe(self, verifies: int, accepted: int) -> None:
        """A speculative window's report: row-rounds verified and drafts accepted."""
        probe, self._probing = self._probing, False
        if verifies <= 0:
            return
        rate = accepted / verifies
        if self.accepted_per_verify is None:
            self.accepted_per_verify = rate
        else:
            self.accepted_per_verify = self.smoothing * self.accepted_per_verify + (1 - self.smoothing) * rate
        if self.accepted_per_verify >= self.min_accepted:
            self.interval = self.probe_every
        elif probe:  # while the cost is not measured, each probe that did not pay doubles the wait
            self.interval = min(2 * self.interval, self.max_probe_every)

    def withdraw(self) -> None:
        """The window chosen to speculate ran plain (a row needed penalties): no report will come."""
        self._probing = False

    def observe_window(self, bucket: int, speculative: bool, seconds: float) -> None:
        """A decode window's measured time (the first of each kind and bucket may be skipped: it may compile)."""
        key = (bucket, speculative)
        if self.first_window_untimed and key not in self._seen:
            self._seen.add(key)
            return
        if not speculative:
            self._plain_seconds[bucket] = self._plain_seconds.get(bucket, 0.0) + seconds
        old = self.window_seconds.get(key)
        self.window_seconds[key] = seconds if old is None else self.smoothing * old + (1 - self.smoothing) * seconds
