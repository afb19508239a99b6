"""Budgets for compiling a constraint: what one request may make the host spend.

A constraint's automaton grows with its counted repetitions (`[a-z]{1,2000}` has ~2000
states; a schema's `maxLength`, `minItems` / `maxItems` and big `choice` lists are such
repetitions too), and outlines-core's index holds a transition for every (state, token)
the constraint allows: 2000 states over SmolLM2's 49k-token vocabulary are ~23 million
transitions, ~5 GB, and `{1,100000}` more than the machine had. The bounds, cheapest first:

* positions, when the params are made: `estimate_states` scans the regex (the one a schema
  or a choice list becomes too) and counts the character positions its counted
  repetitions expand to; more than MAX_ESTIMATED_STATES is refused at once.
* transitions, before the costly index: the regex's DFA over single bytes (as costly as the
  DFA itself, ~1000x cheaper than the token index) gives, per state, the bytes it allows;
  the tokens starting with them bound the (state, token) transitions from above
  (compiler.estimate_transitions, walked from the initial state and stopped once over the
  budget: within 5% on SmolLM2), and at the measured ~110 bytes
  each, a compile that would outgrow `memory_bytes` is refused in well under a second.
  A regex with long counted repetitions (a schema's `maxLength: 5000`) has a byte DFA that
  itself takes a second to build: its repetitions are capped first (`cap_repetitions`, at 64,
  then at what the transitions so far extrapolate to the budget), and the first capped
  version over the budget refuses it (compiler.check_budget_growing).
* time and memory, while compiling: the compile runs in a worker process
  (compile_worker.py) whose address space is limited to `memory_bytes` above its own
  baseline and which is killed after `seconds` (or when its request is cancelled, or the
  engine closes): a regex whose DFA blows up exponentially (`(a|b)*a(a|b){20}`) is
  stopped there. The server's own memory never holds a compile.
* states, after compiling: the automaton must fit the device's table store
  (`structured_max_states`, host/structured_store.py).
Each refusal is a ValueError naming the field, the limit and the option that sets it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_ESTIMATED_STATES = 1 << 16  # no constraint needs more; larger ones are refused when made
_CAP = 1 << 40  # estimates saturate here (a {1,1000000}{1,1000000} must not build a huge integer)
CAPPED_FROM = 1024  # positions above which the byte DFA is built for capped repetitions first
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")


@dataclass(frozen=True)
class CompileBudget:
    seconds: float  # one compile's wall time (EngineConfig.structured_compile_timeout)
    memory_bytes: int  # one compile's memory (EngineConfig.structured_compile_memory_bytes)


def _class_end(regex: str, i: int) -> int:
    """The index after the character class opening at regex[i] == '[' (len + 1: never closed)."""
    depth, i = 1, i + 1
    if i < len(regex) and regex[i] == "^":
        i += 1
    if i < len(regex) and regex[i] == "]":  # a leading ']' is literal
        i += 1
    while i < len(regex) and depth:
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            if regex.startswith("[:", i):  # [:alpha:]
                end = regex.find(":]", i + 2)
                i = end + 2 if end >= 0 else i + 1
                continue
            depth += 1
        elif ch == "]":
            depth -= 1
        i += 1
    return i if depth == 0 else len(regex) + 1  # past the end: unclosed


def _escape_end(regex: str, i: int) -> int:
    """The index after the escape starting at regex[i] == '\\'."""
    if i + 1 >= len(regex):
        return i + 1
    ch = regex[i + 1]
    if ch in "xupP" and i + 2 < len(regex) and regex[i + 2] == "{":
        end = regex.find("}", i + 3)
        return end + 1 if end >= 0 else len(regex)
    if ch == "x":
        return i + 4
    if ch == "u":
        return i + 6
    if ch in "pP":
        return i + 3
    return i + 2


class RegexSyntaxError(ValueError):
    """What the scan can tell without compiling: unbalanced, or a construct outlines-core lacks."""

    def __init__(self, message: str, unsupported: bool = False):
        super().__init__(message)
        self.unsupported = unsupported


def estimate_states(regex: str) -> int:
    """The number of character positions `regex` (Rust regex syntax) has once its counted
    repetitions are expanded: x{n,m} counts x max(m, 1) times, x{n,} n + 1 times, x*, x+ and
    x? once; alternatives add up; anchors and empty groups count 0. Linear in the regex's
    length, no recursion (nesting depth costs nothing). Raises RegexSyntaxError for an
    unclosed class or group, an unmatched ')', lookaround or a backreference."""
    frames = [[0, 0, 0]]  # per open group: [finished alternatives, current concatenation, last item]
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        frame = frames[-1]
        size, end = None, i + 1
        if ch == "\\":
            size, end = 1, _escape_end(regex, i)
            follower = regex[i + 1 : i + 2]
            if follower in ("b", "B", "A", "z"):
                size = 0  # assertions
            elif follower.isdigit() and follower != "0" or follower == "k":
                raise RegexSyntaxError("backreferences are not supported", unsupported=True)
        elif ch == "[":
            size, end = 1, _class_end(regex, i)
            if end > n:
                raise RegexSyntaxError(f"unclosed character class at position {i}")
        elif ch == "(":
            end = i + 1
            if regex.startswith(("?=", "?!", "?<=", "?<!"), end):
                raise RegexSyntaxError("lookaround is not supported", unsupported=True)
            if regex.startswith("?", end):  # (?:, (?P<name>, (?<name>, (?flags:, (?flags)
                close = regex.find(")", end)
                colon = regex.find(":", end)
                named = regex.startswith(("?P<", "?<"), end)
                if named:
                    end = regex.find(">", end) + 1
                elif colon >= 0 and (close < 0 or colon < close):
                    end = colon + 1
                elif close >= 0:  # flags only: no group
                    i = close + 1
                    continue
            frames.append([0, 0, 0])
            i = end
            continue
        elif ch == ")":
            if len(frames) > 1:
                inner = frames.pop()
                size = min(_CAP, inner[0] + inner[1])
                frame = frames[-1]
            else:
                raise RegexSyntaxError(f"unmatched ')' at position {i}")
        elif ch == "|":
            frame[0] = min(_CAP, frame[0] + frame[1])
            frame[1] = frame[2] = 0
            i += 1
            continue
        elif ch in "*+?":
            i += 1
            if i < n and regex[i] == "?":
                i += 1
            continue
        elif ch == "{":
            match = _QUANTIFIER.match(regex, i)
            if match is not None:
                low = int(match.group(1))
                high = match.group(3)
                count = low + 1 if match.group(2) and not high else int(high) if high else low
                last = frame[2]
                frame[1] = min(_CAP, frame[1] - last + last * max(count, 1))
                frame[2] = min(_CAP, last * max(count, 1))
                i = match.end()
                if i < n and regex[i] == "?":
                    i += 1
                continue
            size = 1
        elif ch in "^$":
            size = 0
        else:
            size = 1
        frame[1] = min(_CAP, frame[1] + size)
        frame[2] = size
        i = end
    if len(frames) > 1:
        raise RegexSyntaxError(f"{len(frames) - 1} unclosed group(s): missing ')'")
    return min(_CAP, frames[0][0] + frames[0][1])


def check_states(regex: str, field: str, limit: int, option: str, estimate: int | None = None) -> int:
    """estimate_states(regex) (or the estimate given), or a ValueError naming the field when it is
    over `limit`."""
    if estimate is None:
        estimate = estimate_states(regex)
    if estimate > limit:
        raise ValueError(
            f"structured_outputs.{field}: the constraint needs about {estimate} automaton states, more than "
            f"the limit of {limit} ({option}); lower its repetition counts (maxLength, maxItems, {{m,n}}) "
            "or its number of choices")
    return estimate


def cap_repetitions(regex: str, cap: int) -> str:
    """`regex` with each counted repetition x{n,m} / x{n} / x{n,} counting at most `cap` (escapes
    and character classes untouched): its automaton is the full one's with each long chain of
    repeats cut short, so its (state, token) transitions are fewer than the full one's."""
    out, i, n, copied = [], 0, len(regex), 0
    while i < n:
        ch = regex[i]
        if ch == "\\":
            i = _escape_end(regex, i)
        elif ch == "[":
            i = _class_end(regex, i)
        elif ch == "{" and (match := _QUANTIFIER.match(regex, i)) is not None:
            low, high = min(int(match.group(1)), cap), match.group(3)
            if match.group(2) and not high:
                counted = f"{{{low},}}"
            else:
                counted = f"{{{low},{min(int(high), cap)}}}" if high else f"{{{low}}}"
            out += [regex[copied:i], counted]
            i = copied = match.end()
        else:
            i += 1
    return "".join(out) + regex[copied:]
