"""Stops: EOS and stop_token_ids on the device, stop strings on the host, min/max tokens.

Each test first runs greedy to learn what the model says, then picks a stop that
lands inside a window (k=8) and checks that nothing past it reaches the user.
"""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from graphdecode import LLM, SamplingParams
from tests.helpers import rewrite_config

PROMPT = "The quick brown fox"
K = 8


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, num_decode_steps=K, max_model_len=256, max_batch_size=8)


@pytest.fixture(scope="module")
def greedy(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].outputs[0]
    return out.token_ids


@pytest.fixture(scope="module")
def tokenizer(text_model):
    return AutoTokenizer.from_pretrained(text_model)


def _first_repeatable(tokens, start):
    """A position >= start whose token did not occur before it."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no fresh token to stop on")


def test_stop_token_ids_end_at_first_occurrence_inside_a_window(llm, greedy, tokenizer):
    i = _first_repeatable(greedy, 11)  # not on a window boundary: k=8, the prefill token is index 0
    stop = greedy[i]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == greedy[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == tokenizer.decode(greedy[:i], skip_special_tokens=True)  # the stop token's text is not output
    kept = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == tokenizer.decode(greedy[: i + 1], skip_special_tokens=True)


def test_stop_string_straddling_tokens_is_caught_and_trimmed(llm, greedy, tokenizer):
    # a stop string made of the tail of token i-1 and the head of token i
    i = 13
    left = tokenizer.decode(greedy[:i], skip_special_tokens=True)
    right = tokenizer.decode(greedy[: i + 1], skip_special_tokens=True)
    assert len(right) > len(left) and len(left) >= 2 and "\ufffd" not in right[len(left) - 2 :]
    stop = left[-2:] + right[len(left)]
    assert left.find(stop) == -1 or left.find(stop) >= len(left) - 2  # first occurrence spans the boundary
    params = SamplingParams(temperature=0, max_tokens=48, stop=[stop, "zzzzzz"])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == left[:-2]
    assert out.token_ids == greedy[: i + 1]  # tokens after the one that completed the stop are dropped
    kept = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=48, stop=stop, include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == left[:-2] + stop


def test_max_tokens_and_min_tokens(llm, greedy):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=13, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy[:13] and out.finish_reason == "length" and out.stop_reason is None
    i = _first_repeatable(greedy, 3)
    stop = greedy[i]
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=i + 5)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert stop not in out.token_ids[: i + 5]  # the stop id could not be sampled before min_tokens
    assert len(out.token_ids) >= i + 5


def test_eos_and_ignore_eos(text_model, greedy, tmp_path):
    """Make the token greedy emits at index 9 the EOS: generation stops there unless ignore_eos."""
    i = _first_repeatable(greedy, 9)
    model = tmp_path / "eos_model"
    shutil.copytree(text_model, model)
    rewrite_config(str(model), lambda raw: raw.update(eos_token_id=greedy[i]))
    (model / "generation_config.json").unlink(missing_ok=True)
    llm = LLM(str(model), num_decode_steps=K, max_model_len=256, max_batch_size=8)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    assert out.token_ids == greedy[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == greedy and out.finish_reason == "length"


def test_abort_ends_every_child(llm):
    engine = llm.engine
    request = engine.add_request(PROMPT, SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=100))
    engine.step()
    engine.step()
    llm.abort(request.request_id)
    assert [s.finish_reason for s in request.seqs] == ["abort"] * 3
    assert not engine.scheduler.running
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.config.num_pages - 1  # every page came back


def _first_fresh_run(tokens, end, length):
    """An end >= `end` whose `length` tokens ending there occur nowhere before it."""
    for j in range(end, len(tokens)):
        run = tokens[j - length + 1 : j + 1]
        if all(tokens[i - length + 1 : i + 1] != run for i in range(length - 1, j)):
            return j
    raise AssertionError("no fresh run to stop on")


def test_grouped_stop_token_ids_across_a_window_boundary(llm, greedy, tokenizer):
    """vLLM's stop_token_ids=[[a, b, c], d]: a group spanning two windows (columns 8 | 9, 10)
    ends the output; its text is left out, even the part an earlier window produced, and the
    stream never hands out text it takes back."""
    j = _first_fresh_run(greedy, 10, 3)
    group = greedy[j - 2 : j + 1]
    unused = next(t for t in range(3, len(tokenizer)) if t not in greedy)
    params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[group, unused])
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == greedy[: j + 1]  # the group's tokens stay in token_ids (vLLM)
    assert (out.finish_reason, out.stop_reason) == ("stop", str(group))
    assert out.text == tokenizer.decode(greedy[: j - 2], skip_special_tokens=True)
    deltas = [o.outputs[0].text for o in llm.stream(PROMPT, params)]
    assert "".join(deltas) == out.text  # nothing streamed and then taken back
    kept = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[group], include_stop_str_in_output=True)
    out = llm.generate(PROMPT, kept)[0].outputs[0]
    assert out.text == tokenizer.decode(greedy[: j + 1], skip_special_tokens=True)
    raw = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[group], detokenize=False)
    out = llm.generate(PROMPT, raw)[0].outputs[0]
    assert (out.token_ids, out.stop_reason, out.text) == (greedy[: j + 1], str(group), "")


def test_grouped_and_single_stop_ids_tie_and_min_tokens(llm, greedy):
    j = _first_fresh_run(greedy, 12, 2)
    while greedy[j - 1] in greedy[: j - 1] or greedy[j] in greedy[:j]:
        j = _first_fresh_run(greedy, j + 1, 2)
    group = greedy[j - 1 : j + 1]
    # the single id of the group's first token ends the output first
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[group[0], group]))
    assert (out[0].outputs[0].token_ids, out[0].outputs[0].stop_reason) == (greedy[:j], group[0])
    # the same token completes a group and is a single id: the group names the stop
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[group[1], group]))
    assert (out[0].outputs[0].token_ids, out[0].outputs[0].stop_reason) == (greedy[: j + 1], str(group))
    # a group completed before min_tokens does not stop
    late = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[group], min_tokens=j + 1, ignore_eos=True)
    out = llm.generate(PROMPT, late)[0].outputs[0]
    assert out.token_ids == greedy[:30] and out.finish_reason == "length"


@pytest.mark.parametrize("ids, message", [
    ([[1, "a"]], "only integer token ids"), ([[]], "must not be empty"), ([[1, -2]], "token ids >= 0"),
    ([1.5], "only integer token ids"),
])
def test_grouped_stop_token_ids_are_checked(ids, message):
    with pytest.raises(ValueError, match=f"stop_token_ids.*{message}"):
        SamplingParams(stop_token_ids=ids)


def test_grouped_stop_token_ids_outside_the_vocabulary_are_refused(llm, tokenizer):
    with pytest.raises(ValueError, match="stop_token_ids: .* outside the vocabulary"):
        llm.generate(PROMPT, SamplingParams(stop_token_ids=[[1, len(tokenizer) + 5]]))


def test_a_row_that_finished_gets_no_logits(llm, greedy):
    """Once a row finishes inside a window, the window's LM head runs for the live rows only (CPU); the rows that
    go on still decode what they decode alone."""
    model = llm.engine.runner.model
    rows = []
    real = model.compute_logits
    model.compute_logits = lambda hidden: (rows.append(hidden.shape[0]), real(hidden))[1]
    try:
        outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                               SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)])
    finally:
        del model.compute_logits
    assert [o.outputs[0].token_ids for o in outs] == [greedy[:3], greedy[:40]]
    assert 2 in rows and 1 in rows  # both rows' logits, then the one left's
