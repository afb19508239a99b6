"""Reasoning separated from the answer (server/reasoning.py): `<think>` blocks opened by the output or by the
prompt, qwen3's and deepseek_r1's rule for an output without a block, tags cut across stream deltas."""

from __future__ import annotations

import random

import pytest

from graphdecode.server.reasoning import ReasoningParser, check_reasoning_parser, opened_in_prompt, split_reasoning

CASES = [  # (parser, opened in the prompt, output, reasoning, answer)
    ("qwen3", False, "<think>a</think>b", "a", "b"),
    ("qwen3", False, "<think>\nlet me see\n</think>\n\nThe answer is 4.", "\nlet me see\n", "The answer is 4."),
    ("qwen3", False, "  <think>x</think>  y z ", "x", "y z "),
    ("qwen3", False, "no block at all", "", "no block at all"),
    ("qwen3", False, "<thinking is not a tag> b", "", "<thinking is not a tag> b"),
    ("qwen3", False, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("qwen3", False, "<think></think>answer", "", "answer"),
    ("qwen3", True, "thought</think>answer", "thought", "answer"),
    ("qwen3", True, "never closed", "never closed", ""),
    ("deepseek_r1", False, "<think>a</think>b", "a", "b"),
    ("deepseek_r1", False, "thinks first</think>then answers", "thinks first", "then answers"),
    ("deepseek_r1", False, "all reasoning", "all reasoning", ""),
    ("deepseek_r1", True, "r</think>\na", "r", "a"),
    ("qwen3", False, "<think>a</think>b</think>c", "a", "b</think>c"),  # one block: later tags are answer
    ("qwen3", False, "", "", ""),
    ("qwen3", False, "<thi", "", "<thi"),  # the start of a tag that never came
    ("deepseek_r1", False, "<thi", "<thi", ""),
    ("glm45", False, "<think>a</think>\nb", "a", "b"),
    ("glm45", False, "<think></think>no thinking", "", "no thinking"),
    ("glm45", False, "no block at all", "", "no block at all"),  # qwen3's rule
]


@pytest.mark.parametrize("name,opened,text,reasoning,answer", CASES)
def test_whole_outputs(name, opened, text, reasoning, answer):
    assert split_reasoning(name, text, opened) == (reasoning, answer)


@pytest.mark.parametrize("name,opened,text,reasoning,answer", CASES)
def test_every_split_and_random_chunks_give_the_same(name, opened, text, reasoning, answer):
    cuts = [[i] for i in range(len(text) + 1)]
    rng = random.Random(len(text))
    cuts += [sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1))) for _ in range(20)]
    cuts.append(list(range(len(text) + 1)))  # one character at a time
    for points in cuts:
        parser = ReasoningParser(name, opened)
        got_r, got_a, start = [], [], 0
        for point in points + [len(text)]:
            r, a = parser.feed(text[start:point])
            got_r.append(r)
            got_a.append(a)
            start = point
        r, a = parser.finish()
        assert ("".join(got_r) + r, "".join(got_a) + a) == (reasoning, answer), points


def test_nothing_that_could_be_a_tag_is_held_longer_than_needed():
    parser = ReasoningParser("qwen3", opened=True)
    assert parser.feed("abc</thi") == ("abc", "")  # "</thi" held: it may become </think>
    assert parser.feed("nk>") == ("", "")
    assert parser.feed("  ok") == ("", "ok")  # the whitespace after </think> is the template's
    assert parser.in_reasoning is False


def test_opened_in_prompt_and_the_names():
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off (Qwen3)
    assert not opened_in_prompt("<think>old</think> user: hi assistant:") and not opened_in_prompt(None)
    assert check_reasoning_parser(None) is None and check_reasoning_parser("qwen3") == "qwen3"
    with pytest.raises(ValueError, match="--reasoning-parser: 'granite' is not one of qwen3, deepseek_r1, glm45"):
        check_reasoning_parser("granite")
