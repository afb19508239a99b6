"""Multi-token stop sequences: vLLM's grouped `stop_token_ids` (`[[a, b, c], d]`).

A sequence ends when its output ends with one of the groups; the stop reason is the
group written as a string (`"[a, b, c]"`, vLLM's form). Single ids end rows on the
device; groups are matched here on the host as tokens arrive, like stop strings, and the
device's tokens past the match are discarded. Only groups whose last id is the new
token are compared, so a token costs a dict lookup unless it can complete one.
"""

from __future__ import annotations


class StopSequences:
    __slots__ = ("by_last", "longest")

    def __init__(self, groups: tuple[tuple[int, ...], ...]):
        self.by_last: dict[int, list[tuple[int, ...]]] = {}
        for group in sorted(groups, key=len, reverse=True):  # the longest match names the stop
            self.by_last.setdefault(group[-1], []).append(group)
        self.longest = max(len(g) for g in groups)

    def match(self, token_ids: list[int], num_output_tokens: int) -> tuple[int, ...] | None:
        """The group the output (the tail of token_ids, num_output_tokens long) now ends with."""
        for group in self.by_last.get(token_ids[-1], ()):
            n = len(group)
            if n <= num_output_tokens and tuple(token_ids[-n:]) == group:
                return group
        return None


def stop_reason(group: tuple[int, ...]) -> str:
    """vLLM's stop_reason for a group: its ids as a list's string."""
    return str(list(group))
