"""The graph runner end to end on a GPU, through LLM.

* graph replay gives exactly the eager tokens for the same backend and kernels;
* k=8 gives exactly the k=1 tokens;
* variants captured lazily while other rows are live (sampling filters, logprobs)
  leave those rows untouched (snapshot/restore around the warm-up);
* teacher-forced: at every position of the graph path's greedy output, its
  logprobs match an fp32 eager reference (same weights) within bf16/fp16 tolerance;
* a steady-state step never synchronises the host except in the pythonizer's wait;
* capture time and graph memory appear in LLM.stats();
* prefix-cache hits, full pages and a partial page copied in the same forward that
  computes it, give the uncached tokens (exactly in fp32; in bf16 the leading tokens);
* the penalty path (logit_bias, bad_words, repetition / presence / frequency) inside
  captured graphs: replay equals eager with penalty variants captured lazily while other
  rows are live, k=8 equals k=1, and penalty steps never synchronise the host;
* structured outputs inside captured graphs (needs outlines_core; only that test skips
  without it).

The model is a small random Llama saved in bf16 (head_dim 64: the kit has bf16 kernels
for 64 and 128) with the default model's byte-level BPE tokenizer (ids < 512, for
bad_words), so the fp32 reference reads exactly the same weights. Every engine is built
by `llm()`, which skips a FlashInfer case through the engine's own probe
(`require_flashinfer`) and captures two buckets, not every power of two.

Engines are shared: `engines(path, **config)` builds one engine per (model, config) for
the whole module, so the tests of this file build about ten, not one or two each. What
that asks of the tests: each uses prompts of its own (its own seeds), so none finds
another's prefix in the cache or in the page pool's history; what a test asserts about
an engine's history it measures as a difference (prefix hits, variants captured during
the test); and the two tests that assert which variants a window captured lazily get an
engine of their own (`name="lazy"`), whose variants neither captures for the other (one
captures sampling-filter and logprob variants, the other penalty variants).

Cases marked `extended` (sliding windows, mixture of experts) and `compile` (a real
inductor compile) run in profiling/gpu_check's stages after its must-pass core
(`pytest_extended`, `pytest_compile`); the rest is the core's `pytest_graphs`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.helpers import first_tokens, require_flashinfer

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 100]
ENGINE = dict(max_model_len=256, page_size=16, num_pages=256)
TEACHER_TOL = 0.15  # |logprob difference| allowed between a bf16/fp16 path and the fp32 reference
# The torch attention's graphs gather every block-table column (max_pages), its eager windows a
# power of two of the longest table: cuBLAS may sum in another order, so fp32 logprobs agree to
# rounding, not to the bit; the tokens must still be equal.
TORCH_LOGPROB_TOL = 1e-4
HEAD_DIM = 64  # bf16_model's: 256 hidden / 4 heads

# The shared configurations (2 buckets each: 4 and 16)
FLASHINFER = dict(attention_backend="flashinfer", dtype="bfloat16", compile=False, cuda_graphs=True,
                  num_decode_steps=4, max_batch_size=16)
TORCH = dict(FLASHINFER, attention_backend="torch", dtype="float32")
FLASHINFER_EAGER = dict(FLASHINFER, cuda_graphs=False)
TORCH_EAGER = dict(TORCH, cuda_graphs=False)  # also the fp32 reference of the teacher-forced cases


def _save_random_model(path: str, config_cls, seed: int, **config) -> str:
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config_cls(**config))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    from graphdecode.default_model import build_tokenizer

    path = _save_random_model(
        str(tmp_path_factory.mktemp("gpu_models") / "llama_bf16_d64"), LlamaConfig, 1234,
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    )
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engines():
    """engines(path, name=None, **config): the engine of `config` on the model at `path`, built on
    first use and shared by every test of the module that asks for the same path, config and name
    (`name` gives a test an instance of its own of a shared config)."""
    built = {}

    def engine(path: str, name: str | None = None, **config):
        key = (path, name, tuple(sorted(config.items())))
        if key not in built:
            built[key] = llm(path, **config)
        return built[key]

    yield engine
    built.clear()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def release_engines():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def prompts(seed: int, count: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 512, (PROMPT_LENGTHS[i % 6],), generator=g).tolist()}
            for i in range(count)]


def greedy(max_tokens=24, logprobs=None):
    from graphdecode import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def llm(path, **kwargs):
    """An engine on CUDA; FlashInfer cases skip where the engine's probe says it cannot run,
    and only two buckets are captured (the largest and a quarter of it)."""
    from graphdecode import LLM

    if kwargs.get("attention_backend") == "flashinfer":
        require_flashinfer(HEAD_DIM, kwargs.get("dtype") or "bfloat16")  # the checkpoints are bf16
    largest = kwargs.get("max_batch_size", 8)
    kwargs.setdefault("buckets", sorted({max(1, largest // 4), largest}))
    return LLM(path, device="cuda", **{**ENGINE, **kwargs})


def assert_teacher_forced(batch, outs, reference, steps: int, flips: float = 0.0) -> None:
    """At every position of each output, its chosen token is a near-argmax of the reference's
    logprobs for the same prefix (teacher-forced), and the shared top-5 logprobs agree.

    `flips` > 0 (mixture of experts): a bf16 hidden state flips near-tied routing decisions, and a
    flipped position moves by more than TEACHER_TOL. Up to that fraction of positions may then miss
    the tolerance and the near-argmax, while the chosen token stays in the reference's top 5
    everywhere and the median position agrees to a third of the tolerance. On the CPU, these MoE
    models in bf16 against fp32 give medians of 0.011-0.014 with at most 2 of 48 positions past
    the tolerance; expert ids shifted by one or top-k weights reversed give medians of 0.19-0.36
    with 32-43 of 48 past it."""
    forced = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids[:j]}
              for p, o in zip(batch, outs) for j in range(steps)]
    ref = reference.generate(forced, greedy(max_tokens=1, logprobs=5))
    differences, misses = [], []
    for i, out in enumerate(outs):
        for j in range(steps):
            chosen = out.outputs[0].token_ids[j]
            got = {t: lp.logprob for t, lp in out.outputs[0].logprobs[j].items()}
            want = {t: lp.logprob for t, lp in ref[i * steps + j].outputs[0].logprobs[0].items()}
            assert chosen in want, f"prompt {i} step {j}: token {chosen} is not in the reference top-5"
            if want[chosen] < max(want.values()) - TEACHER_TOL:
                misses.append(f"prompt {i} step {j}: not a near-argmax")
            differences.append(max(abs(got[t] - want[t]) for t in got.keys() & want.keys()))
    allowed = int(flips * len(differences))
    assert len(misses) <= allowed, f"{misses} (allowed: {allowed})"
    differences.sort()
    past = sum(d > TEACHER_TOL for d in differences)
    assert past <= allowed, f"{past} positions past {TEACHER_TOL} (allowed {allowed}), largest {differences[-1]:.4f}"
    median = differences[len(differences) // 2]
    assert flips == 0 or median <= TEACHER_TOL / 3, f"median logprob difference {median:.4f}"


def assert_same_logprobs(got_requests, want_requests, tolerance: float = 0.0) -> None:
    """Per request, per position: the same tokens in the logprob dicts, and logprobs equal
    (within `tolerance`; exactly at 0)."""
    for got, want in zip(got_requests, want_requests, strict=True):
        assert (got is None) == (want is None)
        if got is None:
            continue
        got_values = [{t: lp.logprob for t, lp in d.items()} for d in got]
        want_values = [{t: lp.logprob for t, lp in d.items()} for d in want]
        if tolerance == 0:
            assert got_values == want_values
            continue
        assert [set(d) for d in got_values] == [set(d) for d in want_values]
        worst = max((abs(g[t] - w[t]) for g, w in zip(got_values, want_values) for t in g), default=0.0)
        assert worst <= tolerance, f"largest logprob difference {worst:.2e}"


@pytest.mark.parametrize("backend, dtype", [("flashinfer", "bfloat16"), ("torch", "float32")])
def test_graph_replay_gives_the_eager_tokens(bf16_model, engines, backend, dtype):
    config = FLASHINFER if backend == "flashinfer" else TORCH
    assert config["dtype"] == dtype
    graphed = engines(bf16_model, **config)
    got = first_tokens(graphed.generate(prompts(10), greedy()))
    stats = graphed.stats()
    assert stats["capture_seconds"] > 0 and stats["graph_memory_bytes"] > 0
    assert stats["windows"] > 0
    eager = engines(bf16_model, **{**config, "cuda_graphs": False})
    assert first_tokens(eager.generate(prompts(10), greedy())) == got
    assert eager.stats()["capture_seconds"] == 0


def test_k8_gives_the_k1_tokens(bf16_model, engines):
    runs = [first_tokens(engines(bf16_model, **{**FLASHINFER, "num_decode_steps": k}).generate(
        prompts(20), greedy(max_tokens=30))) for k in (1, 8)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("backend, dtype", [("flashinfer", "bfloat16"), ("torch", "float32")])
def test_prefix_cache_hits_give_the_uncached_tokens(bf16_model, engines, backend, dtype):
    """Prompts of a 37-token shared prefix (2 full pages and 5 tokens of the third) + 9 own
    tokens: 5 arriving together with nothing cached (their partial hits copy from a page the
    same forward computes), then, with another prefix, one alone and 5 after it (their hits
    come from pages computed before)."""
    g = torch.Generator().manual_seed(5)
    groups = []
    for _ in range(2):
        prefix = torch.randint(3, 512, (37,), generator=g).tolist()
        groups.append([{"prompt_token_ids": prefix + torch.randint(3, 512, (9,), generator=g).tolist()}
                       for _ in range(6)])
    config = FLASHINFER if backend == "flashinfer" else TORCH
    assert config["dtype"] == dtype
    runs = {}
    for caching in (True, False):
        engine = engines(bf16_model, **(config if caching else {**config, "enable_prefix_caching": False}))
        hits_before = engine.stats()["prefix_cache_hits"]
        got = first_tokens(engine.generate(groups[0][:5], greedy()))
        got += first_tokens(engine.generate(groups[1][:1], greedy()) + engine.generate(groups[1][1:], greedy()))
        runs[caching] = got
        assert engine.stats()["prefix_cache_hits"] - hits_before == (9 * 37 if caching else 0)
    if dtype == "float32":
        assert runs[True] == runs[False]
    else:  # bf16: a different batch computed the cached K/V; near-ties may flip late tokens
        for on, off in zip(runs[True], runs[False]):
            assert on[:8] == off[:8]


def _staggered(engine, params_by_wave, seed: int):
    """Admit waves of requests (3 prompts each, seeds seed, seed + 1, ...) while earlier ones
    decode; returns token ids and logprobs in admission order."""
    requests = []
    for wave, params in enumerate(params_by_wave):
        for p in prompts(seed + wave, 3):
            requests.append(engine.engine.add_request(p, params))
        for _ in range(2):
            engine.engine.step()
    while engine.engine.has_unfinished():
        engine.engine.step()
    return [r.seqs[0].output_token_ids for r in requests], [r.seqs[0].logprobs for r in requests]


def test_lazily_captured_variants_leave_live_rows_untouched(bf16_model, engines):
    from graphdecode import SamplingParams
    from graphdecode.device.sampler import SamplerMode

    waves = [
        greedy(max_tokens=40),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=30, ignore_eos=True),  # FILTERED
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, logprobs=3),  # logprobs variant
    ]
    graphed = engines(bf16_model, "lazy", **FLASHINFER)
    captured_before = set(graphed.engine.runner.windows.graphs)
    got_tokens, got_logprobs = _staggered(graphed, waves, seed=30)
    lazily = set(graphed.engine.runner.windows.graphs) - captured_before
    assert any(v.mode == SamplerMode.FILTERED for _, v in lazily) and any(v.num_logprobs > 0 for _, v in lazily)
    want_tokens, want_logprobs = _staggered(engines(bf16_model, **FLASHINFER_EAGER), waves, seed=30)
    assert got_tokens == want_tokens
    assert_same_logprobs(got_logprobs, want_logprobs)


@pytest.mark.parametrize(
    "backend, dtype, compile_",
    [pytest.param("flashinfer", "bfloat16", True, marks=pytest.mark.compile),
     pytest.param("torch", "bfloat16", True, marks=pytest.mark.compile),
     ("flashinfer", "bfloat16", False), ("torch", "float16", False), ("flashinfer", "float16", False)],
)
def test_teacher_forced_logprobs_match_the_fp32_eager_reference(bf16_model, engines, backend, dtype, compile_):
    """The graph path of each configuration (the shared FlashInfer bf16 engine for that case)
    against the fp32 eager engine."""
    steps = 12
    batch = prompts(60, 4)
    graphed = engines(bf16_model, **{**FLASHINFER, "attention_backend": backend, "dtype": dtype,
                                     "compile": compile_})
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    assert_teacher_forced(batch, outs, engines(bf16_model, **TORCH_EAGER), steps)


def test_steady_state_steps_never_sync_the_host(bf16_model, engines):
    """Replays, staging copies, prefill planning and output copies are all asynchronous:
    with CUDA's sync debug mode set to error, any implicit synchronisation raises."""
    engine = engines(bf16_model, **FLASHINFER)
    engine.generate(prompts(70), greedy(max_tokens=8))  # first use of everything
    outs = generate_without_syncing(engine, prompts(71), greedy(max_tokens=24))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


def generate_without_syncing(engine, batch, params):
    """generate() with CUDA's sync debug mode set to error: any implicit host synchronisation raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return engine.generate(batch, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def penalty_waves():
    from graphdecode import SamplingParams

    return [
        greedy(max_tokens=40),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                       logit_bias={17: 2.0, 18: -100}),
        SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=24, ignore_eos=True, presence_penalty=0.6,
                       bad_words=["the", "engine"], logprobs=2),
    ]


@pytest.mark.parametrize("backend, dtype", [("flashinfer", "bfloat16"), ("torch", "float32")])
def test_penalty_windows_replay_the_eager_tokens(bf16_model, engines, backend, dtype):
    """Tokens exactly equal; logprobs exactly with FlashInfer, to rounding with the torch
    attention (TORCH_LOGPROB_TOL: graphs and eager windows gather different widths)."""
    config = FLASHINFER if backend == "flashinfer" else TORCH
    assert config["dtype"] == dtype
    graphed = engines(bf16_model, "lazy", **config) if backend == "flashinfer" else engines(bf16_model, **config)
    captured_before = set(graphed.engine.runner.windows.graphs)
    got_tokens, got_logprobs = _staggered(graphed, penalty_waves(), seed=40)
    lazily = set(graphed.engine.runner.windows.graphs) - captured_before
    assert any(v.penalties for _, v in lazily) and not any(v.penalties for _, v in captured_before)
    want_tokens, want_logprobs = _staggered(engines(bf16_model, **{**config, "cuda_graphs": False}),
                                            penalty_waves(), seed=40)
    assert got_tokens == want_tokens
    assert_same_logprobs(got_logprobs, want_logprobs, 0.0 if backend == "flashinfer" else TORCH_LOGPROB_TOL)


def test_penalties_k8_give_the_k1_tokens_in_graphs(bf16_model, engines):
    runs = [_staggered(engines(bf16_model, **{**FLASHINFER, "num_decode_steps": k}), penalty_waves(), seed=50)[0]
            for k in (1, 8)]
    assert runs[0] == runs[1]


def test_penalty_steps_never_sync_the_host(bf16_model, engines):
    """Admitting penalized rows (their counts staged sparsely from fresh pinned tensors) and
    replaying penalty graphs stays asynchronous."""
    engine = engines(bf16_model, **FLASHINFER)
    waves = penalty_waves()
    batch = prompts(80)
    params = [waves[i % 3] for i in range(len(batch))]
    engine.generate(batch, params)  # captures the penalty variants
    outs = generate_without_syncing(engine, prompts(81), params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_structured_windows_replay_the_eager_tokens_without_syncing(bf16_model, engines):
    """Constrained rows mask, sample and advance their automaton inside captured windows: the
    graphs give the eager tokens, a mixed batch keeps its unconstrained rows, and steady-state
    steps never sync the host (the tables were uploaded at admission)."""
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        pytest.skip("outlines_core does not import here (structured outputs' compiler; gpu_check installs it "
                    "from the carried wheels)")
    import json

    from graphdecode import SamplingParams
    from graphdecode.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    constrained = SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    batch = prompts(90)
    params = [constrained if i % 2 else free for i in range(len(batch))]
    graphed = engines(bf16_model, **TORCH)
    got = first_tokens(graphed.generate(batch, params))
    assert any(v.structured for _, v in graphed.engine.runner.windows.graphs)
    again = first_tokens(generate_without_syncing(graphed, batch, params))
    assert again == got
    texts = [o.outputs[0].text for o in graphed.generate(batch[1::2], constrained)]
    for text in texts:
        value = json.loads(text)
        assert 0 <= value["a"] <= 99 and value["b"] in ("x", "y")
    eager = engines(bf16_model, **TORCH_EAGER)
    assert first_tokens(eager.generate(batch, params)) == got


# ------------------------------------------------------------------ sliding windows (extended)
@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> str:
    """bf16 Mistral, head_dim 64 (a kit kernel), a 24-token sliding window: prompts pass it."""
    from transformers import MistralConfig

    return _save_random_model(
        str(tmp_path_factory.mktemp("gpu_models") / "mistral_bf16_swa24"), MistralConfig, 99,
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
        sliding_window=24,
    )


@pytest.mark.extended
@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
def test_sliding_window_in_graphs_matches_the_fp32_reference_teacher_forced(windowed_model, engines, backend):
    """The window path in captured graphs (FlashInfer's window_left, or the torch reference where
    the kit has no window kernel: the backend says which) against the fp32 eager reference."""
    steps = 12
    batch = prompts(100, 4)  # 1 to 100 tokens: most pass the 24-token window
    graphed = llm(windowed_model, attention_backend=backend, dtype="bfloat16", compile=False, cuda_graphs=True,
                  num_decode_steps=4, max_batch_size=4)
    assert graphed.engine.runner.model.attention_specs[0].sliding_window == 24
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    del graphed
    assert_teacher_forced(batch, outs, engines(windowed_model, **TORCH_EAGER), steps)


# ------------------------------------------------------------------ mixture of experts in graphs (extended)
@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """bf16 Qwen3-MoE (8 experts, top-3, one dense layer) and gpt-oss (sinks, windows, yarn), head_dim 64.
    Weights of std 0.05: at 0.1 bf16 routing flips move 14 of 48 teacher-forced positions past the
    tolerance, at 0.02 the logits are too flat for a wrong expert to show (assert_teacher_forced)."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=1024, initializer_range=0.05, bos_token_id=1, eos_token_id=2)
    configs = {
        "qwen3_moe": (Qwen3MoeConfig, dict(common, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                                           num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1])),
        "gpt_oss": (GptOssConfig, dict(common, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                                       sliding_window=24, rope_parameters={
                                           "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 64})),
    }
    root = tmp_path_factory.mktemp("gpu_models")
    return {name: _save_random_model(str(root / f"{name}_bf16"), config_cls, 7, **config)
            for name, (config_cls, config) in configs.items()}


@pytest.mark.extended
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_in_graphs_replays_eager_matches_fp32_and_never_syncs(moe_models, family):
    """The experts' op inside captured graphs: grouped GEMM in bf16 on sm90/sm100 (dense elsewhere), gpt-oss's
    sinks on FlashInfer (its base-2 LSE checked against the fp32 torch engine here),
    replay equal to eager, teacher-forced against the fp32 eager engine (the dense path; a few
    routing flips allowed, see assert_teacher_forced), no host sync in steady state, and every live
    token counted once per MoE layer and top-k slot. The grouped GEMM's own numbers are checked
    against an fp32 loop on fixed routing below."""
    path = moe_models[family]
    backend = "flashinfer"  # gpt-oss: sinks through the LSE on its full layers, its window layers on the reference
    common = dict(attention_backend=backend, dtype="bfloat16", compile=False, num_decode_steps=4, max_batch_size=4)
    graphed = llm(path, cuda_graphs=True, **common)
    experts = graphed.engine.runner.model.moe_layers[0].experts
    major = torch.cuda.get_device_capability()[0]
    assert experts.implementation == ("grouped" if major in (9, 10) else "dense")
    steps, batch = 12, prompts(110, 4)
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    counts = graphed.stats()["moe_tokens_per_expert"]
    live = sum(len(p["prompt_token_ids"]) + steps - 1 for p in batch)
    top_k = graphed.config.model_config.moe.top_k
    assert [sum(layer) for layer in counts] == [top_k * live] * len(counts)
    graphed.generate(prompts(111), greedy(max_tokens=8))
    again = generate_without_syncing(graphed, prompts(111), greedy(max_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in again)
    del graphed
    eager = llm(path, cuda_graphs=False, **common)
    assert first_tokens(eager.generate(batch, greedy(max_tokens=steps))) == first_tokens(outs)
    del eager
    reference = llm(path, attention_backend="torch", dtype="float32", compile=False, cuda_graphs=False,
                    max_batch_size=64, num_pages=1024)
    assert reference.engine.runner.model.moe_layers[0].experts.implementation == "dense"
    assert_teacher_forced(batch, outs, reference, steps, flips=0.1)


@pytest.mark.extended
@pytest.mark.parametrize("activation,bias", [("silu", False), ("gpt_oss", True)])
def test_grouped_experts_match_an_fp32_loop_on_the_same_routing(activation, bias):
    """moe_grouped in bf16 (two grouped GEMMs over tokens sorted by expert, experts with no token
    and with many) against the same experts in fp32, one loop per expert, on fixed ids and weights."""
    from graphdecode.models.moe import moe_grouped, moe_reference

    if not hasattr(torch, "_grouped_mm") or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("bf16 _grouped_mm runs on sm90/sm100")
    g = torch.Generator().manual_seed(5)
    tokens, hidden, inter, num_experts, k = 45, 256, 128, 8, 3
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=g) * 0.1 if bias else None
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.1 if bias else None
    scores = torch.randn(tokens, num_experts, generator=g)
    scores[:, 7] = -1e9  # expert 7 gets no token
    scores[:20, 2] = 1e9  # expert 2 gets many
    weights, ids = torch.topk(scores.softmax(-1), k)
    ids, order = ids.sort(dim=-1)
    weights = weights.gather(-1, order)
    args = (activation, 1.702, 7.0)
    cuda = [t if t is None else t.cuda() for t in (x, ids, weights, w13, w2, b13, b2)]
    bf16 = [t if t is None or not t.is_floating_point() or t is cuda[2] else t.bfloat16() for t in cuda]
    got = moe_grouped(*bf16, *args).float()
    want = moe_reference(*[t if t is None or not t.is_floating_point() else t.float() for t in bf16], *args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
    assert (got - want).norm() / want.norm() < 1e-2


# ------------------------------------------------------------------ batch invariance (extended)
@pytest.mark.extended
def test_a_requests_bits_do_not_depend_on_its_batch_or_bucket_in_graphs(bf16_model, engines):
    """batch_invariant (the default) in captured graphs, bf16 FlashInfer: 8 prompts alone (bucket 4), together
    (bucket 16) and among 8 others give the same tokens and logprobs, greedy and seeded (docs/batch_invariance.md:
    fixed 128-row GEMMs, no split-KV)."""
    from graphdecode import SamplingParams

    llm_ = engines(bf16_model, **FLASHINFER)
    batch, others = prompts(400, 8), prompts(401, 8)
    for params in (greedy(max_tokens=16, logprobs=0),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=0)):
        def runs(items, params=params):
            return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                              o.outputs[0].logprobs)])
                    for o in llm_.generate(items, params, use_tqdm=False)]

        alone = [runs([p])[0] for p in batch]
        assert runs(batch) == alone
        assert runs([x for pair in zip(batch, others) for x in pair])[0::2] == alone
