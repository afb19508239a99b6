"""The graph owner's logic on a CPU, through its twin (device/graph_runtime.py): what a GPU run
takes through device/graphs.py, run in CI.

* capture of the common variants, largest bucket first, and replay with new inputs;
* lazy capture of a new variant while rows are live: the warm-up window really runs and is
  undone (window_writes.py), so the tokens, logprobs and the MoE expert counters equal an
  eager engine's;
* every tensor a window changes, outside the KV cache, is in the registered set (a hybrid's recurrent
  states too: they are overwritten in place, so a warm-up must restore them).
"""

from __future__ import annotations

import pytest
import torch

from graphdecode import LLM, SamplingParams
from graphdecode.device.graph_runtime import RecordedWindow
from graphdecode.device.sampler import GREEDY, SamplerMode, SamplerVariant
from tests.helpers import SMALL_ENGINE, completions, random_prompts, token_prompts

ENGINE = dict(SMALL_ENGINE, max_model_len=128, buckets=[1, 2, 8])


def prompts(count: int, seed: int = 0) -> list[dict]:
    return token_prompts(random_prompts(count, [5, 17, 33], seed=seed))


def staggered(llm: LLM, first: list[dict], first_params, later: list[dict], later_params) -> list[tuple]:
    """`first` starts decoding, then `later` (another sampler variant) arrives while it runs:
    the later rows' window needs a variant no graph has yet, captured with live rows.
    Returns each request's (output tokens, finish reason, logprobs rounded), first then later."""
    engine = llm.engine
    requests = [engine.add_request(p, first_params) for p in first]
    for _ in range(3):  # prefill, then windows: the first rows are live in the decode state
        engine.step()
    requests += [engine.add_request(p, later_params) for p in later]
    while engine.has_unfinished():
        engine.step()
    results = []
    for request in requests:
        seq = request.seqs[0]
        steps = [[(t, round(lp.logprob, 4)) for t, lp in step.items()] for step in seq.logprobs or []]
        results.append((seq.token_ids[seq.num_prompt_tokens :], seq.finish_reason, steps))
    return results


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa_llama3"]


def test_twin_captures_largest_first_and_replays_the_eager_tokens(model):
    graphed = LLM(model, cuda_graphs=True, **ENGINE)
    windows = graphed.engine.runner.windows
    captured = [key for key in windows.capture_order]
    assert [bucket for bucket, _ in captured] == [8, 8, 2, 2, 1, 1]  # the common variants, largest first
    assert {variant for _, variant in captured} == {GREEDY, SamplerVariant(SamplerMode.SAMPLE)}
    assert all(isinstance(g, RecordedWindow) for g in windows.graphs.values())
    eager = LLM(model, cuda_graphs=False, **ENGINE)
    batch = prompts(7)
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_k=30, seed=3, max_tokens=20, n=2)):
        assert completions(graphed.generate(batch, params)) == completions(eager.generate(batch, params))
    assert sum(g.replays for g in windows.graphs.values()) > 0  # the windows ran as replays


def test_a_variant_captured_while_rows_are_live_changes_nothing(model):
    """Greedy rows run; then rows that want logprobs and penalties arrive: their variant is
    captured (a real warm-up window while the greedy rows are live) and must leave no trace."""
    first, later = prompts(3, seed=1), prompts(3, seed=2)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    special = SamplingParams(temperature=0.8, seed=9, max_tokens=16, logprobs=3, repetition_penalty=1.3,
                             ignore_eos=True)
    graphed = LLM(model, cuda_graphs=True, **ENGINE)
    before = set(graphed.engine.runner.windows.graphs)
    got = staggered(graphed, first, plain, later, special)
    assert set(graphed.engine.runner.windows.graphs) - before  # captured lazily, with live rows
    want = staggered(LLM(model, cuda_graphs=False, **ENGINE), first, plain, later, special)
    assert got == want and all(len(steps) == 16 for _, _, steps in got[3:])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lazy_capture_leaves_the_expert_counters_alone(tiny_models, family):
    """MoE layers count every live token they route; a lazily captured variant's warm-up window
    routes tokens too, and must not be counted."""
    path = tiny_models[family]
    first, later = prompts(2, seed=3), prompts(2, seed=4)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    graphed = LLM(path, cuda_graphs=True, **ENGINE)
    got = staggered(graphed, first, plain, later, with_logprobs)
    eager = LLM(path, cuda_graphs=False, **ENGINE)
    want = staggered(eager, first, plain, later, with_logprobs)
    assert got == want
    counts = graphed.stats()["moe_tokens_per_expert"]
    assert counts == eager.stats()["moe_tokens_per_expert"]
    top_k = graphed.config.model_config.moe.top_k
    live = sum(len(p["prompt_token_ids"]) + 12 - 1 for p in first + later)  # prefill + fed decode tokens
    assert [sum(layer) for layer in counts] == [top_k * live] * len(counts)


def test_lazy_capture_leaves_the_recurrent_states_alone(tiny_models):
    """A hybrid's linear layers overwrite each row's state in place (no slot to write past, as K/V has): a
    lazily captured variant's warm-up window must restore them, or the live rows' tokens change."""
    path = tiny_models["qwen3_5"]
    first, later = prompts(3, seed=6), prompts(2, seed=7)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=4, max_tokens=12, logprobs=2, ignore_eos=True)
    graphed = LLM(path, cuda_graphs=True, **ENGINE)
    before = set(graphed.engine.runner.windows.graphs)
    got = staggered(graphed, first, plain, later, sampled)
    assert set(graphed.engine.runner.windows.graphs) - before
    assert got == staggered(LLM(path, cuda_graphs=False, **ENGINE), first, plain, later, sampled)


def _tensors_of(obj, seen: set[int], found: dict[str, torch.Tensor], path: str, depth: int = 0) -> None:
    """Every tensor reachable from `obj` through attributes, lists, dicts and modules."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[path] = obj
        return
    if isinstance(obj, torch.nn.Module):
        for name, t in list(obj.named_parameters(recurse=False)) + list(obj.named_buffers(recurse=False)):
            found[f"{path}.{name}"] = t
        for name, child in obj.named_children():
            _tensors_of(child, seen, found, f"{path}.{name}", depth + 1)
        for name, value in vars(obj).items():  # plain attributes (counters, tables, packed weights)
            if not name.startswith("_"):
                _tensors_of(value, seen, found, f"{path}.{name}", depth + 1)
        return
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else None
    if items is not None:
        for key, value in items:
            _tensors_of(value, seen, found, f"{path}[{key}]", depth + 1)
        return
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("graphdecode"):
        for name, value in vars(obj).items():
            _tensors_of(value, seen, found, f"{path}.{name}", depth + 1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaNs in the same places counting as equal (never-written float buffers hold any bits)."""
    if a.is_floating_point():
        return torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    return torch.equal(a, b)


@pytest.mark.parametrize("family,speculative", [("llama_gqa_llama3", True), ("mixtral", False), ("qwen3_5", True)])
def test_everything_a_window_writes_is_registered(tiny_models, family, speculative):
    """Live rows (logprobs, penalties; speculation where asked): around each window the engine
    runs, compare every tensor the runner can reach before and after; each one the window
    changed, except the KV cache, is in the set graph capture saves and restores."""
    extra = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if speculative else {}
    llm = LLM(tiny_models[family], **ENGINE, **extra)
    runner = llm.engine.runner
    if speculative:
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    found: dict[str, torch.Tensor] = {}
    _tensors_of(runner, set(), found, "runner")
    kv = {t.untyped_storage().data_ptr() for t in runner.kv_caches}
    watched = {name: t for name, t in found.items() if t.untyped_storage().data_ptr() not in kv}
    run, seen = runner.windows.run, []

    def watched_run(bucket, variant, *args, **kwargs):
        before = {name: t.detach().clone() for name, t in watched.items()}
        run(bucket, variant, *args, **kwargs)
        changed = [name for name, t in watched.items() if not _same(t, before[name])]
        seen.append((variant, changed))

    runner.windows.run = watched_run
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=24, logprobs=2, ignore_eos=True)
    llm.generate([prompts(3, seed=5)[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    llm.generate(prompts(3, seed=5), [params, params, SamplingParams(temperature=0.5, seed=2, max_tokens=24,
                                                                     repetition_penalty=1.2, ignore_eos=True)])
    assert any(variant.speculative for variant, _ in seen) == speculative
    assert all(any("runner.state.out_tokens" in changed for v, changed in seen if v.speculative == spec)
               for spec in {v.speculative for v, _ in seen})  # the windows ran
    assert family != "mixtral" or any("runner.model.expert_tokens" in changed for _, changed in seen)
    assert family != "qwen3_5" or any("recurrent_state" in name for _, changed in seen for name in changed)
    for variant, changed in seen:
        unregistered = [name for name in changed if not runner.window_writes.holds(watched[name])]
        assert not unregistered, f"{variant}: window state outside WindowWrites: {unregistered}"


def test_twin_speculative_structured_and_penalty_windows_replay_the_eager_tokens(text_model):
    """The other graph variants a GPU captures (speculative verify rounds, automaton masks,
    penalties, min_tokens), lazily and through replay, give the eager engine's tokens."""
    from graphdecode.structured import StructuredOutputsParams

    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    graphed = LLM(text_model, cuda_graphs=True, **ENGINE, **spec)
    eager = LLM(text_model, cuda_graphs=False, **ENGINE, **spec)
    for llm in (graphed, eager):
        llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    texts = ["one two one two one two", "ab ab ab ab", "The capital of France is"]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, structured_outputs=StructuredOutputsParams(
            regex="(ab |one )+two")),
        SamplingParams(temperature=0.8, seed=6, max_tokens=24, min_tokens=4, repetition_penalty=1.3,
                       logprobs=2),
    ]
    for params in cases:
        assert completions(graphed.generate(texts, params)) == completions(eager.generate(texts, params)), params
    captured = graphed.engine.runner.windows.graphs
    assert any(v.speculative for _, v in captured) and any(v.structured for _, v in captured)
    assert any(v.penalties and v.mask_stops for _, v in captured)


def test_the_first_replay_refuses_a_python_value_copied_into_a_tensor():
    """`t[0] = 0` inside a window copies a host tensor, which CUDA graph capture refuses (found on
    the H200 in FlashInfer's verify CSR): the twin's first replay raises on it; the device-op
    forms of the same writes, and a Python value that only feeds fill_, replay."""
    t = torch.ones(6, dtype=torch.int32)

    def host_copy():
        t[0] = 0

    def device_ops():
        t[:1].zero_()
        t[2:4] = 7  # lift_fresh -> fill_: read on the host at capture, fine on CUDA
        t.copy_(torch.where(t > 5, t, 0))

    with pytest.raises(RuntimeError, match="copied into a tensor inside a captured window"):
        RecordedWindow(host_copy).replay()
    window = RecordedWindow(device_ops)
    window.replay()
    assert t.tolist() == [0, 0, 7, 7, 0, 0]
    window.replay()
    assert window.replays == 2
