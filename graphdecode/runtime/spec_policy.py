"""When a window speculates: the host's choice, per window, from the rows' recent acceptance.

A speculative window costs a verify forward of d + 1 tokens per row and round; it pays
when drafts are accepted. The policy keeps an exponential average of accepted drafts
per verify (reported by the speculative windows themselves, one window late), starts
optimistic, and runs plain windows while the average is below `min_accepted`, trying a
speculative window every `probe_every` plain ones to notice when copying starts to pay
again (a prompt with nothing to copy then costs one speculative window in 16).
"""

from __future__ import annotations


class SpecPolicy:
    def __init__(self, enabled: bool, min_accepted: float = 0.5, probe_every: int = 16, smoothing: float = 0.5):
        self.enabled = enabled
        self.min_accepted = min_accepted
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.accepted_per_verify = float("inf")  # optimistic until a speculative window reports
        self._plain_since = 0

    def speculate(self) -> bool:
        if not self.enabled:
            return False
        if self.accepted_per_verify >= self.min_accepted:
            return True
        self._plain_since += 1
        if self._plain_since >= self.probe_every:
            self._plain_since = 0
            return True
        return False

    def observe(self, verifies: int, accepted: int) -> None:
        if verifies <= 0:
            return
        rate = accepted / verifies
        if self.accepted_per_verify == float("inf"):
            self.accepted_per_verify = rate
        else:
            self.accepted_per_verify = self.smoothing * self.accepted_per_verify + (1 - self.smoothing) * rate
