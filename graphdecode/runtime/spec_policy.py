"""When a window speculates: the host's choice, per window, from the rows' recent acceptance.

A speculative window costs a verify forward of d + 1 tokens per row and round (on a
CPU, SmolLM2 at batch 1: 1.23x a plain window); it pays when drafts are accepted.
The policy keeps an exponential average of accepted drafts per verify, reported by
the speculative windows themselves one window late. With no report yet, it launches
one speculative window and then plain ones until that report arrives; afterwards it
speculates while the average is at least `min_accepted`, and otherwise runs plain
windows, probing with one speculative window every `probe_every` plain ones (again
waiting for its report) to notice when copying starts to pay. A prompt with nothing
to copy therefore pays for one speculative window in `probe_every` + 1.
"""

from __future__ import annotations


class SpecPolicy:
    def __init__(self, enabled: bool, min_accepted: float = 0.5, probe_every: int = 16, smoothing: float = 0.5):
        self.enabled = enabled
        self.min_accepted = min_accepted
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.accepted_per_verify: float | None = None  # unknown until a speculative window reports
        self._probing = False  # a probe window is in flight: wait for its report
        self._plain_since = 0

    def speculate(self) -> bool:
        if not self.enabled:
            return False
        if self.accepted_per_verify is not None and self.accepted_per_verify >= self.min_accepted:
            return True
        if self._probing:
            return False
        if self.accepted_per_verify is not None:
            self._plain_since += 1
            if self._plain_since < self.probe_every:
                return False
        self._plain_since = 0
        self._probing = True
        return True

    def observe(self, verifies: int, accepted: int) -> None:
        self._probing = False
        if verifies <= 0:
            return
        rate = accepted / verifies
        if self.accepted_per_verify is None:
            self.accepted_per_verify = rate
        else:
            self.accepted_per_verify = self.smoothing * self.accepted_per_verify + (1 - self.smoothing) * rate
