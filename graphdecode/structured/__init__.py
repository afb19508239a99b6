"""Structured outputs: constraints (JSON schema, regex, choice, JSON object) compiled to
token-level automata the decode window can mask and advance with on the device.

params.py validates a request's StructuredOutputsParams; compiler.py turns one into a
regex and then, with outlines-core, into a TokenAutomaton (automaton.py: packed allowed
masks per state, a default next state and sorted exceptions); cache.py caches automata
in memory and on disk. `compile_constraint` is the entry point.
"""

from .automaton import TokenAutomaton
from .cache import AutomatonCache, CompileStats, compile_constraint, compile_stats, default_cache
from .params import StructuredOutputsParams

__all__ = [
    "AutomatonCache",
    "CompileStats",
    "StructuredOutputsParams",
    "TokenAutomaton",
    "compile_constraint",
    "compile_stats",
    "default_cache",
]
