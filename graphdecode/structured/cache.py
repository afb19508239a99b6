"""Compiled automata, cached in memory (a bounded LRU) and on disk (.npz files).

The cache identity of an automaton is (compiler version and its fixed choices, the
constraint's key, the tokenizer's fingerprint: a hash of every token id's bytes and the
EOS ids, and the model's vocab size V). The disk copy lives under
`cache_root()/structured/` (`$GRAPHDECODE_CACHE`, else ~/.cache/graphdecode), one
uncompressed .npz per automaton (the allowed masks stored once per distinct row),
written to a temporary file and renamed into place;
a file whose stored identity differs (a hash collision, an old version) or that cannot
be read is a miss and is rewritten. Cached arrays are read-only: one automaton object is
shared by every request with the same constraint.

`compile_constraint(params, tokenizer, vocab_size, eos_token_ids)` is the entry point;
`AutomatonCache.stats()` (compile_stats() for the shared cache) counts what happened.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

from ..cache import cache_root
from . import compiler
from .automaton import TokenAutomaton
from .params import StructuredOutputsParams
from .vocabulary import tokenizer_vocab

_ARRAYS = ("allowed", "default_next", "exc_offsets", "exc_tokens", "exc_next", "accepting")


@dataclass
class CompileStats:
    compiled: int = 0  # automata compiled (cache misses)
    memory_hits: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0  # total time spent compiling

    def as_dict(self) -> dict:
        return asdict(self)


def identity(params: StructuredOutputsParams, fingerprint: str, vocab_size: int) -> str:
    return (f"v{compiler.COMPILER_VERSION}|ws={compiler.WHITESPACE}|depth={compiler.JSON_OBJECT_DEPTH}"
            f"|tok={fingerprint}|V={vocab_size}|{params.key()}")


def save_npz(path: str, automaton: TokenAutomaton, ident: str) -> None:
    meta = json.dumps({"identity": ident, "vocab_size": automaton.vocab_size,
                       "initial_state": automaton.initial_state, "eos_token_ids": list(automaton.eos_token_ids),
                       "compile_seconds": automaton.compile_seconds, "key": automaton.key}, ensure_ascii=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".writing-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            rows, index = np.unique(automaton.allowed, axis=0, return_inverse=True)  # masks repeat across states
            arrays = {name: getattr(automaton, name) for name in _ARRAYS if name != "allowed"}
            np.savez(f, meta=np.array(meta), allowed_rows=rows, allowed_index=index.reshape(-1).astype(np.int32),
                     **arrays)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_npz(path: str, ident: str | None = None) -> TokenAutomaton | None:
    """The automaton stored at `path`, or None if missing, unreadable or not `ident`."""
    try:
        with np.load(path, allow_pickle=False) as f:
            meta = json.loads(str(f["meta"]))
            if ident is not None and meta.get("identity") != ident:
                return None
            arrays = {name: f[name] for name in _ARRAYS if name != "allowed"}
            arrays["allowed"] = f["allowed_rows"][f["allowed_index"]]
    except Exception:  # noqa: BLE001 - missing, truncated, corrupt or foreign: a miss
        return None
    for a in arrays.values():
        a.flags.writeable = False
    return TokenAutomaton(vocab_size=int(meta["vocab_size"]), initial_state=int(meta["initial_state"]),
                          eos_token_ids=tuple(int(e) for e in meta["eos_token_ids"]),
                          compile_seconds=float(meta["compile_seconds"]), key=meta["key"], **arrays)


class AutomatonCache:
    """An LRU of compiled automata (at most `max_entries` and `max_bytes`) over a disk cache.

    directory: where the .npz files go (default cache_root()/structured, read when used);
    disk=False keeps it in memory only. The directory is trimmed to `max_disk_bytes`
    (least recently used files first) whenever a file is written. Thread-safe; concurrent
    requests for one constraint compile it once.
    """

    def __init__(self, directory: str | None = None, *, disk: bool = True, max_entries: int = 64,
                 max_bytes: int = 1 << 30, max_disk_bytes: int = 2 << 30, workers=None):
        self.workers = workers  # CompileWorkers (compile_worker.py): compiles under a budget; None: in-process
        self._directory = directory
        self.disk = disk
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_disk_bytes = max_disk_bytes
        self._lru: OrderedDict[str, TokenAutomaton] = OrderedDict()
        self._building: dict[str, threading.Lock] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = CompileStats()
        self._warned = False

    @property
    def directory(self) -> str:
        return self._directory or os.path.join(cache_root(), "structured")

    def path_for(self, ident: str) -> str:
        return os.path.join(self.directory, hashlib.sha256(ident.encode()).hexdigest()[:40] + ".npz")

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(**asdict(self._stats))

    def clear_memory(self) -> None:
        with self._lock:
            self._lru.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _remember(self, ident: str, automaton: TokenAutomaton) -> None:
        if ident in self._lru:
            return
        self._lru[ident] = automaton
        self._bytes += automaton.nbytes
        while len(self._lru) > 1 and (len(self._lru) > self.max_entries or self._bytes > self.max_bytes):
            _, old = self._lru.popitem(last=False)
            self._bytes -= old.nbytes

    def _memory_hit(self, ident: str) -> TokenAutomaton | None:
        with self._lock:
            hit = self._lru.get(ident)
            if hit is not None:
                self._lru.move_to_end(ident)
                self._stats.memory_hits += 1
            return hit

    def close(self) -> None:
        """Stop the compile workers (an in-flight compile ends with an error)."""
        if self.workers is not None:
            self.workers.close()

    def get(self, params: StructuredOutputsParams, tokenizer, vocab_size: int, eos_token_ids,
            cancelled: threading.Event | None = None) -> TokenAutomaton:
        """The automaton, from memory, disk or a compile. cancelled: set when the request that
        asks for it goes away (a worker's compile then stops: compile_worker.CompileCancelled)."""
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(f"structured_outputs: expected StructuredOutputsParams, got {type(params).__name__}")
        vocab = tokenizer_vocab(tokenizer, vocab_size, eos_token_ids, params.special_tokens)
        ident = identity(params, vocab.fingerprint, vocab.vocab_size)
        hit = self._memory_hit(ident)
        if hit is not None:
            return hit
        with self._lock:
            building = self._building.setdefault(ident, threading.Lock())
        try:
            with building:  # one compile per identity; the others wait for it and hit memory
                hit = self._memory_hit(ident)
                return hit if hit is not None else self._load_or_compile(ident, params, vocab, cancelled)
        finally:
            with self._lock:
                self._building.pop(ident, None)

    def _load_or_compile(self, ident: str, params: StructuredOutputsParams, vocab, cancelled) -> TokenAutomaton:
        path = self.path_for(ident) if self.disk else None
        automaton = load_npz(path, ident) if path is not None and os.path.isfile(path) else None
        if automaton is not None:
            try:
                os.utime(path)  # recently used: trimmed last
            except OSError:
                pass
            with self._lock:
                self._stats.disk_hits += 1
                self._remember(ident, automaton)
            return automaton
        t0 = time.perf_counter()
        if self.workers is not None:
            automaton = self.workers.compile(params, vocab, params.kind, cancelled)
        else:
            automaton = compiler.compile_automaton(params, vocab)
        seconds = time.perf_counter() - t0
        for name in _ARRAYS:
            getattr(automaton, name).flags.writeable = False
        if path is not None:
            try:
                save_npz(path, automaton, ident)
                self._trim_disk()
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"graphdecode: cannot write the structured-outputs cache {path}: {e}",
                                  stacklevel=3)
        with self._lock:
            self._stats.compiled += 1
            self._stats.compile_seconds += seconds
            self._remember(ident, automaton)
        return automaton

    def _trim_disk(self) -> None:
        files = []
        with os.scandir(self.directory) as it:
            for entry in it:
                if entry.name.endswith(".npz") and not entry.name.startswith("."):
                    st = entry.stat()
                    files.append((st.st_mtime, st.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files)[:-1]:  # oldest first; never the file just written
            if total <= self.max_disk_bytes:
                break
            try:
                os.unlink(path)
            except OSError:
                pass
            total -= size


_DEFAULT = AutomatonCache()


def default_cache() -> AutomatonCache:
    return _DEFAULT


def compile_constraint(params: StructuredOutputsParams, tokenizer, vocab_size: int, eos_token_ids,
                       *, cache: AutomatonCache | None = None) -> TokenAutomaton:
    """The TokenAutomaton of `params` for this tokenizer and vocab size, from the cache when it can.

    tokenizer: a transformers fast tokenizer (or a `tokenizers.Tokenizer`); vocab_size: the
    model's V (table width; ids the tokenizer does not have are never allowed);
    eos_token_ids: the ids that end a sequence (allowed exactly where the constraint is complete).
    Raises ValueError (naming structured_outputs.<field>) if the constraint cannot be compiled.
    """
    if cache is None:  # not `cache or ...`: an empty cache is falsy (it has a length)
        cache = _DEFAULT
    return cache.get(params, tokenizer, vocab_size, eos_token_ids)


def compile_stats() -> CompileStats:
    """The shared cache's counters (what compile_constraint without `cache=` did)."""
    return _DEFAULT.stats()
