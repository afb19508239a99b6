"""Speculative decoding inside the window: n-gram drafts found, verified and accepted on the
device, and exactly the tokens plain decoding gives (greedy and seeded, with n > 1, stops,
logprobs, preemption and the prefix cache)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.attention import TorchAttentionBackend
from graphdecode.device.drafters import NgramDrafter, ngram_drafts
from graphdecode.device.sampler import GREEDY, Sampler
from graphdecode.device.speculative import speculative_window
from tests.helpers import (
    SMALL_ENGINE,
    assert_same_outputs,
    completions,
    random_prompts,
    staged_spec_state,
    token_prompts,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def reference_drafts(history: list[int], d: int, n_max: int, n_min: int) -> list[int]:
    """The most recent earlier occurrence of the last n tokens (n from n_max down), and what followed."""
    length = len(history)
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        suffix = history[length - n :]
        for start in range(length - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + d]
    return []


def test_drafts_match_a_python_reference():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 50])
        width = rng.randint(1, 40)
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, width))] for _ in range(6)]
        d, n_max = rng.randint(1, 5), rng.randint(1, 4)
        n_min = rng.randint(1, n_max)
        history = torch.full((len(rows), width + 3), -7, dtype=torch.int64)  # stale entries past each length
        for i, row in enumerate(rows):
            history[i, : len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(r) for r in rows])
        drafts, counts = ngram_drafts(history, lengths, d, n_max, n_min)
        for i, row in enumerate(rows):
            want = reference_drafts(row, d, n_max, n_min)
            assert counts[i].item() == len(want), (trial, row)
            assert drafts[i, : len(want)].tolist() == want and not drafts[i, len(want) :].any()


def counting_model(vocab: int):
    """logits_fn whose greedy choice after token t is (t + 1) % vocab."""

    def logits_fn(tokens, positions, ctx):
        return torch.nn.functional.one_hot((tokens + 1) % vocab, vocab).float() * 10

    return logits_fn


def test_acceptance_is_counted_exactly():
    """A prompt that counts 0..9 then 0..4: every round's 3 drafts are the counting model's next
    tokens, so each round accepts all 3 and emits 4 tokens; a second row with nothing to copy
    emits one per round."""
    vocab, d = 10, 3
    state = staged_spec_state([list(range(10)) + list(range(5)), [7, 3]], vocab, d, steps=2)
    backend = TorchAttentionBackend([torch.zeros(20, 2, 16, 1, 4)], 1, 1, 4)
    speculative_window(counting_model(vocab), Sampler(vocab, "cpu"), backend, state, 2, 2, 16, GREEDY, 4,
                       NgramDrafter(3, 1))
    assert state.out_count[:2].tolist() == [8, 2]
    assert state.out_tokens[0, 1:9].tolist() == [5, 6, 7, 8, 9, 0, 1, 2]
    assert state.out_tokens[1, 1:3].tolist() == [4, 5]  # nothing to copy: one token per round
    assert state.speculation.spec_drafted[:2].tolist() == [6, 0] and state.speculation.spec_accepted[:2].tolist() == [6, 0]
    assert state.speculation.spec_rounds[:2].tolist() == [2, 2]
    assert state.positions[0].item() == 14 + 8 and state.input_ids[0].item() == 2
    assert state.speculation.history[0, 15:23].tolist() == [5, 6, 7, 8, 9, 0, 1, 2]


def test_queries_past_a_rows_drafts_are_inert():
    """A row that drafts fewer than d tokens (n-gram: no earlier occurrence) runs its queries past them inert,
    writing the scratch slot: nothing reads what they sample, and a CPU forward leaves inert queries out. The
    counting row drafts 3 of 3 (4 live queries), the other none (1)."""
    vocab, d = 10, 3
    state = staged_spec_state([list(range(10)) + list(range(5)), [7, 3]], vocab, d, steps=2)
    backend = TorchAttentionBackend([torch.zeros(20, 2, 16, 1, 4)], 1, 1, 4)
    live = []

    def logits_fn(tokens, positions, ctx):
        live.append(ctx.live_tokens().view(2, d + 1).sum(dim=1).tolist())
        return counting_model(vocab)(tokens, positions, ctx)

    speculative_window(logits_fn, Sampler(vocab, "cpu"), backend, state, 2, 2, 16, GREEDY, 4, NgramDrafter(3, 1))
    assert live == [[4, 1], [4, 1]]
    assert state.out_tokens[0, 1:9].tolist() == [5, 6, 7, 8, 9, 0, 1, 2] and state.out_tokens[1, 1:3].tolist() == [4, 5]


def test_a_stop_inside_an_accepted_run_ends_it():
    vocab, d = 10, 3
    state = staged_spec_state([list(range(10)) + list(range(5))], vocab, d, steps=2)
    state.stop_ids[0, 0] = 7  # the third token of the first run
    backend = TorchAttentionBackend([torch.zeros(20, 2, 16, 1, 4)], 1, 1, 4)
    speculative_window(counting_model(vocab), Sampler(vocab, "cpu"), backend, state, 1, 2, 16, GREEDY, 4,
                       NgramDrafter(3, 1))
    assert state.out_count[0].item() == 3 and state.out_tokens[0, 1:4].tolist() == [5, 6, 7]
    assert bool(state.done[0]) and state.positions[0].item() == 14 + 3


def repetitive_prompts(count: int, seed: int = 0) -> list[dict]:
    """Prompts that repeat a short pattern: greedy random models keep copying them."""
    bases = random_prompts(count, [3, 5, 8], seed=seed)
    return [{"prompt_token_ids": (b * 12)[: 20 + 7 * i]} for i, b in enumerate(bases)]


@pytest.mark.parametrize("model", ["llama_gqa_llama3", "qwen2_tied", "llama_head_dim"])
def test_speculation_gives_the_plain_tokens(tiny_models, model):
    path = tiny_models[model]
    prompts = repetitive_prompts(5) + token_prompts(random_prompts(3, [4, 30, 60]))
    cases = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(n=2, temperature=0.8, top_k=20, seed=4, max_tokens=30),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[17, 300], logprobs=2),
    ]
    plain = LLM(path, **SMALL_ENGINE)
    spec = LLM(path, speculative_config=SPEC, **SMALL_ENGINE)
    for params in cases:
        want = plain.generate(prompts, params)
        assert_same_outputs(spec.generate(prompts, params), want)
    stats = spec.stats()
    assert stats["spec_windows"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["generated_tokens"] == plain.stats()["generated_tokens"]


def test_speculation_with_preemption_prefix_cache_and_stop_strings(tiny_models, text_model):
    path = tiny_models["llama_gqa_llama3"]
    prompts = repetitive_prompts(10, seed=2)
    tight = dict(SMALL_ENGINE, max_batch_size=16, num_pages=30)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = completions(LLM(path, **tight).generate(prompts, params))
    spec = LLM(path, speculative_config=SPEC, **tight)
    assert completions(spec.generate(prompts, params)) == want
    assert completions(spec.generate(prompts, params)) == want  # the second time from the prefix cache
    stats = spec.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["spec_accepted_tokens"] > 0

    texts = ["one two three one two three one two three", "The capital of France is"]
    stops = SamplingParams(temperature=0, max_tokens=40, stop=["e t", "o"], include_stop_str_in_output=True)
    want = [[c.text for c in o.outputs] for o in LLM(text_model, **SMALL_ENGINE).generate(texts, stops)]
    spec_text = LLM(text_model, speculative_config=SPEC, **SMALL_ENGINE)
    assert [[c.text for c in o.outputs] for o in spec_text.generate(texts, stops)] == want
    streamed = {}
    for delta in spec_text.stream(texts, stops):
        streamed[delta.prompt] = streamed.get(delta.prompt, "") + delta.outputs[0].text
    assert [streamed[t] for t in texts] == [w[0] for w in want]


def test_nothing_to_copy_falls_back_to_plain_windows(tiny_models):
    llm = LLM(tiny_models["llama_head_dim"], speculative_config={"num_speculative_tokens": 4}, **SMALL_ENGINE)
    prompts = token_prompts(random_prompts(4, [3, 9], seed=9))
    llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=120, ignore_eos=True))
    stats = llm.stats()
    assert stats["spec_windows"] >= 1 and stats["spec_window_share"] < 0.5  # probes only
    assert llm.engine.spec_policy.accepted_per_verify < llm.engine.spec_policy.min_accepted


def test_penalty_windows_run_plain_and_do_not_stall_the_policy(tiny_models):
    """A window chosen to speculate runs plain when a row needs penalties; the policy is told,
    so a later request without penalties still speculates (and both give plain tokens)."""
    path = tiny_models["llama_head_dim"]
    plain = LLM(path, **SMALL_ENGINE)
    spec = LLM(path, speculative_config=SPEC, **SMALL_ENGINE)
    prompts = repetitive_prompts(3)
    penalised = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, presence_penalty=0.5)
    assert completions(spec.generate(prompts, penalised)) == completions(plain.generate(prompts, penalised))
    assert spec.stats()["spec_windows"] == 0
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert completions(spec.generate(prompts, greedy)) == completions(plain.generate(prompts, greedy))
    assert spec.stats()["spec_windows"] > 0  # the probe chosen during the penalty windows did not stay pending
    policy = spec.engine.spec_policy
    assert policy.first_window_untimed is bool(spec.config.cuda_graphs or spec.config.compile)  # eager CPU: timed
    assert all(policy.cost_ratio(bucket) is not None for bucket, _, _ in policy.window_seconds)  # both kinds timed


def test_speculative_config_is_validated(tiny_models):
    path = tiny_models["llama_head_dim"]
    for bad, field in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 16}, "num_speculative_tokens"), ({"lookahead": 3}, "lookahead"),
                       ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"), ("ngram", "dict")]:
        with pytest.raises(ValueError, match=field):
            LLM(path, speculative_config=bad)


def test_smollm2_greedy_with_speculation():
    from graphdecode.gguf_import import smollm2_dir

    path = smollm2_dir()
    prompts = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
               "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]
    params = SamplingParams(temperature=0, max_tokens=16)
    want = completions(LLM(path, **SMALL_ENGINE).generate(prompts, params))
    spec = LLM(path, speculative_config=SPEC, **SMALL_ENGINE)
    assert completions(spec.generate(prompts, params)) == want
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_cli_speculative_config(text_model, capsys):
    from graphdecode.cli import main

    args = ["generate", "--model", text_model, "--max-tokens", "12", "--json", "one two one two one two"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert capsys.readouterr().out == plain
    with pytest.raises(SystemExit):
        main(args + ["--speculative-config", "ngram"])


def test_spec_policy_probes_and_waits_for_reports():
    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, min_accepted=0.5, probe_every=4)
    assert policy.speculate(8) and not policy.speculate(8)  # one probe, then plain until it reports
    policy.observe(verifies=8, accepted=0)
    # no cost measured: the wait doubles (4 -> 8) with each probe that did not pay, up to max_probe_every
    assert [policy.speculate(8) for _ in range(9)] == [False] * 7 + [True, False]
    policy.observe(verifies=8, accepted=24)  # copying pays now (average 1.5)
    assert all(policy.speculate(8) for _ in range(3))
    assert policy.interval == 4  # and the wait starts over
    assert not SpecPolicy(enabled=False).speculate(8)


def test_spec_policy_weighs_acceptance_against_measured_cost():
    """Speculate while 1 + accepted per verify >= speculative window time / plain window time."""
    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, min_accepted=0.5, probe_every=4)
    for speculative, seconds in [(False, 9.0), (False, 1.0), (True, 9.0), (True, 3.0)]:  # the first of each: warm-up
        policy.observe_window(8, speculative, seconds)
    assert policy.cost_ratio(8) == pytest.approx(3.0) and policy.cost_ratio(16) is None
    eager = SpecPolicy(enabled=True, first_window_untimed=False)  # an eager CPU engine: its first window counts
    eager.observe_window(8, False, 2.0)
    eager.observe_window(8, True, 3.0)
    assert eager.cost_ratio(8) == pytest.approx(1.5)
    assert policy.speculate(8)
    policy.observe(verifies=10, accepted=15)  # 1.5 accepted: 2.5 tokens per verify, for 3x the cost
    assert not policy.speculate(8)
    assert policy.speculate(16)  # no cost measured at bucket 16: acceptance alone decides
    policy.observe_window(8, True, 1.5)  # verify got cheaper: ratio (3 + 1.5) / 2 = 2.25
    assert policy.speculate(8)


def test_spec_policy_does_not_average_a_tails_windows_into_its_bucket():
    """A window holding no more than half its bucket's rows (a batch's last rows, in the bucket their slots keep)
    is not averaged into the bucket's time (on a CPU it costs about a window of its own rows: a one-row
    speculative window against four-row plain ones would put the ratio below 1), but its plain time still counts
    toward the probe budget."""
    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, first_window_untimed=False)
    policy.observe_window(4, False, 1.0)
    policy.observe_window(4, True, 0.4, full=False)
    assert policy.cost_ratio(4) is None and (4, True, False) not in policy.window_seconds
    policy.observe_window(4, False, 0.3, full=False)
    assert policy.window_seconds[(4, False, False)] == 1.0 and policy._plain_seconds[4] == pytest.approx(1.3)
    policy.observe_window(4, True, 1.5)
    assert policy.cost_ratio(4) == pytest.approx(1.5)


def test_spec_policy_spends_a_fixed_share_of_time_on_losing_probes():
    """A probe runs once probe_budget of its bucket's plain time since its last probe there covers what it is
    expected to lose, (c - 1 - a) of the bucket's plain windows: one that nearly pays comes back soon, an expensive
    one rarely, however long that takes (max_probe_every counts only where the loss is unknown). A probe withdrawn (it ran plain) frees the next
    window."""
    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, probe_every=2, max_probe_every=300, probe_budget=0.02)
    assert policy.speculate(1)
    policy.withdraw()  # it ran plain: no report, so the next window may probe again
    assert policy.speculate(1)
    policy.observe(verifies=4, accepted=0)
    assert policy.interval == 4  # the cost not measured: the wait doubled
    for bucket, plain, spec in [(1, 1.0, 1.25), (16, 4.0, 8.0)]:  # each kind's first window is a warm-up
        for speculative, seconds in [(False, 9.0), (False, plain), (True, 9.0), (True, spec)]:
            policy.observe_window(bucket, speculative, seconds)
    assert policy.cost_ratio(1) == 1.25 and policy.cost_ratio(16) == 2.0

    def plain_windows_before_a_probe(bucket: int, seconds: float) -> int:
        count = 0
        while not policy.speculate(bucket):
            policy.observe_window(bucket, False, seconds)
            count += 1
        return count

    # bucket 1's plain time so far: 1 s (its timed window above); a probe there loses 0.25 s: due at 12.5 s
    assert plain_windows_before_a_probe(1, 1.0) == 12
    policy.observe(verifies=4, accepted=1)  # 0.125 accepted on average: a probe loses 0.125 s at bucket 1
    assert plain_windows_before_a_probe(1, 1.0) == 7  # 6.25 s
    # 0.1875: bucket 16 loses (2 - 1 - 0.1875) x 4 s = 3.25 s, due at 162.5 s of its own plain time (4 s so far:
    # bucket 1's probes leave its account alone)
    policy.observe(verifies=4, accepted=1)
    assert plain_windows_before_a_probe(16, 4.0) == 40
    policy.observe(verifies=4, accepted=0)
    policy.observe_window(16, True, 1000.0)  # an expensive bucket: a probe there loses ~125 plain windows
    loss = policy.probe_loss(16, policy.accepted_per_verify)
    assert loss > 120 * 4.0  # max_probe_every does not force it: the budget does, at 2% of the bucket's time
    assert plain_windows_before_a_probe(16, 4.0) == math.ceil(loss / (0.02 * 4.0)) > 300
    policy.observe(verifies=4, accepted=40)  # a report that pays: speculating again
    assert policy.speculate(1)


def test_a_window_cut_short_is_no_measure_of_a_whole_one():
    """A window whose rows all ended before its k-th step (a request's last; or one with nothing live, 4 ms) skips
    its idle steps: averaged in, it made a bucket's plain window look cheap (a ratio of 2.8 after one such window)
    or a speculative one's queries dear. It counts toward the probe budget's plain time only."""
    from graphdecode.host.spec_policy import SpecPolicy

    k = 8
    policy = SpecPolicy(enabled=True, first_window_untimed=False, draft_tokens=2, steps_per_window=k,
                        live_queries=True)
    policy.observe_window(1, False, 0.180, live_steps=k)
    policy.observe_window(1, True, 0.200, drafted=16, row_steps=8, live_steps=k)
    assert policy.cost_ratio(1) == pytest.approx(0.200 / 0.180)
    policy.observe_window(1, False, 0.004, live_steps=0)  # nothing live
    policy.observe_window(1, True, 0.050, drafted=4, row_steps=2, live_steps=2)  # two rounds of eight
    assert policy.cost_ratio(1) == pytest.approx(0.200 / 0.180)
    assert policy.window_seconds[(1, False, False)] == 0.180
    assert policy._plain_seconds[1] == pytest.approx(0.184)  # the probe budget's time counts both plain ones


def test_an_eager_cpu_window_costs_what_its_live_rows_draft():
    """An eager CPU window runs its live rows' drafted queries alone: a speculative window's cost over a plain one's
    is measured per drafted query (from its report) and expected from the rows a window holds and the drafts a
    row makes a verify, so a one-row tail whose verify costs little speculates where a full bucket would not, and a
    window that drafted nothing measures nothing. A graph's window costs its bucket's shape whatever its rows."""
    from graphdecode.host.spec_policy import SpecPolicy

    k, d = 8, 4
    eager = SpecPolicy(enabled=True, first_window_untimed=False, draft_tokens=d, steps_per_window=k,
                       live_queries=True, max_probe_every=10**6, probe_budget=0.0)
    eager.observe_window(4, False, 1.0)
    eager.observe_window(4, True, 0.5, drafted=0, row_steps=32)  # nothing drafted: no query's cost in it
    assert eager.cost_ratio(4) is None and (4, True, False) not in eager.window_seconds
    eager.observe_window(4, True, 2.0, drafted=64, row_steps=32)  # 4 rows, 2 drafts a round: 1 s over 64 queries
    assert eager.cost_ratio(4) == pytest.approx(1 + k * 4 * d / 64)  # no report yet: d drafts a row
    eager.observe(verifies=32, accepted=16, drafted=64)
    assert eager.drafts_per_verify == 2.0
    assert eager.cost_ratio(4) == pytest.approx(2.0) and eager.cost_ratio(4, rows=1) == pytest.approx(1.25)
    rows = [_policy_row(0.6, max_len=100, num_tokens=10) for _ in range(4)]
    assert not eager.speculate(4, rows) and eager.speculate(4, rows[:1])  # 0.6 pays at c = 1.25, not at 2
    # with the row costs known (m + R b a step), a tail's plain window is its rows' share of the bucket's
    m, b = 0.1, 0.0075  # a step: 0.1 + 4 x 0.0075 = 0.13 s, a window of 8 steps 1.04 s (about the measured 1.0)
    eager.observe_prefill(100, m + 100 * b)
    tail = 1.0 * (m + b) / (m + 4 * b)  # the line is fitted on the measured bucket-4 window
    assert eager.plain_seconds(4, rows=1) == pytest.approx(tail, rel=0.05)
    assert eager.cost_ratio(4, rows=1) == pytest.approx(1 + k * 2 / 64 / eager.plain_seconds(4, rows=1))
    graph = SpecPolicy(enabled=True, first_window_untimed=False, draft_tokens=d, steps_per_window=k)
    graph.observe_window(4, False, 1.0)
    graph.observe_window(4, True, 2.0, drafted=8, row_steps=8)  # its report does not change its shape's cost
    assert graph.cost_ratio(4) == graph.cost_ratio(4, rows=1) == pytest.approx(2.0)


def test_spec_policy_estimates_the_cost_of_an_unmeasured_bucket():
    """Before a bucket's speculative window is measured, its cost ratio is estimated from the prefills' per-row
    time and the smallest bucket's plain window (a forward over R rows costs m + R b; a verify runs B (d + 1) rows
    where a plain step runs B): acceptance that pays at a small bucket does not speculate at a large one whose
    verify would cost several plain windows, and the first probe there waits until the probe budget covers the
    estimated loss. Measures replace the estimate."""
    from graphdecode.host.spec_policy import SpecPolicy

    k, d, m, b = 8, 4, 0.025, 0.002  # steps per window, drafts, a step's fixed and per-row seconds
    policy = SpecPolicy(enabled=True, min_accepted=0.5, first_window_untimed=False, draft_tokens=d,
                        steps_per_window=k, max_probe_every=10**6)
    policy.observe_window(1, False, k * (m + 1 * b))
    assert policy.cost_ratio(16) is None and policy.row_costs() is None  # no prefill timed yet
    policy.observe_prefill(400, m + 400 * b)
    policy.observe_prefill(600, m + 600 * b)  # averages: 500 tokens, m + 500 b
    assert policy.row_costs() == pytest.approx((m, b))
    plain_16 = k * (m + 16 * b)
    assert policy.plain_seconds(16) == pytest.approx(plain_16)
    assert policy.cost_ratio(16) == pytest.approx(1 + k * 16 * d * b / plain_16)  # 3.25
    assert policy.cost_ratio(1) == pytest.approx(1 + k * d * b / (k * (m + b)))  # 1.30
    policy.observe(verifies=10, accepted=15)  # 1.5 accepted per verify: pays where c <= 2.5
    assert policy.speculate(1) and not policy.speculate(16)
    # the probe at bucket 16 loses (3.25 - 1 - 1.5) plain windows: due once 2% of its plain time covers that
    due = (policy.cost_ratio(16) - 2.5) * plain_16 / policy.probe_budget
    windows = 0
    while not policy.speculate(16):
        policy.observe_window(16, False, plain_16)
        windows += 1
    assert windows == math.ceil(due / plain_16)  # 38 plain windows, then the probe
    policy.observe(verifies=10, accepted=15)
    policy.observe_window(16, False, 0.5)  # measured plain: the estimate's denominator
    assert policy.cost_ratio(16) == pytest.approx(1 + k * 16 * d * b / (0.5 * 0.5 + 0.5 * plain_16))
    policy.observe_window(16, True, 1.0)  # measured both: the measure
    assert policy.cost_ratio(16) == pytest.approx(1.0 / policy.window_seconds[(16, False, False)])
    assert SpecPolicy(enabled=True, first_window_untimed=False).row_costs() is None
    plain_only = SpecPolicy(enabled=True, first_window_untimed=False)  # no draft_tokens: no estimate
    plain_only.observe_window(1, False, 1.0)
    plain_only.observe_prefill(500, 2.0)
    assert plain_only.cost_ratio(16) is None


def test_the_engine_times_its_prefills_for_the_policy(tiny_models):
    """Each step that prefills and samples reports its prefill's tokens and time to the policy."""
    path = tiny_models["llama_head_dim"]
    spec = LLM(path, speculative_config=SPEC, **SMALL_ENGINE)
    engine = spec.engine
    seen = []
    observe = engine.spec_policy.observe_prefill

    def record(tokens, seconds):
        seen.append((tokens, seconds))
        observe(tokens, seconds)

    engine.spec_policy.observe_prefill = record
    prompts = repetitive_prompts(3)
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert sum(tokens for tokens, _ in seen) == sum(len(p["prompt_token_ids"]) for p in prompts)
    assert all(seconds > 0 for _, seconds in seen)
    assert engine.spec_policy.row_costs() is not None


def _policy_row(acceptance, temperature: float = 0.0, **fields):
    """What SpecPolicy reads of a running sequence: its acceptance, its request's sampling, its lengths."""
    from types import SimpleNamespace

    params = SimpleNamespace(is_greedy=temperature == 0)
    return SimpleNamespace(spec_acceptance=acceptance, request=SimpleNamespace(params=params), **fields)


def test_sampled_windows_have_their_own_cost_ratio():
    """A window with a sampled row pays for its noise and, speculating, for rejection sampling's distributions
    (on a CPU a sampled EAGLE-3 window cost 1.40 plain ones where a greedy one cost 1.29, BENCHMARKS.md 18s): its
    ratio is measured on sampled windows, the greedy one standing in until both sampled kinds have run."""
    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, min_accepted=0.1, first_window_untimed=False, max_probe_every=10**6,
                        probe_budget=0.0)
    policy.observe_window(1, False, 1.0)
    policy.observe_window(1, True, 1.2)  # greedy windows: c = 1.2
    policy.observe(verifies=4, accepted=2)  # 0.5 accepted per verify: pays where c (1 + 10%) <= 1.5
    greedy = [_policy_row(None, max_len=100, num_tokens=10)]
    sampled = [_policy_row(None, temperature=0.7, max_len=100, num_tokens=10)]
    assert policy.cost_ratio(1, sampled=True) == pytest.approx(1.2)  # not measured: the greedy one stands in
    assert policy.speculate(1, greedy) and policy.speculate(1, sampled)
    policy.observe_window(1, False, 1.0, sampled=True)
    policy.observe_window(1, True, 1.6, sampled=True)
    assert policy.cost_ratio(1, sampled=True) == pytest.approx(1.6) and policy.cost_ratio(1) == pytest.approx(1.2)
    assert policy.speculate(1, greedy) and not policy.speculate(1, sampled)
    assert not policy.speculate(1, greedy + sampled)  # one sampled row makes the window a sampled one


def test_spec_policy_weighs_the_rows_a_window_holds():
    """Each sequence keeps its own acceptance from its rows of the reports; a window expects the mean over its
    rows, with the engine-wide average standing in for rows not yet measured: one request's copying does not
    make its batch company speculate, and a cohort that drafts badly stops after its first window."""

    from graphdecode.host.spec_policy import SpecPolicy

    policy = SpecPolicy(enabled=True, min_accepted=0.5, max_probe_every=10**6, probe_budget=0.0, smoothing=0.9)
    policy.observe_queue(3)  # requests wait for rows: a window's tokens count (the mean over its rows)
    for speculative, seconds in [(False, 1.0), (False, 1.0), (True, 2.0), (True, 2.0)]:
        policy.observe_window(4, speculative, seconds)  # a speculative window costs 2 plain ones: pays from a = 1
    copier, chat, fresh = (_policy_row(None) for _ in range(3))
    assert policy.speculate(4, [copier, chat])  # no report yet: a probe
    policy.observe(verifies=16, accepted=24, rows=[(copier, 8, 22), (chat, 8, 2), (fresh, 0, 0)])
    assert (copier.spec_acceptance, chat.spec_acceptance, fresh.spec_acceptance) == (2.75, 0.25, None)
    assert policy.accepted_per_verify == 1.5
    assert policy.expected_acceptance([copier, chat]) == 1.5 and policy.speculate(4, [copier, chat])
    assert policy.speculate(4, [copier]) and not policy.speculate(4, [chat])
    assert policy.expected_acceptance([chat, fresh]) == pytest.approx((0.25 + 1.5) / 2)  # fresh: the prior
    assert policy.expected_acceptance([]) == 1.5
    # a new cohort speculates on the prior once; its own report turns it off, though the prior still pays
    cohort = [_policy_row(None) for _ in range(4)]
    assert policy.speculate(4, cohort)
    policy.observe(verifies=32, accepted=4, rows=[(seq, 8, 1) for seq in cohort])
    assert policy.accepted_per_verify == pytest.approx(0.9 * 1.5 + 0.1 * 0.125) and policy.speculate(4, [])
    assert not policy.speculate(4, cohort)


def test_with_nothing_waiting_speculation_must_not_delay_the_batchs_longest_row():
    """With no request waiting for a row, a batch lasts as long as its longest row: a window counts on the
    acceptance at which plain windows would end the batch as soon (max n / max(n / (1 + a)) - 1 over the rows'
    remaining tokens n), so copying rows do not make a row that drafts badly, and bounds the batch, slower; rows
    not yet measured count on the least of as many draws from the rows' recent acceptance."""

    from graphdecode.host.spec_policy import SpecPolicy

    def row(acceptance, left):
        return _policy_row(acceptance, max_len=1000, num_tokens=1000 - left)

    policy = SpecPolicy(enabled=True, min_accepted=0.5, max_probe_every=10**6, probe_budget=0.0)
    for speculative, seconds in [(False, 1.0), (False, 1.0), (True, 2.0), (True, 2.0)]:
        policy.observe_window(4, speculative, seconds)  # c = 2: pays from a = 1
    policy.observe(verifies=4, accepted=8)  # the prior: 2
    copiers, slow = [row(3.0, 100), row(3.0, 100), row(3.0, 100)], row(0.5, 100)
    assert policy.expected_acceptance(copiers + [slow]) == pytest.approx(0.5)  # equal n: the least accepting row
    assert not policy.speculate(4, copiers + [slow])
    policy.observe_queue(2)  # requests waiting: the mean (2.375) pays
    assert policy.expected_acceptance(copiers + [slow]) == pytest.approx(2.375) and policy.speculate(4, copiers + [slow])
    policy.observe_queue(0)
    nearly_done = row(0.0, 5)  # 5 tokens left at 1 a round ends before the copiers' 100 at 4 a round
    assert policy.expected_acceptance(copiers + [nearly_done]) == pytest.approx(3.0)
    assert policy.speculate(4, copiers + [nearly_done])
    # a longer row that drafts a little: max n / max(n / (1 + a)) - 1 = 200 / max(25, 200 / 2.5) - 1 = 1.5
    assert policy.expected_acceptance(copiers + [row(1.5, 200)]) == pytest.approx(1.5)
    assert policy.expected_acceptance([row(None, 100)]) == pytest.approx(2.0)  # no report: the prior
    # once rows have reported, f rows without one count on the least of f draws from the rows' recent acceptance
    # (its 1 / (f + 1) quantile): one new row on the median, a cohort of 16 near the lowest
    reports = [row(None, 100) for _ in range(12)]
    policy.observe(verifies=48, accepted=96, rows=[(seq, 4, 4 * a) for seq, a in zip(reports, [4] * 9 + [0] * 3)])
    assert policy.expected_acceptance([row(None, 100)]) == pytest.approx(4.0)
    assert policy.expected_acceptance([row(None, 100) for _ in range(16)]) == pytest.approx(0.0)
    assert policy.speculate(4, [row(None, 100)]) and not policy.speculate(4, [row(None, 100) for _ in range(16)])
    policy.observe_queue(1)  # with requests waiting, the mean: the prior
    assert policy.expected_acceptance([row(None, 100) for _ in range(16)]) == policy.accepted_per_verify


def test_speculating_rows_hold_pages_for_what_they_hold_not_for_every_draft(tiny_models):
    """A speculative window reserves pages for k (d + 1) tokens a row and may keep k of them: once its tokens are
    pythonized the row's upper bound comes down to what it holds plus the window in flight, so rows whose drafts
    are rejected do not creep up to max_model_len's pages window by window."""
    path = tiny_models["llama_head_dim"]
    spec = always_speculate(LLM(path, speculative_config=SPEC, **dict(SMALL_ENGINE, max_model_len=512)))
    scheduler = spec.engine.scheduler
    window, page = spec.config.window_tokens, spec.config.page_size
    slack = []
    schedule = scheduler.schedule

    def record(speculate=None):
        plan = schedule(speculate)
        slack.extend(len(seq.pages) * page - seq.num_tokens for seq in scheduler.running.values())
        return plan

    scheduler.schedule = record
    prompts = token_prompts(random_prompts(4, [24, 40], vocab=200))  # little to copy: most drafts rejected
    outs = spec.generate(prompts, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 160 for o in outs)
    assert spec.engine.stats()["spec_accepted_tokens"] < spec.engine.stats()["spec_draft_tokens"] / 2
    # the host lags one window, another is in flight and the next reserved: at most three windows and a page
    assert max(slack) <= 3 * window + page, (max(slack), window)


def test_the_engine_keeps_acceptance_per_sequence(tiny_models):
    """The engine hands each sequence its own rows of a speculative window's report."""
    path = tiny_models["llama_head_dim"]
    spec = always_speculate(LLM(path, speculative_config=SPEC, **SMALL_ENGINE))
    engine = spec.engine
    seen = []
    observe = engine.spec_policy.observe

    def record(verifies, accepted, rows=(), drafted=None):
        rows = list(rows)
        seen.append((verifies, accepted, [(seq.seq_id, v, a) for seq, v, a in rows]))
        observe(verifies, accepted, rows, drafted)

    windows = []
    observe_window = engine.spec_policy.observe_window

    def record_window(bucket, speculative, seconds, sampled=False, full=True, **report):
        windows.append((speculative, report))
        observe_window(bucket, speculative, seconds, sampled, full, **report)

    engine.spec_policy.observe = record
    engine.spec_policy.observe_window = record_window
    spec.generate(repetitive_prompts(3), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert seen and all(len(rows) == 3 for _, _, rows in seen[:1])
    for verifies, accepted, rows in seen:
        assert sum(v for _, v, _ in rows) == verifies and sum(a for _, _, a in rows) == accepted
    assert len({seq_id for _, _, rows in seen for seq_id, _, _ in rows}) == 3
    # each speculative window's time comes with its drafted queries and live row-steps (the same report's)
    reports = [report for speculative, report in windows if speculative]
    assert reports and all(set(report) == {"live_steps"} for speculative, report in windows if not speculative)
    # and with the rounds its longest-lived row ran: k in a whole window, fewer in the one where the rows end
    k = SMALL_ENGINE["num_decode_steps"]
    assert all(0 <= r["live_steps"] <= k for r in reports) and any(r["live_steps"] == k for r in reports)
    assert all(r["live_steps"] * 3 >= r["row_steps"] for r in reports)  # three rows at most
    stats = engine.stats()
    assert sum(r["drafted"] for r in reports) == stats["spec_draft_tokens"]
    assert sum(r["row_steps"] for r in reports) == stats["spec_verifies"]
    assert engine.spec_policy.live_queries and engine.spec_policy.drafts_per_verify is not None


def always_speculate(llm: LLM) -> LLM:
    """Every decode window speculates (the policy would otherwise choose by measured cost)."""
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    return llm


END_SPEC = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
END_ENGINE = dict(SMALL_ENGINE, max_model_len=96, max_batch_size=16, page_size=16)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_at_the_end_of_the_context_gives_the_plain_tokens(tiny_models, method):
    """Prompts ending at every distance 1 .. d + k + 2 from max_model_len (rows whose drafts and
    verify positions reach past their last position; a draft model's queries start past it), with
    and without max_tokens, greedy and seeded: token for token what plain decoding gives."""
    path = tiny_models["llama_gqa_llama3"]
    config = END_SPEC if method == "ngram" else {"method": "draft_model", "model": path, "num_speculative_tokens": 6}
    d, k, limit = END_SPEC["num_speculative_tokens"], END_ENGINE["num_decode_steps"], END_ENGINE["max_model_len"]
    bases = random_prompts(d + k + 2, [2, 3, 5], seed=31)
    prompts = [{"prompt_token_ids": (base * limit)[: limit - distance]}
               for distance, base in enumerate(bases, start=1)]
    cases = [
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=None, ignore_eos=True),
        [SamplingParams(temperature=0, max_tokens=max(1, distance - 2), ignore_eos=True)
         for distance in range(1, len(prompts) + 1)],
    ]
    plain = LLM(path, **END_ENGINE)
    spec = always_speculate(LLM(path, speculative_config=config, **END_ENGINE))
    for params in cases:
        want = completions(plain.generate(prompts, params))
        assert completions(spec.generate(prompts, params)) == want, params
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_speculation_at_the_end_with_constraints_and_penalties(text_model):
    """The same edge with a structured-outputs regex (its automaton walks the drafts) and with
    penalties (such windows run plain), on the text model."""
    from graphdecode.structured import StructuredOutputsParams

    d, limit = END_SPEC["num_speculative_tokens"], END_ENGINE["max_model_len"]
    plain = LLM(text_model, **END_ENGINE)
    spec = always_speculate(LLM(text_model, speculative_config=END_SPEC, **END_ENGINE))
    tokenizer = plain.get_tokenizer()
    unit = tokenizer.encode("ab ab ab ab", add_special_tokens=False)
    prompts = [{"prompt_token_ids": (unit * limit)[: limit - distance]} for distance in range(1, d + 6)]
    regex = StructuredOutputsParams(regex="(ab ?)+")
    cases = [
        SamplingParams(temperature=0, max_tokens=None, structured_outputs=regex),
        SamplingParams(temperature=1.0, seed=3, max_tokens=None, structured_outputs=regex),
        SamplingParams(temperature=0.8, seed=4, max_tokens=None, repetition_penalty=1.2, ignore_eos=True),
    ]
    for params in cases:
        want = completions(plain.generate(prompts, params))
        assert completions(spec.generate(prompts, params)) == want, params
