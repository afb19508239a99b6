"""Structured outputs, the compiler half: StructuredOutputsParams validation, constraint ->
TokenAutomaton tables (checked against outlines-core's own Index and by decoding random
allowed walks), and the memory / disk cache. CPU only; the tables are what the device
half uploads."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from graphdecode.structured import AutomatonCache, StructuredOutputsParams, TokenAutomaton, compiler
from graphdecode.structured.vocabulary import build_tokenizer_vocab, tokenizer_vocab

EXTRA = 40  # model vocab rows beyond the tokenizer (padding): never allowed


@pytest.fixture(scope="module")
def tok(text_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_model)


@pytest.fixture(scope="module")
def V(tok):
    return len(tok) + EXTRA


@pytest.fixture(scope="module")
def eos(tok):
    return (tok.eos_token_id,)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return AutomatonCache(str(tmp_path_factory.mktemp("structured")))


@pytest.fixture(scope="module")
def compile_(tok, V, eos, cache):
    def run(**kw):
        a = cache.get(StructuredOutputsParams(**kw), tok, V, eos)
        check_invariants(a, len(tok))
        return a

    return run


# ---------------------------------------------------------------- helpers


def check_invariants(a: TokenAutomaton, tokenizer_size: int) -> None:
    S, W = a.allowed.shape
    assert S == a.num_states and W == -(-a.vocab_size // 32) and a.allowed.dtype == np.int32
    assert a.default_next.dtype == a.exc_offsets.dtype == a.exc_tokens.dtype == a.exc_next.dtype == np.int32
    assert a.exc_offsets.shape == (S + 1,) and a.exc_offsets[0] == 0 and a.exc_offsets[-1] == a.num_exceptions
    assert np.all(np.diff(a.exc_offsets) >= 0) and a.initial_state == 0
    assert np.all((a.default_next >= -1) & (a.default_next < S))
    assert np.all((a.exc_next >= 0) & (a.exc_next < S))
    eos = np.asarray(a.eos_token_ids)
    for s in range(S):
        ids = a.allowed_tokens(s)
        assert np.all(ids < tokenizer_size), "ids beyond the tokenizer are never allowed"
        has_eos = np.isin(eos, ids)
        assert (has_eos.all() if a.accepting[s] else not has_eos.any()), "EOS exactly in accepting states"
        non_eos = ids[~np.isin(ids, eos)]
        assert len(non_eos) or a.accepting[s], "a non-accepting state allows some token"
        assert (a.default_next[s] == -1) == (len(non_eos) == 0)
        lo, hi = a.exc_offsets[s], a.exc_offsets[s + 1]
        ex = a.exc_tokens[lo:hi]
        assert np.all(np.diff(ex) > 0), "exceptions sorted, unique"
        assert np.isin(ex, non_eos).all(), "exceptions are allowed non-EOS tokens"
        assert np.all(a.exc_next[lo:hi] != a.default_next[s])
        if len(non_eos):  # the default is the most common next state
            counts = np.bincount(a.exc_next[lo:hi], minlength=S)
            assert counts.max(initial=0) <= len(non_eos) - (hi - lo)
        for e in a.eos_token_ids:
            assert a.next_state(s, e) == -1


def distances(a: TokenAutomaton) -> np.ndarray:
    """Fewest tokens from each state to an accepting one."""
    succ = [set() for _ in range(a.num_states)]
    for s in range(a.num_states):
        if a.default_next[s] >= 0:
            succ[s].add(int(a.default_next[s]))
        succ[s].update(a.exc_next[a.exc_offsets[s]:a.exc_offsets[s + 1]].tolist())
    dist = np.where(a.accepting, 0, 10**9)
    changed = True
    while changed:
        changed = False
        for s in range(a.num_states):
            best = min((dist[t] + 1 for t in succ[s]), default=10**9)
            if best < dist[s]:
                dist[s], changed = best, True
    return dist


def walk(a: TokenAutomaton, rng, dist, p_random=0.5, p_stop=0.3, max_steps=400) -> list[int]:
    """A random path of allowed tokens to EOS, drifting toward completion (EOS not included)."""
    s, ids = a.initial_state, []
    eos = set(a.eos_token_ids)
    for _ in range(max_steps):
        allowed = [t for t in a.allowed_tokens(s).tolist() if t not in eos]
        if a.accepting[s] and (not allowed or rng.random() < p_stop):
            return ids
        nxt = {t: a.next_state(s, t) for t in allowed}
        closer = [t for t in allowed if dist[nxt[t]] < dist[s]]
        pool = allowed if (rng.random() < p_random or not closer) else closer
        t = pool[rng.integers(len(pool))]
        ids.append(t)
        s = nxt[t]
        assert s >= 0
    raise AssertionError("walk did not finish")


def accepts(a: TokenAutomaton, tok, text: str) -> bool:
    """Whether the tokenizer's own tokens for `text`, then EOS, are a path of allowed tokens."""
    s = a.initial_state
    for t in tok.encode(text, add_special_tokens=False):
        s = a.next_state(s, t)
        if s < 0:
            return False
    return bool(a.accepting[s]) and all(a.is_allowed(s, e) for e in a.eos_token_ids)


def decode(tok, ids) -> str:
    return tok.decode(ids, clean_up_tokenization_spaces=False)


# ---------------------------------------------------------------- params


@pytest.mark.parametrize("kwargs, exc, words", [
    ({}, ValueError, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, ValueError, "regex, choice"),
    ({"json_object": False}, ValueError, "exactly one"),
    ({"json": "{"}, ValueError, "structured_outputs.json: not valid JSON"),
    ({"json": "[1, 2]"}, ValueError, "structured_outputs.json"),
    ({"json": {"type": "foo"}}, ValueError, "structured_outputs.json"),
    ({"json": {"type": 3}}, ValueError, "structured_outputs.json"),
    ({"json": {"$ref": "#/nope"}}, ValueError, "structured_outputs.json"),
    ({"json": 5}, TypeError, "structured_outputs.json"),
    ({"regex": "("}, ValueError, "structured_outputs.regex: invalid"),
    ({"regex": "a(?=b)"}, ValueError, "structured_outputs.regex: unsupported"),
    ({"regex": 5}, TypeError, "structured_outputs.regex"),
    ({"choice": []}, ValueError, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, TypeError, "structured_outputs.choice[1]"),
    ({"choice": "ab"}, TypeError, "structured_outputs.choice"),
    ({"json_object": "yes"}, TypeError, "structured_outputs.json_object"),
    ({"grammar": "root ::= 'a'"}, ValueError, "structured_outputs.grammar: grammars (EBNF / Lark) are not supported"),
    ({"grammar": 3}, TypeError, "structured_outputs.grammar"),
])
def test_params_validation_names_the_field(kwargs, exc, words):
    with pytest.raises(exc) as e:
        StructuredOutputsParams(**kwargs)
    assert words in str(e.value) and str(e.value).startswith("structured_outputs")


def test_params_keys_are_stable_and_distinct():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    as_dict = StructuredOutputsParams(json=schema)
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    assert as_dict.key() == as_text.key() and as_dict.key().startswith("json:") and hash(as_dict) == hash(as_text)
    reordered = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=reordered).key() != as_dict.key()  # property order orders the output
    assert StructuredOutputsParams(regex="[0-9]+").key() == "regex:[0-9]+"
    assert StructuredOutputsParams(choice=["a", "b"]).key() == StructuredOutputsParams(choice=("a", "b")).key()
    assert StructuredOutputsParams(choice=["a", "b"]).key() != StructuredOutputsParams(choice=["b", "a"]).key()
    assert StructuredOutputsParams(json_object=True, regex=None).key() == "json_object"
    assert StructuredOutputsParams(regex="x", json_object=False).kind == "regex"


# ---------------------------------------------------------------- vocabulary


def test_byte_level_vocabulary_matches_the_tokenizer(tok, V, eos):
    vocab = build_tokenizer_vocab(tok, V, eos)
    assert vocab.kind == "byte_level" and tokenizer_vocab(tok, V, eos).fingerprint == vocab.fingerprint
    specials = set(tok.all_special_ids)
    assert not specials & set(vocab.token_ids)  # EOS handled by the compiler, other specials never allowed
    for tid, data in zip(vocab.token_ids, vocab.token_bytes):
        text = data.decode("utf-8", errors="replace")
        if "\ufffd" not in text:
            assert decode(tok, [tid]) == text, tid
    assert build_tokenizer_vocab(tok, V + 1, eos).fingerprint != vocab.fingerprint


def test_sentencepiece_style_vocabulary():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁", "a", "<0x0A>", "<0xC3>", "<0xA9>", "b▁c", "t", "h", "e"]
    backend = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True,
                                   unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    t = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    t.add_tokens(["<tool>"])  # a non-special added token: literal text
    vocab = build_tokenizer_vocab(t, 40, [2])
    got = dict(zip(vocab.token_ids, vocab.token_bytes))
    assert vocab.kind == "sentencepiece"
    assert got == {3: b" the", 4: b" ", 5: b"a", 6: b"\n", 7: b"\xc3", 8: b"\xa9", 9: b"b c", 10: b"t",
                   11: b"h", 12: b"e", 13: b"<tool>"}
    cache = AutomatonCache(disk=False)
    a = cache.get(StructuredOutputsParams(choice=[" the a", "é\n"]), t, 40, [2])
    check_invariants(a, len(t))
    assert a.vocab_size == 40 and a.allowed.shape == (a.num_states, 2)
    assert a.allowed_tokens(0).tolist() == [3, 4, 7]  # " the", " ", the first byte of é
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: no output of this tokenizer's tokens"):
        cache.get(StructuredOutputsParams(regex="[a-z]*z"), t, 40, [2])  # no "z": every path is a dead end
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: cannot be compiled for this tokenizer"):
        cache.get(StructuredOutputsParams(regex="x"), t, 40, [2])  # outlines-core's own check
    # dead ends are pruned: "a", "h", "e" only lead into the z-less loop; "t" may still become "the"
    a = cache.get(StructuredOutputsParams(regex="[a-z]*z|the"), t, 40, [2])
    check_invariants(a, len(t))
    assert a.allowed_tokens(0).tolist() == [10]
    assert a.num_states == 4 and a.next_state(a.next_state(a.next_state(0, 10), 11), 12) == 3 and a.accepting[3]


# ---------------------------------------------------------------- automata

REGEXES = [
    r"[0-9]{2,4}-[a-z]+",
    r"(cat|dog|bird)s?( and (cat|dog))*",
    r'\{"x": ?[0-9]+(, "y": (true|false))?\}',
    r"(The|the) (capital|engine) of [A-Z][a-z]+ is [A-Z][a-z]*\.",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_each_state_allows_exactly_the_tokens_a_match_can_follow(compile_, tok, V, eos, regex):
    """Along random walks, every state's allowed tokens are exactly those after which the text is still the
    start of a match (the `regex` module's partial matching is the oracle, over the whole vocabulary), EOS
    exactly where the text is a whole match, and each token's next state is where the text goes. Where the
    text could end but goes on ("cat" before "cats"), every continuation stays allowed (compiler.py's end
    marker)."""
    import regex as oracle

    a = compile_(regex=regex)
    vocab = tokenizer_vocab(tok, V, eos)
    pieces = dict(zip(vocab.token_ids, vocab.token_bytes))
    pattern = oracle.compile(regex)
    rng = np.random.default_rng(len(regex))

    def possible(data: bytes, whole: bool = False) -> bool:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return False  # ASCII patterns: a byte past ASCII never matches
        return pattern.fullmatch(text, partial=not whole) is not None

    for _ in range(12):
        s, data = a.initial_state, b""
        for _ in range(30):
            ours = set(a.allowed_tokens(s).tolist())
            want = {t for t, piece in pieces.items() if possible(data + piece)}
            assert ours - set(eos) == want, (regex, data)
            assert (set(eos) <= ours) == possible(data, whole=True) == bool(a.accepting[s]), (regex, data)
            choices = sorted(ours - set(eos))
            if not choices or rng.random() < 0.1:
                break
            t = choices[rng.integers(len(choices))]
            s, data = a.next_state(s, t), data + pieces[t]
            assert s >= 0


def test_text_that_could_end_may_go_on(compile_, tok):
    """outlines-core alone drops a token that goes on from a whole match into text not yet complete."""
    for regex, text in [("(cat|category)", "category"), ("(ab)+", "ababab"), ("[0-9]+", "2024"), ("x(ab)?", "xab")]:
        a = compile_(regex=regex)
        s = a.initial_state
        for t in tok(text, add_special_tokens=False)["input_ids"]:
            assert a.is_allowed(s, t), (regex, text)
            s = a.next_state(s, t)
        assert a.accepting[s]


@pytest.mark.parametrize("regex", REGEXES)
def test_random_walks_fullmatch_the_regex(compile_, tok, regex):
    a = compile_(regex=regex)
    dist = distances(a)
    rng = np.random.default_rng(7)
    for _ in range(20):
        text = decode(tok, walk(a, rng, dist))
        assert re.fullmatch(regex, text), (regex, text)


def test_choice_outputs_are_in_the_list(compile_, tok):
    choices = ["yes", "no", "maybe", "a.b (c)*", "Paris, France", "café", "no way"]
    a = compile_(choice=choices)
    dist = distances(a)
    rng = np.random.default_rng(3)
    seen = {decode(tok, walk(a, rng, dist, p_stop=0.5)) for _ in range(80)}
    assert seen <= set(choices) and len(seen) >= 5


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["circle", "square", "tri"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
        },
        "note": {"type": "string"},
    },
    "required": ["id", "kind", "tags", "owner"],
}


def test_json_schema_walks_validate(compile_, tok):
    import jsonschema

    a = compile_(json=SCHEMA)
    dist = distances(a)
    rng = np.random.default_rng(11)
    with_note = 0
    for _ in range(20):
        text = decode(tok, walk(a, rng, dist, p_random=0.3))
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        with_note += "note" in value
        assert list(value)[:4] == ["id", "kind", "tags", "owner"]
    assert 0 < with_note < 20  # the optional field is optional
    good = {"id": -12, "kind": "tri", "tags": ["a", "b c"], "owner": {"name": "Zoé \\ \"q\"", "admin": True}}
    dumps = (lambda v, **kw: json.dumps(v, ensure_ascii=False, **kw))  # outlines-core's strings have no \uXXXX escapes
    assert accepts(a, tok, dumps(good)) and accepts(a, tok, dumps(good, separators=(",", ":")))
    assert accepts(a, tok, dumps({**good, "note": "n"}))
    assert not accepts(a, tok, dumps({**good, "tags": []}))  # minItems
    assert not accepts(a, tok, dumps({**good, "tags": ["a"] * 4}))  # maxItems
    assert not accepts(a, tok, dumps({**good, "kind": "hexagon"}))
    assert not accepts(a, tok, dumps({k: v for k, v in good.items() if k != "owner"}))
    assert not accepts(a, tok, dumps(good, indent=2))  # no newlines: WHITESPACE is "[ ]?"


def test_json_object_walks_are_objects(compile_, tok):
    a = compile_(json_object=True)
    dist = distances(a)
    rng = np.random.default_rng(5)

    def depth(v):
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        return 0

    depths = set()
    for _ in range(20):
        value = json.loads(decode(tok, walk(a, rng, dist, p_random=0.6, p_stop=0.6)))
        assert isinstance(value, dict)
        depths.add(depth(value))
    assert max(depths) <= compiler.JSON_OBJECT_DEPTH
    assert compiler.JSON_OBJECT_DEPTH == 2
    for ok in ['{}', '{"a": 1, "b": [true, null, "x", -2.5e3], "c": {"d": "\\u00e9"}}', '{"a":{},"b":[]}']:
        assert accepts(a, tok, ok), ok
    for bad in ['[]', '"x"', '{"a": [[1]]}', '{"a": {"b": {}}}', '{"a": 1,}', '{"a" 1}', "{'a': 1}"]:
        assert not accepts(a, tok, bad), bad


def test_a_finished_constraint_allows_only_eos(compile_, eos):
    a = compile_(choice=["ab"])
    done = [s for s in range(a.num_states) if a.default_next[s] == -1]
    assert done and all(a.accepting[s] and a.allowed_tokens(s).tolist() == list(eos) for s in done)
    assert not a.accepting[a.initial_state]


def test_tokens_beyond_the_tokenizer_are_never_allowed(compile_, tok, V):
    a = compile_(regex=".{1,3}")  # as permissive as it gets
    assert a.vocab_size == V and a.allowed.shape[1] == -(-V // 32)
    bits = np.unpackbits(a.allowed.astype("<i4").view(np.uint8), axis=1, bitorder="little")
    assert not bits[:, len(tok):].any()
    assert bits[0, : len(tok)].sum() > len(tok) // 2


# ---------------------------------------------------------------- cache


def _tables(a: TokenAutomaton):
    return [a.allowed, a.default_next, a.exc_offsets, a.exc_tokens, a.exc_next, a.accepting]


def test_cache_memory_and_disk_hits_give_identical_tables(tok, V, eos, tmp_path):
    params = StructuredOutputsParams(json=SCHEMA)
    first = AutomatonCache(str(tmp_path))
    a = first.get(params, tok, V, eos)
    assert first.stats().compiled == 1 and first.stats().compile_seconds > 0
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        again = first.get(StructuredOutputsParams(json=SCHEMA), tok, V, eos)
        times.append(time.perf_counter() - t0)
    assert again is a and first.stats().memory_hits == 20
    assert min(times) < 1e-3, times
    with pytest.raises(ValueError):
        a.allowed[0, 0] = 1  # shared: read-only

    second = AutomatonCache(str(tmp_path))  # an empty memory cache over the same directory
    t0 = time.perf_counter()
    b = second.get(params, tok, V, eos)
    disk_ms = (time.perf_counter() - t0) * 1e3
    assert second.stats().disk_hits == 1 and second.stats().compiled == 0
    assert b is not a and all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(_tables(a), _tables(b)))
    assert (b.key, b.vocab_size, b.eos_token_ids, b.initial_state) == (a.key, a.vocab_size, a.eos_token_ids, 0)
    print(f"disk hit: {disk_ms:.2f} ms for {a.num_states} states, {a.nbytes} bytes")

    second.clear_memory()
    second.get(params, tok, V, eos)
    assert second.stats().disk_hits == 2
    # a different V or EOS set is a different automaton
    other = second.get(params, tok, V + 32, eos)
    assert other.allowed.shape[1] == a.allowed.shape[1] + 1 and second.stats().compiled == 1
    # a corrupt file is a miss, recompiled and rewritten
    for path in tmp_path.glob("*.npz"):
        path.write_bytes(b"junk")
    third = AutomatonCache(str(tmp_path))
    c = third.get(params, tok, V, eos)
    assert third.stats().compiled == 1 and all(np.array_equal(x, y) for x, y in zip(_tables(a), _tables(c)))


def test_cache_compiles_once_under_threads_and_trims_the_disk(tok, V, eos, tmp_path):
    import threading

    cache = AutomatonCache(str(tmp_path), max_disk_bytes=1)
    params = StructuredOutputsParams(regex="[a-z]{1,40}@[a-z]{1,20}\\.(com|org)")
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get(params, tok, V, eos))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(g is got[0] for g in got)
    assert cache.stats().compiled == 1 and cache.stats().memory_hits == 3
    cache.get(StructuredOutputsParams(regex="[0-9]+"), tok, V, eos)
    assert len(list(tmp_path.glob("*.npz"))) == 1  # over max_disk_bytes: only the newest file stays
    assert len(cache) == 2


def test_compile_errors(tok, V):
    cache = AutomatonCache(disk=False)
    with pytest.raises(ValueError, match="EOS"):
        cache.get(StructuredOutputsParams(regex="a"), tok, V, [V + 5])
    with pytest.raises(TypeError):
        cache.get({"regex": "a"}, tok, V, [2])


# ---------------------------------------------------------------- SmolLM2 (one measurement)

SMOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "email", "role", "active", "score", "tags", "address"],
}


def test_smollm2_schema_measurement(tmp_path):
    import jsonschema
    from transformers import AutoConfig, AutoTokenizer

    from graphdecode.gguf_import import smollm2_dir

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    V = AutoConfig.from_pretrained(path).vocab_size
    eos = (tok.convert_tokens_to_ids("<|im_end|>"),)
    params = StructuredOutputsParams(json=SMOL_SCHEMA)
    cache = AutomatonCache(str(tmp_path))
    t0 = time.perf_counter()
    a = cache.get(params, tok, V, eos)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.get(params, tok, V, eos)
    mem = time.perf_counter() - t0
    t0 = time.perf_counter()
    AutomatonCache(str(tmp_path)).get(params, tok, V, eos)
    disk = time.perf_counter() - t0
    print(f"\nSmolLM2 8-field schema: {a.num_states} states, {a.num_exceptions} exceptions "
          f"(max {a.max_exceptions}/state), {a.nbytes / 1e6:.2f} MB tables, compile {cold:.2f} s cold "
          f"({a.compile_seconds:.2f} s in the compiler), memory hit {mem * 1e3:.3f} ms, disk hit {disk * 1e3:.2f} ms")
    assert a.vocab_size == V and a.num_states < 1000 and a.max_exceptions < 1000
    check_invariants(a, len(tok))
    dist = distances(a)
    rng = np.random.default_rng(0)
    for _ in range(3):
        jsonschema.validate(json.loads(decode(tok, walk(a, rng, dist, p_random=0.05, max_steps=600))), SMOL_SCHEMA)
