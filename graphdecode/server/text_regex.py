"""Regular expressions (Rust syntax, as outlines-core compiles them) over a reply's text: text that never
contains a marker, text that does not start with one, and items listed in order with the optional ones left
out. The tool-call formats (call_formats.py) and the reply's constraint (reply_constraint.py) are built of them.

outlines-core builds its DFA with leftmost-first priorities, where a branch that completes the match drops the
lower-priority branches still running: every alternative here that may end the string comes after the ones
that continue it."""

from __future__ import annotations

from ..structured.compiler import escape_literal

ANY = r"[\s\S]"  # any character, newlines included


def avoiding(marker: str, then: str | None = None) -> str:
    """A regex (Rust syntax) of every string that does not contain `marker`, whose first character must not
    occur again in it (true of `<tool_call>`, `</think>`, `[TOOL_CALLS]`); with `then`, also of such a string
    followed by the marker and then `then`. From the marker's matching automaton: outside it any character
    but the first; after the first, any run of repeated first characters and partial prefixes, left by a
    character that is neither the next one nor the first; the string may end inside a partial marker.

    outlines-core builds its DFA with leftmost-first priorities, where a branch that completes the match
    drops the lower-priority branches still running: so every alternative that may end the string comes
    after the ones that continue it (the longer partial prefixes first, the marker's completion before
    them), and nothing else is ambiguous."""
    if not marker or marker[0] in marker[1:]:
        raise ValueError(f"avoiding: the marker's first character must not recur in it, got {marker!r}")
    first = escape_literal(marker[0])

    def other(*chars: str) -> str:
        return "[^" + "".join(escape_literal(c) for c in chars) + "]"

    # from state k (k characters matched), back to the start by a character that is neither marker[k] nor the first
    back = other(marker[0], marker[-1])
    for k in range(len(marker) - 2, 0, -1):
        back = f"(?:{other(marker[0], marker[k])}|{escape_literal(marker[k])}{back})"
    loops = "(?:" + "|".join(escape_literal(marker[1:j]) for j in range(1, len(marker))) + ")"
    restart = f"{first}(?:{loops}{first})*"  # the first character, and partial prefixes each ended by it
    ends = [escape_literal(marker[1:j]) for j in range(len(marker) - 1, 0, -1)]  # longest first, "" last
    if then is not None:
        ends.insert(0, escape_literal(marker[1:]) + then)
    return f"(?:{other(marker[0])}|{restart}{back})*(?:{restart}(?:{'|'.join(ends)}))?"


def avoiding_all(markers: tuple[str, ...]) -> str:
    """A regex (Rust syntax) of every string that contains none of `markers`, which all start with one character
    that occurs nowhere else in them (`</parameter>`, `<parameter=`, `</function>`): avoiding's automaton over the
    markers' trie. From the start, any character but the first; after the first, a walk down the trie that either
    leaves it by a character that continues no marker (back to the start), or meets the first character again
    (a restart); the string may end inside a partial marker. Every alternative that may end the string comes
    last (outlines-core's leftmost-first priorities, as in `avoiding`)."""
    first = markers[0][:1]
    if not first or any(not m.startswith(first) or first in m[1:] for m in markers):
        raise ValueError(f"avoiding_all: the markers must share a first character that recurs in none, got {markers!r}")
    trie: dict = {}
    for marker in markers:
        node = trie
        for char in marker[1:]:
            node = node.setdefault(char, {})
        node[None] = True  # a whole marker ends here

    def live(node: dict) -> list[tuple[str, dict]]:  # children that do not complete a marker
        return [(c, child) for c, child in node.items() if c is not None and None not in child]

    def leave(node: dict) -> str:  # a walk from `node` that leaves the trie
        exits = "[^" + escape_literal(first) + "".join(escape_literal(c) for c in node if c is not None) + "]"
        return "(?:" + "|".join([exits] + [escape_literal(c) + leave(child) for c, child in live(node)]) + ")"

    def restart(node: dict) -> str:  # a walk from `node` that meets the first character again
        walks = [escape_literal(c) + restart(child) for c, child in live(node)]
        return "(?:" + "|".join(walks + [escape_literal(first)]) + ")"

    def partial(node: dict) -> str:  # a walk from `node` that ends the string inside the trie
        return "(?:" + "|".join([escape_literal(c) + partial(child) for c, child in live(node)] + [""]) + ")"

    head = f"{escape_literal(first)}{restart(trie)}*"
    return f"(?:[^{escape_literal(first)}]|{head}{leave(trie)})*(?:{head}{partial(trie)})?"


def not_starting(marker: str, excluded: str = "") -> str:
    """A regex of every non-empty string that does not start with `marker` (of two characters or more) nor with
    a character of `excluded` (a regex character-class body): a first character that is neither of those nor
    the marker's first, or the marker's first k characters and one that is not the next one, then anything; or
    a proper prefix of the marker. One tail for all the ways out (a tail for each made outlines-core's token
    index blow up), the prefixes that end the string last."""
    diverge, partial = "", ""
    for k in range(len(marker) - 1, 0, -1):
        c = escape_literal(marker[k])
        diverge = f"[^{c}]" if not diverge else f"(?:[^{c}]|{c}{diverge})"
        if k < len(marker) - 1:
            partial = f"(?:{c}{partial})?"
    first = escape_literal(marker[0])
    return f"(?:(?:[^{excluded}{first}]|{first}{diverge}){ANY}*|{first}{partial})"


def listing(items: list[tuple[str, bool]], separator: str) -> str:
    """A regex of `items` (each a regex and whether it is required) in their order, every required one and any
    of the optional ones, `separator` between two written ones. Linear in the items after one was written
    (each optional one present or not), quadratic before the first (which of the optional ones comes first)."""
    tail = ""  # what may follow once an item was written, from the end back
    head = ""  # what may come when none was written yet
    for item, required in reversed(items):
        written = f"{item}{tail}"
        head = written if required else f"(?:{written}|{head})" if head else f"(?:{written})?"
        tail = f"{separator}{item}{tail}" if required else f"(?:{separator}{item})?{tail}"
    return head
