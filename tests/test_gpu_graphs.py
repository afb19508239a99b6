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
  rows are live, k=8 equals k=1, and penalty steps never synchronise the host.

The model is a small random Llama saved in bf16 (head_dim 64: the kit has bf16
kernels for 64 and 128), so the fp32 reference reads exactly the same weights. Every
engine is built by `llm()`, which skips a FlashInfer case through the engine's own
probe (`require_flashinfer`) and captures two buckets, not every power of two. The
cases with a real inductor compile are marked `compile`: profiling/gpu_check runs them
in a stage of their own (`pytest_compile`), after the cheaper ones.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import require_flashinfer

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [1, 7, 16, 17, 40, 100]
ENGINE = dict(max_model_len=256, page_size=16, num_pages=256)
TEACHER_TOL = 0.15  # |logprob difference| allowed between a bf16/fp16 path and the fp32 reference
HEAD_DIM = 64  # bf16_model's: 256 hidden / 4 heads


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = str(tmp_path_factory.mktemp("gpu_models") / "llama_bf16_d64")
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def release_engines():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def prompts(count=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 512, (PROMPT_LENGTHS[i % 6],), generator=g).tolist()}
            for i in range(count)]


def greedy(max_tokens=24, logprobs=None):
    from graphdecode import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def llm(path, **kwargs):
    """An engine on CUDA; FlashInfer cases skip where the engine's probe says it cannot run,
    and only two buckets are captured (the largest and a quarter of it)."""
    from graphdecode import LLM

    if kwargs.get("attention_backend") == "flashinfer":
        require_flashinfer(HEAD_DIM, kwargs.get("dtype") or "bfloat16")  # the checkpoint is bf16
    largest = kwargs.get("max_batch_size", 8)
    kwargs.setdefault("buckets", sorted({max(1, largest // 4), largest}))
    return LLM(path, device="cuda", **{**ENGINE, **kwargs})


def assert_teacher_forced(batch, outs, reference, steps: int) -> None:
    """At every position of each output, its chosen token is a near-argmax of the reference's
    logprobs for the same prefix (teacher-forced), and the shared top-5 logprobs agree."""
    forced = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids[:j]}
              for p, o in zip(batch, outs) for j in range(steps)]
    ref = reference.generate(forced, greedy(max_tokens=1, logprobs=5))
    worst = 0.0
    for i, out in enumerate(outs):
        for j in range(steps):
            chosen = out.outputs[0].token_ids[j]
            got = {t: lp.logprob for t, lp in out.outputs[0].logprobs[j].items()}
            want = {t: lp.logprob for t, lp in ref[i * steps + j].outputs[0].logprobs[0].items()}
            assert chosen in want, f"prompt {i} step {j}: token {chosen} is not in the reference top-5"
            assert want[chosen] >= max(want.values()) - TEACHER_TOL, f"prompt {i} step {j}: not a near-argmax"
            for token in got.keys() & want.keys():
                worst = max(worst, abs(got[token] - want[token]))
    assert worst <= TEACHER_TOL, f"largest logprob difference {worst:.4f}"


@pytest.mark.parametrize("backend, dtype", [("flashinfer", "bfloat16"), ("torch", "float32")])
def test_graph_replay_gives_the_eager_tokens(bf16_model, backend, dtype):
    common = dict(attention_backend=backend, dtype=dtype, compile=False, num_decode_steps=4, max_batch_size=8)
    graphed = llm(bf16_model, cuda_graphs=True, **common)
    got = token_ids(graphed.generate(prompts(), greedy()))
    stats = graphed.stats()
    assert stats["capture_seconds"] > 0 and stats["graph_memory_bytes"] > 0
    assert stats["windows"] > 0
    del graphed
    eager = llm(bf16_model, cuda_graphs=False, **common)
    assert token_ids(eager.generate(prompts(), greedy())) == got
    assert eager.stats()["capture_seconds"] == 0


def test_k8_gives_the_k1_tokens(bf16_model):
    runs = []
    for k in (1, 8):
        engine = llm(bf16_model, attention_backend="flashinfer", compile=False, num_decode_steps=k, max_batch_size=8)
        runs.append(token_ids(engine.generate(prompts(), greedy(max_tokens=30))))
        del engine
    assert runs[0] == runs[1]


@pytest.mark.parametrize("backend, dtype", [("flashinfer", "bfloat16"), ("torch", "float32")])
def test_prefix_cache_hits_give_the_uncached_tokens(bf16_model, backend, dtype):
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
    common = dict(attention_backend=backend, dtype=dtype, compile=False, num_decode_steps=4, max_batch_size=8)
    runs = {}
    for caching in (True, False):
        engine = llm(bf16_model, enable_prefix_caching=caching, **common)
        got = token_ids(engine.generate(groups[0][:5], greedy()))
        got += token_ids(engine.generate(groups[1][:1], greedy()) + engine.generate(groups[1][1:], greedy()))
        runs[caching] = got
        assert engine.stats()["prefix_cache_hits"] == (9 * 37 if caching else 0)
        del engine
    if dtype == "float32":
        assert runs[True] == runs[False]
    else:  # bf16: a different batch computed the cached K/V; near-ties may flip late tokens
        for on, off in zip(runs[True], runs[False]):
            assert on[:8] == off[:8]


def _staggered(engine, params_by_wave):
    """Admit waves of requests while earlier ones decode; returns token ids in admission order."""
    requests = []
    for wave, params in enumerate(params_by_wave):
        for p in prompts(3, seed=wave):
            requests.append(engine.engine.add_request(p, params))
        for _ in range(2):
            engine.engine.step()
    while engine.engine.has_unfinished():
        engine.engine.step()
    return [r.seqs[0].output_token_ids for r in requests], [r.seqs[0].logprobs for r in requests]


def test_lazily_captured_variants_leave_live_rows_untouched(bf16_model):
    from graphdecode import SamplingParams
    from graphdecode.compiled.sampler import SamplerMode

    waves = [
        greedy(max_tokens=40),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=30, ignore_eos=True),  # FILTERED
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, logprobs=3),  # logprobs variant
    ]
    common = dict(attention_backend="flashinfer", compile=False, num_decode_steps=4, max_batch_size=16)
    graphed = llm(bf16_model, cuda_graphs=True, **common)
    captured_before = set(graphed.engine.runner.windows.graphs)
    got_tokens, got_logprobs = _staggered(graphed, waves)
    lazily = set(graphed.engine.runner.windows.graphs) - captured_before
    assert any(v.mode == SamplerMode.FILTERED for _, v in lazily) and any(v.num_logprobs > 0 for _, v in lazily)
    del graphed
    eager = llm(bf16_model, cuda_graphs=False, **common)
    want_tokens, want_logprobs = _staggered(eager, waves)
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs, want_logprobs):
        assert (got is None) == (want is None)
        if got is not None:
            assert [{t: lp.logprob for t, lp in d.items()} for d in got] == \
                   [{t: lp.logprob for t, lp in d.items()} for d in want]


@pytest.fixture(scope="module")
def fp32_reference(bf16_model):
    """The fp32 eager engine (torch attention, no graphs) that teacher-forced cases compare with."""
    return llm(bf16_model, attention_backend="torch", dtype="float32", compile=False, cuda_graphs=False,
               max_batch_size=64, num_pages=1024)


@pytest.mark.parametrize(
    "backend, dtype, compile_",
    [pytest.param("flashinfer", "bfloat16", True, marks=pytest.mark.compile),
     pytest.param("torch", "bfloat16", True, marks=pytest.mark.compile),
     ("flashinfer", "bfloat16", False), ("torch", "float16", False), ("flashinfer", "float16", False)],
)
def test_teacher_forced_logprobs_match_the_fp32_eager_reference(bf16_model, fp32_reference, backend, dtype,
                                                                 compile_):
    steps = 12
    batch = prompts(4)
    graphed = llm(bf16_model, attention_backend=backend, dtype=dtype, compile=compile_, cuda_graphs=True,
                  num_decode_steps=4, max_batch_size=4)
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    del graphed
    assert_teacher_forced(batch, outs, fp32_reference, steps)


def test_steady_state_steps_never_sync_the_host(bf16_model):
    """Replays, staging copies, prefill planning and output copies are all asynchronous:
    with CUDA's sync debug mode set to error, any implicit synchronisation raises."""
    engine = llm(bf16_model, attention_backend="flashinfer", compile=False, num_decode_steps=4, max_batch_size=8)
    engine.generate(prompts(), greedy(max_tokens=8))  # first use of everything
    outs = generate_without_syncing(engine, prompts(seed=1), greedy(max_tokens=24))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)


def generate_without_syncing(engine, batch, params):
    """generate() with CUDA's sync debug mode set to error: any implicit host synchronisation raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return engine.generate(batch, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def tokenized_model(bf16_model, tmp_path_factory) -> str:
    """The bf16 model with the default model's byte-level BPE tokenizer (ids < 512), for bad_words."""
    import shutil

    from graphdecode.default_model import build_tokenizer

    path = str(tmp_path_factory.mktemp("gpu_models") / "llama_bf16_d64_tok")
    shutil.copytree(bf16_model, path, dirs_exist_ok=True)
    build_tokenizer().save_pretrained(path)
    return path


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
def test_penalty_windows_replay_the_eager_tokens(tokenized_model, backend, dtype):
    common = dict(attention_backend=backend, dtype=dtype, compile=False, num_decode_steps=4, max_batch_size=16)
    graphed = llm(tokenized_model, cuda_graphs=True, **common)
    captured_before = set(graphed.engine.runner.windows.graphs)
    got_tokens, got_logprobs = _staggered(graphed, penalty_waves())
    lazily = set(graphed.engine.runner.windows.graphs) - captured_before
    assert any(v.penalties for _, v in lazily) and not any(v.penalties for _, v in captured_before)
    del graphed
    eager = llm(tokenized_model, cuda_graphs=False, **common)
    want_tokens, want_logprobs = _staggered(eager, penalty_waves())
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs, want_logprobs):
        assert (got is None) == (want is None)
        if got is not None:
            assert [{t: lp.logprob for t, lp in d.items()} for d in got] == \
                   [{t: lp.logprob for t, lp in d.items()} for d in want]


def test_penalties_k8_give_the_k1_tokens_in_graphs(tokenized_model):
    runs = []
    for k in (1, 8):
        engine = llm(tokenized_model, attention_backend="flashinfer", compile=False, num_decode_steps=k,
                     max_batch_size=16)
        runs.append(_staggered(engine, penalty_waves())[0])
        del engine
    assert runs[0] == runs[1]


def test_penalty_steps_never_sync_the_host(tokenized_model):
    """Admitting penalized rows (their counts staged sparsely from fresh pinned tensors) and
    replaying penalty graphs stays asynchronous."""
    engine = llm(tokenized_model, attention_backend="flashinfer", compile=False, num_decode_steps=4,
                 max_batch_size=8)
    waves = penalty_waves()
    batch = prompts()
    params = [waves[i % 3] for i in range(len(batch))]
    engine.generate(batch, params)  # captures the penalty variants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = engine.generate(prompts(seed=1), params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]


def test_structured_windows_replay_the_eager_tokens_without_syncing(tokenized_model):
    """Constrained rows mask, sample and advance their automaton inside captured windows: the
    graphs give the eager tokens, a mixed batch keeps its unconstrained rows, and steady-state
    steps never sync the host (the tables were uploaded at admission)."""
    import json

    from graphdecode import SamplingParams
    from graphdecode.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
    constrained = SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    free = SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    batch = prompts()
    params = [constrained if i % 2 else free for i in range(len(batch))]
    common = dict(attention_backend="torch", dtype="float32", compile=False, num_decode_steps=4, max_batch_size=8)
    graphed = llm(tokenized_model, cuda_graphs=True, **common)
    got = [o.outputs[0].token_ids for o in graphed.generate(batch, params)]
    assert any(v.structured for _, v in graphed.engine.runner.windows.graphs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = [o.outputs[0].token_ids for o in graphed.generate(batch, params)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert again == got
    texts = [o.outputs[0].text for o in graphed.generate(batch[1::2], constrained)]
    for text in texts:
        value = json.loads(text)
        assert 0 <= value["a"] <= 99 and value["b"] in ("x", "y")
    del graphed
    eager = llm(tokenized_model, cuda_graphs=False, **common)
    assert [o.outputs[0].token_ids for o in eager.generate(batch, params)] == got


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory) -> str:
    """bf16 Mistral, head_dim 64 (a kit kernel), a 24-token sliding window: prompts pass it."""
    from transformers import AutoModelForCausalLM, MistralConfig

    path = str(tmp_path_factory.mktemp("gpu_models") / "mistral_bf16_swa24")
    config = MistralConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1,
        eos_token_id=2, sliding_window=24,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(99)
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
def test_sliding_window_in_graphs_matches_the_fp32_reference_teacher_forced(windowed_model, backend):
    """The window path in captured graphs (FlashInfer's window_left, or the torch reference where
    the kit has no window kernel: the backend says which) against the fp32 eager reference."""
    steps = 12
    batch = prompts(4)  # 1 to 100 tokens: most pass the 24-token window
    graphed = llm(windowed_model, attention_backend=backend, dtype="bfloat16", compile=False, cuda_graphs=True,
                  num_decode_steps=4, max_batch_size=4)
    assert graphed.engine.runner.model.attention_specs[0].sliding_window == 24
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    del graphed
    reference = llm(windowed_model, attention_backend="torch", dtype="float32", compile=False, cuda_graphs=False,
                    max_batch_size=64, num_pages=1024)
    assert_teacher_forced(batch, outs, reference, steps)


# ------------------------------------------------------------------ mixture of experts in graphs
@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    """bf16 Qwen3-MoE (8 experts, top-3, one dense layer) and gpt-oss (sinks, windows, yarn), head_dim 64."""
    from transformers import AutoModelForCausalLM, GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    configs = {
        "qwen3_moe": Qwen3MoeConfig(**common, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                                    num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1]),
        "gpt_oss": GptOssConfig(**common, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=24, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = str(tmp_path_factory.mktemp("gpu_models") / f"{name}_bf16")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            model = AutoModelForCausalLM.from_config(config)
        model.to(torch.bfloat16).save_pretrained(paths[name])
    return paths


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_in_graphs_replays_eager_matches_fp32_and_never_syncs(moe_models, family):
    """The experts' op inside captured graphs: grouped GEMM in bf16 on sm90/sm100 (dense elsewhere), gpt-oss's
    sinks on FlashInfer (its base-2 LSE checked against the fp32 torch engine here),
    replay equal to eager, teacher-forced against the fp32 eager engine (the dense path), no host
    sync in steady state, and every live token counted once per MoE layer and top-k slot."""
    path = moe_models[family]
    backend = "flashinfer"  # gpt-oss: sinks through the LSE on its full layers, its window layers on the reference
    common = dict(attention_backend=backend, dtype="bfloat16", compile=False, num_decode_steps=4, max_batch_size=4)
    graphed = llm(path, cuda_graphs=True, **common)
    experts = graphed.engine.runner.model.moe_layers[0].experts
    major = torch.cuda.get_device_capability()[0]
    assert experts.implementation == ("grouped" if major in (9, 10) else "dense")
    steps, batch = 12, prompts(4)
    outs = graphed.generate(batch, greedy(max_tokens=steps, logprobs=5))
    counts = graphed.stats()["moe_tokens_per_expert"]
    live = sum(len(p["prompt_token_ids"]) + steps - 1 for p in batch)
    top_k = graphed.config.model_config.moe.top_k
    assert [sum(layer) for layer in counts] == [top_k * live] * len(counts)
    graphed.generate(prompts(seed=1), greedy(max_tokens=8))
    again = generate_without_syncing(graphed, prompts(seed=1), greedy(max_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in again)
    del graphed
    eager = llm(path, cuda_graphs=False, **common)
    assert token_ids(eager.generate(batch, greedy(max_tokens=steps))) == token_ids(outs)
    del eager
    reference = llm(path, attention_backend="torch", dtype="float32", compile=False, cuda_graphs=False,
                    max_batch_size=64, num_pages=1024)
    assert reference.engine.runner.model.moe_layers[0].experts.implementation == "dense"
    assert_teacher_forced(batch, outs, reference, steps)
