"""Penalties inside the decode window: logit_bias, bad_words, repetition, presence and
frequency penalties, applied on the device with per-row token counts the window keeps.

Oracles: transformers' own `generate(repetition_penalty=...)`; for the others a small
reference written here on transformers' logits, step by step (teacher-forced: the
engine's tokens are fed back and each step's processed logits recomputed on the host).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.device.decode_state import DecodeState
from graphdecode.device.features.penalties import COUNT_MASK, PROMPT_BIT, PenaltyRows
from graphdecode.device.sampler import GREEDY, RowCounts, SamplerMode, SamplerVariant
from tests.helpers import first_tokens, generate_tokens, hf_logits, hf_model, random_prompts, token_prompts

ENGINE = dict(max_model_len=256, max_batch_size=16)


# ----------------------------------------------------------------- reference
def reference_logits(raw, prompt, outputs, params, bad_sequences=(), stop_ids=(2,)):
    """The engine's processing order on one step's raw logits [V], written plainly."""
    x = raw.clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    for word in bad_sequences:  # vLLM: the word's other tokens must be the last output tokens
        prefix = list(word[:-1])
        if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix) :] == prefix:
            x[word[-1]] = -math.inf
    for token in set(prompt) | set(outputs):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token, count in Counter(outputs).items():
        x[token] -= count * params.frequency_penalty + params.presence_penalty
    if len(outputs) < params.min_tokens:
        for token in stop_ids:
            x[token] = -math.inf
    return x


def check_teacher_forced(path, prompt, outputs, params, bad_sequences=()):
    """Every engine token is the argmax of the reference's processed logits (ties within 1e-4
    allowed); returns how many steps the processing changed the plain argmax."""
    logits = hf_logits(path, prompt + outputs)
    changed = 0
    for i, token in enumerate(outputs):
        raw = logits[len(prompt) - 1 + i]
        ref = reference_logits(raw, prompt, outputs[:i], params, bad_sequences)
        assert ref[token] >= ref.max() - 1e-4, (i, token, int(ref.argmax()), float(ref[token]), float(ref.max()))
        changed += int(raw.argmax()) != int(ref.argmax())
    return changed


def hf_generate_rep(path, prompts, max_new_tokens, penalty):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, repetition_penalty=penalty)
        out.append(gen[0, len(p) :].tolist())
    return out


# ------------------------------------------------------------------- params
@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty="1.2"), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=True), "frequency_penalty"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=["ok", ""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"),
])
def test_bad_values_raise_naming_the_field(kwargs, field):
    # a wrong type is a TypeError, a bad value a ValueError (test_validation checks which is which)
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**kwargs)


def test_defaults_need_no_penalties_and_keep_greedy_and_filter_semantics():
    p = SamplingParams()
    assert not p.needs_penalties and not p.needs_token_counts and p.bad_words_token_ids == ()
    assert SamplingParams(logit_bias={}).needs_penalties is False
    for kwargs in (dict(repetition_penalty=1.1), dict(presence_penalty=-0.5), dict(frequency_penalty=2),
                   dict(logit_bias={3: -100}), dict(bad_words=["x"])):
        assert SamplingParams(**kwargs).needs_penalties
    assert SamplingParams(logit_bias={3: 1}).needs_token_counts is False
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5, top_k=5)
    assert greedy.is_greedy and not greedy.needs_filter
    assert SamplingParams(temperature=1, top_p=0.5, frequency_penalty=1).needs_filter


def test_row_counts_add_the_penalty_flag_to_the_variant():
    counts = RowCounts(max_logprobs=20)
    plain, penalized = SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=1)
    counts.add(plain)
    assert counts.variant() == GREEDY
    counts.add(penalized)
    assert counts.variant() == SamplerVariant(SamplerMode.GREEDY, penalties=True)
    counts.remove(penalized)
    assert counts.variant() == GREEDY


def test_engine_limits_are_checked_per_request(tiny_models, text_model):
    llm = LLM(tiny_models["qwen2_tied"], max_model_len=64, max_batch_size=2, max_logit_bias=2)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="logit_bias: 3 entries exceed max_logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={3: 1, 4: 1, 5: 1}))
    with pytest.raises(ValueError, match="logit_bias: token id 512 is outside the vocabulary"):
        llm.generate(prompt, SamplingParams(logit_bias={512: 1}))
    with pytest.raises(ValueError, match="bad_words: .*no tokenizer"):
        llm.generate(prompt, SamplingParams(bad_words=["x"]))
    for name in ("max_logit_bias", "max_bad_words", "max_bad_word_tokens"):
        with pytest.raises(ValueError, match=name):
            LLM(tiny_models["qwen2_tied"], **{name: 0})

    text = LLM(text_model, max_model_len=64, max_batch_size=2, max_bad_words=2, max_bad_word_tokens=2)
    with pytest.raises(ValueError, match="bad_words: 3 words exceed max_bad_words"):
        text.generate("Hello", SamplingParams(bad_words=["a", "b", "c"]))
    with pytest.raises(ValueError, match="bad_words: 'supercalifragilistic' is .* max_bad_word_tokens"):
        text.generate("Hello", SamplingParams(bad_words=["supercalifragilistic"]))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    mine = SamplingParams(bad_words=["Paris"], max_tokens=2)
    request = text.engine.prepare("Hello", [5, 6], mine)
    assert mine.bad_words_token_ids == ()  # the caller's params are left alone
    assert request.params.bad_words == ["Paris"] and request.params == mine
    assert request.params.bad_words_token_ids[0] == tuple(tokenizer.encode("Paris", add_special_tokens=False))


# --------------------------------------------------------- device pieces
def _rows(r, v, *, rep=1.0, presence=0.0, frequency=0.0, penalized=True, counts=None, bias=None, words=None,
          recent=None, slots=2, size=3, width=2):
    def full(value, dtype=torch.float32):
        return torch.full((r,), value, dtype=dtype)

    return PenaltyRows(
        penalized=full(penalized, torch.bool), repetition_penalty=full(rep), presence_penalty=full(presence),
        frequency_penalty=full(frequency),
        token_counts=counts if counts is not None else torch.zeros(r, v, dtype=torch.int16),
        bias_ids=bias[0] if bias else torch.full((r, width), -1, dtype=torch.int64),
        bias_values=bias[1] if bias else torch.zeros(r, width),
        bad_words=words if words is not None else torch.full((r, slots, size), -1, dtype=torch.int64),
        recent=recent if recent is not None else torch.full((r, size), -1, dtype=torch.int64),
    )


def test_neutral_rows_come_out_bit_for_bit_unchanged_whatever_their_stale_state():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 5
    stale = torch.randint(0, 0x7FFF, (3, 40), generator=g, dtype=torch.int64).to(torch.int16)
    words = torch.randint(0, 40, (3, 2, 3), generator=g)
    bias = (torch.randint(0, 40, (3, 2), generator=g), torch.full((3, 2), 50.0))
    rows = _rows(3, 40, penalized=False, counts=stale, bias=bias, words=words, recent=words[:, 0])
    assert torch.equal(rows.apply(logits.clone()), logits)


def test_penalties_follow_the_reference_order():
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(1, 12, generator=g) * 3
    params = SamplingParams(repetition_penalty=1.7, presence_penalty=0.4, frequency_penalty=0.3,
                            logit_bias={0: 2.5, 3: -7.0})
    prompt, outputs = [1, 2, 2, 3], [3, 5, 5, 5, 9]
    counts = torch.zeros(1, 12, dtype=torch.int16)
    for t in set(prompt):
        counts[0, t] |= PROMPT_BIT
    for t, c in Counter(outputs).items():
        counts[0, t] += c
    bias = (torch.tensor([[0, 3]]), torch.tensor([[2.5, -7.0]]))
    rows = _rows(1, 12, rep=1.7, presence=0.4, frequency=0.3, counts=counts, bias=bias)
    got = rows.apply(raw.clone())[0]
    assert torch.allclose(got, reference_logits(raw[0], prompt, outputs, params, stop_ids=()), atol=1e-6)


def test_bad_words_are_masked_when_their_prefix_was_just_produced():
    v = 10
    words = torch.full((1, 3, 3), -1, dtype=torch.int64)
    words[0, 0, 2] = 7  # one token: always
    words[0, 1, 1:] = torch.tensor([4, 5])  # two tokens: 5 after 4
    words[0, 2, :] = torch.tensor([1, 2, 3])  # three tokens: 3 after 1, 2

    def banned(recent, penalized=True):
        rows = _rows(1, v, penalized=penalized, words=words, recent=torch.tensor([recent]), slots=3)
        return (rows.apply(torch.zeros(1, v))[0] == -math.inf).nonzero().flatten().tolist()

    assert banned([-1, -1, -1]) == [7]  # nothing produced yet
    assert banned([-1, -1, 4]) == [5, 7]
    assert banned([9, 4, 8]) == [7]  # 4 is not the last token
    assert banned([9, 1, 2]) == [3, 7]
    assert banned([1, 9, 2]) == [7]
    assert banned([-1, 1, 2]) == [3, 7]
    assert banned([9, 1, 2], penalized=False) == []


def test_window_counts_saturate_and_skip_inert_rows():
    state = DecodeState(3, 2, 1, num_decode_steps=1, max_logprobs=1, device="cpu", vocab_size=8,
                        max_bad_word_tokens=3)
    pen = state.penalties
    pen.token_counts[0, 4] = PROMPT_BIT | COUNT_MASK
    pen.token_counts[1, 4] = PROMPT_BIT | 2
    tokens, live = torch.tensor([4, 4, 4]), torch.tensor([True, True, False])
    pen.record(slice(0, 3), tokens, live)
    assert pen.token_counts[:, 4].tolist() == [PROMPT_BIT | COUNT_MASK, PROMPT_BIT | 3, 0]
    assert pen.recent.tolist() == [[-1, -1, 4], [-1, -1, 4], [-1, -1, -1]]
    pen.record(torch.tensor([1, 2]), torch.tensor([6, 5]), torch.tensor([True, True]))  # prefill
    assert pen.token_counts[1, 6] == 1 and pen.token_counts[2, 5] == 1
    assert pen.recent.tolist() == [[-1, -1, 4], [-1, 4, 6], [-1, -1, 5]]


def test_staging_sends_penalty_state_only_for_penalized_rows():
    from dataclasses import replace

    from graphdecode.device.row_staging import RowStaging
    from graphdecode.plan import RowStart

    state = DecodeState(4, 4, 2, num_decode_steps=1, max_logprobs=1, device="cpu", vocab_size=10, max_logit_bias=2,
                        bad_word_slots=2, max_bad_word_tokens=3)
    pen = state.penalties
    staging = RowStaging(state, torch.device("cpu"))
    pen.token_counts.fill_(7)  # a previous occupant's counts
    params = replace(SamplingParams(repetition_penalty=1.2, logit_bias={4: -1.5}, bad_words=["x"]),
                     _bad_words_token_ids=((5,), (6, 7)))
    tokens = (1, 1, 2, 3, 3, 3, 9)  # prompt 1 1 2, output 3 3 3 9

    def start(row, params, token_ids=tokens, num_prompt_tokens=3):
        return RowStart(row=row, position=6, pages=(1,), params=params, seed=1, stop_ids=(2,), max_len=20,
                        min_len=0, token_ids=token_ids, num_prompt_tokens=num_prompt_tokens)

    for row in (0, 1):  # n > 1: children share the tokens
        staging.set_row(start(row, params))
    staging.set_row(start(2, SamplingParams()))
    staging.flush(state)
    want = [0, PROMPT_BIT, PROMPT_BIT, 3, 0, 0, 0, 0, 0, 1]
    assert pen.token_counts[:3].tolist() == [want, want, [7] * 10]
    assert pen.penalized[:4].tolist() == [True, True, False, False]
    assert pen.bias_ids[0].tolist() == [4, -1] and pen.bias_values[0].tolist() == [-1.5, 0.0]
    assert pen.bad_words[1].tolist() == [[-1, -1, 5], [-1, 6, 7]] and pen.bad_words[2].min() == -1
    assert pen.recent[:3].tolist() == [[3, 3, 9], [3, 3, 9], [-1, -1, -1]]
    assert pen.repetition_penalty[:3].tolist() == pytest.approx([1.2, 1.2, 1.0])
    staging.set_row(start(0, params, token_ids=(), num_prompt_tokens=0))  # nothing seen yet
    staging.clear_row(1)  # nothing sent: the row is inert ...
    staging.flush(state)
    assert pen.token_counts[0].tolist() == [0] * 10 and pen.recent[0].tolist() == [-1, -1, -1]
    assert pen.penalized[1] and pen.repetition_penalty[1] == pytest.approx(1.2)
    staging.set_row(start(1, SamplingParams()))  # ... until a plain occupant takes it: neutral again
    staging.set_row(start(3, SamplingParams()))  # a row never penalized sends nothing
    pen.repetition_penalty[3] = 9.0
    staging.flush(state)
    assert not pen.penalized[1] and pen.repetition_penalty[1] == 1.0 and pen.repetition_penalty[3] == 9.0


def test_counts_buffer_is_int16_rows_by_vocab(tiny_models):
    llm = LLM(tiny_models["llama_head_dim"], max_model_len=64, max_batch_size=8)
    counts = llm.engine.runner.state.penalties.token_counts
    assert counts.dtype == torch.int16 and tuple(counts.shape) == (8, 512)
    assert counts.element_size() * 256 * 128256 == 65_667_072  # what Llama-3 with 256 rows costs


# ------------------------------------------------------------- end to end
@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_repetition_penalty_matches_transformers(tiny_models, model):
    path = tiny_models[model]
    prompts = random_prompts(5, [1, 9, 17, 40, 70], seed=21)
    llm = LLM(path, num_decode_steps=4, page_size=16, **ENGINE)
    plain = first_tokens(llm.generate(token_prompts(prompts), SamplingParams(temperature=0, max_tokens=20)))
    for penalty in (1.3, 0.8):
        got = first_tokens(llm.generate(token_prompts(prompts), SamplingParams(temperature=0, max_tokens=20,
                                                               repetition_penalty=penalty)))
        assert got == hf_generate_rep(path, prompts, 20, penalty), penalty
        assert got != plain  # the penalty really changed something


def test_repetition_penalty_matches_transformers_on_smollm2():
    from transformers import AutoTokenizer

    from graphdecode.gguf_import import smollm2_dir

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["The capital of France is", "One, two, three, four,"]
    prompts = [tokenizer(t).input_ids for t in texts]
    llm = LLM(path, num_decode_steps=4, max_model_len=128, max_batch_size=2)
    for penalty in (1.3, 0.8):
        got = first_tokens(llm.generate(token_prompts(prompts), SamplingParams(temperature=0, max_tokens=10,
                                                               repetition_penalty=penalty)))
        assert got == hf_generate_rep(path, prompts, 10, penalty), penalty


PENALTY_SETS = [
    SamplingParams(temperature=0, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.5, ignore_eos=True,
                   logprobs=1),
    SamplingParams(temperature=0, max_tokens=24, frequency_penalty=-0.6, repetition_penalty=1.2,
                   logit_bias={40: 3.0, 41: -100, 100: 1.5}, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, logit_bias={7: 4.0, 2: 6.0}, frequency_penalty=1.5,
                   presence_penalty=-1.0, min_tokens=6),
]


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied"])
def test_presence_frequency_and_logit_bias_follow_the_reference_step_by_step(tiny_models, model):
    path = tiny_models[model]
    prompts = random_prompts(3, [6, 33, 70], seed=23)
    llm = LLM(path, num_decode_steps=4, **ENGINE)
    changed = 0
    for params in PENALTY_SETS:
        outs = llm.generate(token_prompts(prompts), params)
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            changed += check_teacher_forced(path, prompt, c.token_ids, params)
            if params.min_tokens:
                assert len(c.token_ids) >= params.min_tokens
            if params.logprobs is not None:  # raw: the model's log_softmax, before any penalty
                raw = torch.log_softmax(hf_logits(path, prompt + c.token_ids), dim=-1)
                for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
                    assert abs(entry[token].logprob - raw[len(prompt) - 1 + i, token].item()) < 1e-4
    assert changed >= 5  # the penalties really steered the output


def _word_for(tokenizer, ids: list[int]) -> str | None:
    """A string whose vLLM tokenization (as is, or with a leading space) is exactly `ids`."""
    text = tokenizer.decode(ids)
    word = text.lstrip()
    if not word or word != text.strip():
        return None
    variants = [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
    return word if list(ids) in variants else None


def _contains(seq: list[int], word: tuple[int, ...]) -> bool:
    n = len(word)
    return any(tuple(seq[i : i + n]) == tuple(word) for i in range(len(seq) - n + 1))


def _hf_greedy_reference(path, prompt, max_tokens, params, bad_sequences):
    """Host-side greedy with the reference processing (full recompute each step)."""
    outputs: list[int] = []
    for _ in range(max_tokens):
        raw = hf_logits(path, prompt + outputs)[-1]
        outputs.append(int(reference_logits(raw, prompt, outputs, params, bad_sequences).argmax()))
    return outputs


def test_bad_words_never_appear_and_match_the_host_reference(text_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    prompts = [tokenizer(t).input_ids for t in ("The capital of France is", "Once upon a time", "One, two,")]
    llm = LLM(text_model, num_decode_steps=4, **ENGINE)
    plain = generate_tokens(llm, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    # a one-token and a two-token word that greedy decoding does produce
    single = next(w for seq in plain for t in seq if (w := _word_for(tokenizer, [t])) and len(w) > 1)
    pair = next(w for seq in plain for a, b in zip(seq, seq[1:])
                if (w := _word_for(tokenizer, [a, b])) and w != single and single not in w)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[single, pair])
    sequences = llm.engine.prepare(None, prompts[0], params).params.bad_words_token_ids
    assert any(len(s) == 1 for s in sequences) and any(len(s) == 2 for s in sequences)
    assert any(_contains(seq, s) for seq in plain for s in sequences if len(s) == 1)
    assert any(_contains(seq, s) for seq in plain for s in sequences if len(s) == 2)

    got = first_tokens(llm.generate(token_prompts(prompts), params))
    for seq in got:
        assert not any(_contains(seq, s) for s in sequences), (seq, sequences)
    assert got != plain
    assert got == [_hf_greedy_reference(text_model, p, 20, params, sequences) for p in prompts]


def _mixed_params(count: int, max_tokens: int = 16):
    kinds = [
        dict(temperature=0),
        dict(temperature=0, repetition_penalty=1.25, frequency_penalty=0.3),
        dict(temperature=0.9, seed=5, presence_penalty=0.7, logit_bias={30: 2.0, 31: -3.0}),
        dict(temperature=0.8, top_k=30, seed=9),
        dict(temperature=1.0, seed=13, repetition_penalty=0.9, frequency_penalty=-0.4, min_tokens=4),
        dict(temperature=0, presence_penalty=-0.5, logprobs=2),
    ]
    return [SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)]) for i in range(count)]


def test_seeded_sampling_with_penalties_same_alone_and_in_a_batch_of_20(text_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    llm = LLM(text_model, num_decode_steps=4, max_model_len=256, max_batch_size=32)
    prompt = {"prompt_token_ids": tokenizer("Once upon a time there was").input_ids}
    mine = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=30, repetition_penalty=1.2,
                          presence_penalty=0.5, frequency_penalty=0.4, logit_bias={50: 2.0},
                          bad_words=["the", "engine"], ignore_eos=True)
    alone = llm.generate([prompt], mine)[0].outputs[0].token_ids
    others = token_prompts(random_prompts(19, [3, 17, 60, 9], vocab=len(tokenizer), seed=31))
    params = _mixed_params(19, max_tokens=25)
    batched = llm.generate(others[:7] + [prompt] + others[7:], params[:7] + [mine] + params[7:])
    assert batched[7].outputs[0].token_ids == alone
    assert len(set(alone)) > 5


def test_penalties_survive_preemption_and_prefix_cache_hits(tiny_models):
    path = tiny_models["llama_gqa_llama3"]
    prompts = random_prompts(6, [40, 20, 33], seed=25)
    params = _mixed_params(6, max_tokens=60)
    roomy = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=16)
    want = first_tokens(roomy.generate(token_prompts(prompts), params))
    # 19 usable pages for 6 sequences growing to 5-7 pages: running sequences are preempted mid-output
    tight = LLM(path, num_decode_steps=4, page_size=16, max_model_len=256, max_batch_size=16, num_pages=20)
    preempted = []
    scheduler, preempt = tight.engine.scheduler, tight.engine.scheduler._preempt

    def recording():
        if not scheduler.prefilling:
            seq = next(reversed(scheduler.running.values()))
            preempted.append((seq.request.params.needs_penalties, seq.num_output_tokens))
        preempt()

    scheduler._preempt = recording
    assert first_tokens(tight.generate(token_prompts(prompts), params)) == want
    assert any(penalized and produced > 0 for penalized, produced in preempted), preempted

    shared = random_prompts(1, [70], seed=26)[0]
    penalized = SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.4, frequency_penalty=0.5)
    first = roomy.generate(token_prompts([shared]), penalized)[0].outputs[0].token_ids
    hits = roomy.stats()["prefix_cache_hits"]
    assert roomy.generate(token_prompts([shared]), penalized)[0].outputs[0].token_ids == first
    assert roomy.stats()["prefix_cache_hits"] > hits
    check_teacher_forced(path, shared, first, penalized)


def test_windows_without_penalty_rows_skip_the_penalty_path(tiny_models, monkeypatch):
    llm = LLM(tiny_models["qwen2_tied"], num_decode_steps=4, **ENGINE)
    calls, flags = [], []
    real_apply, execute = PenaltyRows.apply, llm.engine.runner.execute

    def counting(rows, logits):
        calls.append(logits.shape[0])
        return real_apply(rows, logits)

    def recording(plan):
        pending = execute(plan)
        if plan.window is not None and plan.window.decode:
            flags.append(llm.engine.runner.row_counts.variant().penalties)
        return pending

    monkeypatch.setattr(PenaltyRows, "apply", counting)
    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=20))
    assert flags and not any(flags) and calls == []

    flags.clear()
    short = SamplingParams(temperature=0, max_tokens=5, frequency_penalty=1.0, ignore_eos=True)
    llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), short])
    assert flags[0] and not flags[-1]
    assert flags == sorted(flags, reverse=True)  # once the penalized row has left, never again
    assert calls[0] == 2  # the prefill samples both first tokens together, one row needs penalties
    assert len(calls) == 1 + sum(flags) * 4  # then k steps per window that holds the penalized row


def test_k1_k4_k8_give_the_same_tokens(text_model):
    prompts = random_prompts(8, [5, 30, 77, 12], vocab=300, seed=27)
    params = _mixed_params(7, max_tokens=21) + [
        SamplingParams(temperature=0.7, seed=3, max_tokens=21, bad_words=["the", "engine", "Paris"],
                       frequency_penalty=0.2, ignore_eos=True)]
    path = text_model
    runs = [generate_tokens(LLM(path, num_decode_steps=k, **ENGINE), prompts, params) for k in (1, 4, 8)]
    assert runs[0] == runs[1] == runs[2]


def test_parallel_children_each_count_their_own_tokens(tiny_models):
    path = tiny_models["llama_gqa_llama3"]
    llm = LLM(path, num_decode_steps=4, **ENGINE)
    prompt = random_prompts(1, [40], seed=28)
    greedy = dict(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4, ignore_eos=True)
    one = first_tokens(llm.generate(token_prompts(prompt), SamplingParams(**greedy)))[0]
    three = [c.token_ids for c in llm.generate(token_prompts(prompt), SamplingParams(n=3, **greedy))[0].outputs]
    assert three == [one] * 3


def test_a_rows_previous_penalties_never_leak_into_its_next_request(tiny_models):
    """Rows without penalties receive no bias / bad words / counts; their flag keeps the
    previous occupant's stale entries inert when they share a window with penalties."""
    llm = LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, **ENGINE)
    prompt, other = random_prompts(2, [12, 20], seed=29)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = first_tokens(llm.generate(token_prompts([prompt]), plain))[0]
    heavy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.3,
                           logit_bias={t: -100 for t in want[:8]} | {77: 100})
    assert first_tokens(llm.generate(token_prompts([prompt]), heavy))[0] == [77] * 12  # row 0 held those entries
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5)
    assert first_tokens(llm.generate(token_prompts([prompt, other]), [plain, penalized]))[0] == want
