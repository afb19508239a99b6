"""A tokenizer's tokens as the bytes they stand for: what the constraint compiler walks.

The compiler matches byte strings, so each token id needs the exact bytes it adds to
the output. How a token string encodes its bytes depends on the tokenizer family,
which we read from the backend tokenizer's decoder (and pre-tokenizer):

* byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen): every byte is spelled as one
  printable unicode character (the GPT-2 `bytes_to_unicode` table); we invert it;
* sentencepiece style (Llama-2, Mistral, Gemma): '▁' is a space, and `<0xNN>` tokens
  (byte fallback) are that single byte; other characters are their UTF-8;
* anything else: the token string's UTF-8.

Added tokens that are not special are literal text (their UTF-8). Special tokens are
left out, except the EOS ids, which the compiler handles itself (they are allowed
exactly where the constraint is complete), and those a constraint names to be read as
their text (`specials`: a tool-call format's markers; a vocabulary of its own). Tokens with no bytes are left out (they
would loop without advancing). Ids at or beyond the model's vocab size are dropped.

`tokenizer_vocab` caches the result per tokenizer object (weakly where possible), so
a compile-cache hit does not re-read a 150k-token vocabulary.
"""

from __future__ import annotations

import hashlib
import re
import threading
import weakref
from dataclasses import dataclass

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_unicode_table() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table (character -> byte)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_UNICODE_TO_BYTE = _byte_unicode_table()


@dataclass(frozen=True, eq=False)
class TokenizerVocab:
    """token_bytes[i] is the bytes of token_ids[i]; eos_token_ids are excluded from them."""

    token_ids: tuple[int, ...]
    token_bytes: tuple[bytes, ...]
    eos_token_ids: tuple[int, ...]
    vocab_size: int  # the model's V (tables are this wide)
    tokenizer_size: int  # ids the tokenizer knows (with added tokens)
    kind: str  # "byte_level" | "sentencepiece" | "plain"
    fingerprint: str  # sha256 over (id, bytes) pairs, the EOS ids and V


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "get_added_tokens_decoder"):
        return tokenizer  # a `tokenizers.Tokenizer` itself
    raise TypeError(
        "structured outputs need a fast (Rust `tokenizers`) tokenizer; got " + type(tokenizer).__name__
    )


def _component_state(component) -> str:
    if component is None:
        return ""
    try:
        state = component.__getstate__()
    except Exception:  # noqa: BLE001 - fall back to the repr
        return repr(component)
    return state.decode("utf-8", "replace") if isinstance(state, bytes) else str(state)


def detect_kind(backend) -> str:
    decoder = _component_state(backend.decoder)
    pre = _component_state(backend.pre_tokenizer)
    if '"ByteLevel"' in decoder or '"ByteLevel"' in pre:
        return "byte_level"
    if "▁" in decoder or '"Metaspace"' in decoder or '"Metaspace"' in pre or '"ByteFallback"' in decoder:
        return "sentencepiece"
    return "plain"


def token_to_bytes(token: str, kind: str) -> bytes | None:
    """The bytes a (non-added) token stands for; None when it cannot be mapped."""
    if kind == "byte_level":
        try:
            return bytes(_UNICODE_TO_BYTE[ch] for ch in token)
        except KeyError:
            return None  # not spelled in the byte alphabet: never produced by the model's BPE
    if kind == "sentencepiece":
        m = _BYTE_TOKEN.fullmatch(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")
    return token.encode("utf-8")


def build_tokenizer_vocab(tokenizer, vocab_size: int, eos_token_ids, specials: tuple[str, ...] = ()) -> TokenizerVocab:
    """The vocabulary's byte strings; `specials`: special tokens (by their text) kept as that text."""
    backend = _backend(tokenizer)
    specials = frozenset(specials)
    eos = tuple(sorted({int(e) for e in eos_token_ids}))
    if not eos:
        raise ValueError("structured outputs need at least one EOS token id")
    for e in eos:
        if not 0 <= e < vocab_size:
            raise ValueError(f"EOS token id {e} is outside the vocabulary [0, {vocab_size})")
    kind = detect_kind(backend)
    added = backend.get_added_tokens_decoder()  # {id: AddedToken}
    vocab = backend.get_vocab(with_added_tokens=True)  # {token string: id}
    eos_set = set(eos)
    pairs: list[tuple[int, bytes]] = []
    for token, tid in vocab.items():
        if tid >= vocab_size or tid in eos_set:
            continue
        at = added.get(tid)
        if at is not None:
            if at.special and at.content not in specials:
                continue
            data = at.content.encode("utf-8")
        else:
            data = token_to_bytes(token, kind)
        if data:
            pairs.append((tid, data))
    pairs.sort()
    h = hashlib.sha256()
    h.update(f"{kind}|V={vocab_size}|eos={','.join(map(str, eos))}|".encode())
    h.update(repr(sorted(specials)).encode() if specials else b"")
    for tid, data in pairs:
        h.update(tid.to_bytes(4, "little"))
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return TokenizerVocab(
        token_ids=tuple(t for t, _ in pairs),
        token_bytes=tuple(d for _, d in pairs),
        eos_token_ids=eos,
        vocab_size=int(vocab_size),
        tokenizer_size=int(backend.get_vocab_size(with_added_tokens=True)),
        kind=kind,
        fingerprint=h.hexdigest(),
    )


class _Entry:
    __slots__ = ("ref", "size", "vocabs")

    def __init__(self, ref, size):
        self.ref = ref
        self.size = size
        self.vocabs: dict = {}


_LOCK = threading.Lock()
_BY_TOKENIZER: dict[int, _Entry] = {}
_STRONG_LIMIT = 8  # tokenizers that cannot be weakly referenced: keep at most this many alive


def tokenizer_vocab(tokenizer, vocab_size: int, eos_token_ids, specials: tuple[str, ...] = ()) -> TokenizerVocab:
    """build_tokenizer_vocab, cached per tokenizer object (invalidated if its size changes)."""
    backend = _backend(tokenizer)
    size = backend.get_vocab_size(with_added_tokens=True)
    eos = tuple(sorted({int(e) for e in eos_token_ids}))
    specials = tuple(sorted(set(specials)))
    sub = (int(vocab_size), eos, specials)
    key = id(tokenizer)
    with _LOCK:
        entry = _BY_TOKENIZER.get(key)
        if entry is not None and entry.ref() is tokenizer and entry.size == size:
            hit = entry.vocabs.get(sub)
            if hit is not None:
                return hit
        else:
            entry = None
    built = build_tokenizer_vocab(tokenizer, vocab_size, eos, specials)
    with _LOCK:
        entry = _BY_TOKENIZER.get(key)
        if entry is None or entry.ref() is not tokenizer or entry.size != size:
            try:
                ref = weakref.ref(tokenizer, lambda _r, k=key: _BY_TOKENIZER.pop(k, None))
            except TypeError:
                strong = [k for k, e in _BY_TOKENIZER.items() if not isinstance(e.ref, weakref.ref)]
                for k in strong[: max(0, len(strong) - _STRONG_LIMIT + 1)]:
                    _BY_TOKENIZER.pop(k, None)
                ref = (lambda t=tokenizer: t)
            entry = _Entry(ref, size)
            _BY_TOKENIZER[key] = entry
        entry.vocabs[sub] = built
    return built


END_BYTE = b"\x00"  # the end marker compiler.py puts after every constraint's regex


def end_token(vocab: TokenizerVocab) -> int:
    """The id of the end marker's own token in outlines-core's Vocabulary: just past the real ids."""
    return vocab.vocab_size


def outlines_vocabulary(vocab: TokenizerVocab):
    """outlines-core's Vocabulary of these tokens (bytes -> ids) and of the end marker's token (compiler.py);
    EOS is the first EOS id."""
    from outlines_core import Vocabulary

    mapping: dict[bytes, list[int]] = {}
    for tid, data in zip(vocab.token_ids, vocab.token_bytes):
        mapping.setdefault(data, []).append(tid)
    mapping.setdefault(END_BYTE, []).append(end_token(vocab))
    return Vocabulary(vocab.eos_token_ids[0], mapping)


