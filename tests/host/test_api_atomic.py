"""The Python API is atomic: a call that raises, whatever the stage (checking, compiling a
constraint, placing its tables, or an interrupt while it runs), leaves no request of its own in
the engine, and the engine goes on giving the same tokens. vLLM's `llm.llm_engine`
`has_unfinished_requests()` / `get_num_unfinished_requests()` say so."""

from __future__ import annotations

import pytest

from graphdecode import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers import first_tokens, random_prompts, token_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, max_model_len=128, max_batch_size=8, structured_compile_memory_bytes=64 << 20)


def prompts(count: int, seed: int = 0) -> list[dict]:
    return token_prompts(random_prompts(count, [4, 11, 23], seed=seed))


def free_pages(llm: LLM) -> int:
    return llm.stats()["kv_pages_free"]


def test_bad_numbers_raise_value_errors_naming_the_field_and_add_nothing(llm):
    engine = llm.llm_engine
    for kwargs, field in (({"top_k": 2**63}, "top_k"), ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
                          ({"temperature": 1e308}, "temperature"), ({"top_k": 2**32 + 1}, "top_k")):
        with pytest.raises(ValueError, match=field):
            llm.generate(prompts(2), SamplingParams(**kwargs))
        assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0


def test_a_constraint_over_budget_in_the_second_prompt_adds_nothing(llm):
    engine = llm.llm_engine
    pages = free_pages(llm)
    good = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(ab)+"))
    huge = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]{1,4000}"))
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_outputs\.regex: .*memory budget"):
        llm.generate(["one", "two"], [good, huge])
    assert engine.get_num_unfinished_requests() == 0 and free_pages(llm) == pages
    assert llm.generate("one", good)[0].outputs[0].finish_reason in ("stop", "length")


def test_an_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    batch = prompts(5, seed=3)
    want = first_tokens(llm.generate(batch, GREEDY))
    pages = free_pages(llm)
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:  # mid-run: prefilled, decoding
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(batch, GREEDY)
    monkeypatch.setattr(engine, "step", real_step)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    while engine.has_unfinished():  # the aborts are reported by the next step
        engine.step()
    assert free_pages(llm) == pages
    assert first_tokens(llm.generate(batch, GREEDY)) == want


def test_checked_params_are_built_without_checking_again(llm, monkeypatch):
    """The engine core builds AsyncLLM's requests from params its serving side already checked:
    the same request as a checked submission, and no check runs a second time."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=5, bad_words=["hello"], stop_token_ids=[7],
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    ids = prompts(1)[0]["prompt_token_ids"]
    checked, _ = engine.inputs.check(ids, params)
    whole = engine.prepare(None, ids, params)

    def refuse(*args, **kwargs):
        raise AssertionError("checked twice")

    monkeypatch.setattr(engine.inputs, "check", refuse)
    built = engine.prepare(None, ids, checked, checked=True)
    assert built.params.bad_words_token_ids == whole.params.bad_words_token_ids != ()
    assert built.automaton.key == whole.automaton.key
    assert [(s.stop_ids, s.max_len) for s in built.seqs] == [(s.stop_ids, s.max_len) for s in whole.seqs]
