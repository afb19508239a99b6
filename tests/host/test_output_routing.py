"""Output routing: any number of stream() iterators, read in any interleaving, together with
generate() calls, each receive all of their own deltas and exactly one finished output;
nothing is delivered twice. Plus the LLM conveniences: chat, get_tokenizer, use_tqdm."""

from __future__ import annotations

import random

import pytest

from graphdecode import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, num_decode_steps=4, max_model_len=256, max_batch_size=16)


def expected(llm, prompts, params=PARAMS):
    return {p: [c.token_ids for c in o.outputs] for p, o in zip(prompts, llm.generate(prompts, params))}


class Reader:
    """Collects one stream's deltas and checks the finished rule as it goes."""

    def __init__(self, llm, prompts, params=PARAMS):
        self.it = llm.stream(prompts, params)
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.text: dict[tuple[str, int], str] = {}
        self.finished: dict[str, int] = {}
        self.prompts = {}
        self.exhausted = False

    def read(self) -> bool:
        try:
            out = next(self.it)
        except StopIteration:
            self.exhausted = True
            return False
        assert out.request_id not in self.finished, "a delta after the finished output"
        self.prompts[out.request_id] = out.prompt
        for c in out.outputs:
            self.tokens.setdefault((out.request_id, c.index), []).extend(c.token_ids)
            self.text[(out.request_id, c.index)] = self.text.get((out.request_id, c.index), "") + c.text
        if out.finished:
            self.finished[out.request_id] = self.finished.get(out.request_id, 0) + 1
        return True

    def drain(self):
        while self.read():
            pass

    def by_prompt(self) -> dict[str, list[list[int]]]:
        result: dict[str, list[list[int]]] = {}
        for (rid, index), tokens in sorted(self.tokens.items(), key=lambda kv: kv[0][1]):
            result.setdefault(self.prompts[rid], []).append(tokens)
        return result


def test_two_streams_read_alternately_get_everything(llm):
    a_prompts, b_prompts = ["The capital of France is"], ["Once upon a time"]
    want = expected(llm, a_prompts + b_prompts)
    a, b = Reader(llm, a_prompts), Reader(llm, b_prompts)
    while not (a.exhausted and b.exhausted):
        a.read()
        b.read()
    assert a.by_prompt() == {p: want[p] for p in a_prompts} and list(a.finished.values()) == [1]
    assert b.by_prompt() == {p: want[p] for p in b_prompts} and list(b.finished.values()) == [1]
    assert all(len(t) == 40 for t in a.tokens.values())


def test_a_paused_stream_loses_nothing_while_generate_runs(llm):
    prompts = ["Pack my box with", "One, two, three"]
    want = expected(llm, prompts)
    paused = Reader(llm, prompts[:1])
    paused.read()  # started, then left alone
    assert [c.token_ids for c in llm.generate(prompts[1:], PARAMS)[0].outputs] == want[prompts[1]]
    paused.drain()
    assert paused.by_prompt() == {prompts[0]: want[prompts[0]]} and list(paused.finished.values()) == [1]


def test_random_interleaving_of_five_streams_and_two_generate_calls(llm):
    rng = random.Random(7)
    texts = [f"Prompt number {i}: the quick brown fox" for i in range(12)]
    sampled = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=30)
    want_greedy = expected(llm, texts)
    want_sampled = expected(llm, texts, sampled)
    readers = [Reader(llm, texts[2 * i : 2 * i + 2], sampled if i % 2 else PARAMS) for i in range(5)]
    generated = {}
    calls = [texts[10:11], texts[11:12]]
    while any(not r.exhausted for r in readers):
        r = rng.choice([r for r in readers if not r.exhausted])
        for _ in range(rng.randint(1, 3)):
            r.read()
        if calls and rng.random() < 0.1:
            prompts = calls.pop()
            generated.update({p: [c.token_ids for c in o.outputs] for p, o in zip(prompts, llm.generate(prompts, PARAMS))})
    for i, r in enumerate(readers):
        want = want_sampled if i % 2 else want_greedy
        assert r.by_prompt() == {p: want[p] for p in texts[2 * i : 2 * i + 2]}
        assert sorted(r.finished.values()) == [1, 1]
        for (rid, index), text in r.text.items():
            tokens = r.tokens[(rid, index)]
            assert text == llm.get_tokenizer().decode(tokens, skip_special_tokens=True)
    for prompts in calls:
        generated.update({p: [c.token_ids for c in o.outputs] for p, o in zip(prompts, llm.generate(prompts, PARAMS))})
    assert generated == {p: want_greedy[p] for p in texts[10:]}


def test_closing_a_stream_aborts_only_its_own_requests(llm):
    mine, other = Reader(llm, ["Monday, Tuesday"]), Reader(llm, ["Seven, eight"])
    mine.read()
    other.read()
    mine.it.close()
    other.drain()
    assert list(other.finished.values()) == [1] and len(next(iter(other.tokens.values()))) == 40
    assert llm.engine.requests == {}


def test_abort_from_outside_reaches_the_stream(llm):
    reader = Reader(llm, ["A long story about engines"], SamplingParams(temperature=0, max_tokens=200))
    reader.read()
    (rid,) = reader.prompts
    final = llm.abort(rid)
    assert final.outputs[0].finish_reason == "abort"
    reader.drain()
    assert reader.finished == {rid: 1}


def test_chat_and_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8))
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out[0].prompt == text and out[0].prompt_token_ids == ids and ids[0] == tokenizer.bos_token_id
    same = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].token_ids == same[0].outputs[0].token_ids
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Paris."}]],
                   SamplingParams(temperature=0, max_tokens=4))
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids[:4]
    with pytest.raises(TypeError, match="messages"):
        llm.chat([["not a dict"]])


def test_chat_template_arguments(llm):
    """vLLM's chat arguments reach the template: its own variables (chat_template_kwargs), tools, and a reply
    that continues the last message."""
    template = ("{% if shout %}LOUD {% endif %}{% for t in tools or [] %}[tool {{ t.name }}] {% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }} | {% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    out = llm.chat(conversation, params, chat_template=template, chat_template_kwargs={"shout": True},
                   tools=[{"name": "search"}], add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "LOUD [tool search] user: Hi | assistant: Hello, I am"  # the final " | " cut
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conversation, params, continue_final_message=True)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conversation, params, chat_template_kwargs=["shout"])


def test_generate_progress_bar(llm, capsys):
    prompts = [f"prompt {i}" for i in range(12)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=True)
    err = capsys.readouterr().err
    assert "12/12" in err and "req" in err
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))  # not a terminal: no bar by default
    assert "12/12" not in capsys.readouterr().err
