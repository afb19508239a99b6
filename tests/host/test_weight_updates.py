"""Weight updates between rollouts (LLM.update_weights / update_weights_from_disk): after an update the engine
gives the new checkpoint's tokens (transformers greedy, token for token; a fresh engine's bits in bf16), in the
captured graphs' CPU twin without a new capture, with the prefix cache forgotten; a partial update changes only
what it names; tied embeddings, fused checkpoints and the oneDNN layout of the variant engine take them; a bad
tensor is an error naming it before anything is written."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from graphdecode import LLM, SamplingParams
from tests.helpers import SMALL_ENGINE, edit_tensors, hf_greedy, random_prompts, token_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts(3, [9, 21, 6], seed=5)


def _trained(model_dir: str, out, seed: int, only: str | None = None) -> str:
    """A copy of the checkpoint as a training step might leave it: every float tensor (or only `only`) moved by
    noise of a third of its spread."""
    path = str(out)
    shutil.copytree(model_dir, path)
    generator = torch.Generator().manual_seed(seed)

    def edit(tensors):
        for key, t in tensors.items():
            if (only is None or key == only) and t.is_floating_point():
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                tensors[key] = (t.float() + noise * max(float(t.float().std()), 0.02) / 3).to(t.dtype)

    edit_tensors(path, edit)
    return path


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(f"{model_dir}/model.safetensors")


def _tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    base = tiny_models["llama_gqa_llama3"]
    return base, _trained(base, tmp_path_factory.mktemp("trained") / "llama", seed=1)


def test_updated_weights_give_the_new_checkpoints_tokens_in_the_captured_graphs(llama):
    """The CPU graph twin (the GPU's captured windows) under bounds checks: the same graphs, new weights."""
    base, trained = llama
    want_base, want_trained = hf_greedy(base, PROMPTS, 10), hf_greedy(trained, PROMPTS, 10)
    assert want_base != want_trained
    with LLM(base, **SMALL_ENGINE, cuda_graphs=True, check_bounds=True) as llm:
        assert _tokens(llm) == want_base
        captured = llm.stats()["graphs_captured"]
        assert captured > 0 and llm.weight_version == "0"
        update = llm.update_weights(_weights(trained).items())
        assert update.updated == len(_weights(trained)) and update.weight_version == "1" == llm.weight_version
        assert llm.engine.pool.num_cached == 0  # the old weights' K/V pages are not found again
        assert _tokens(llm) == want_trained
        back = llm.update_weights_from_disk(base, weight_version="step-0")
        assert back.weight_version == "step-0" == llm.stats()["weight_version"]
        assert _tokens(llm) == want_base
        assert llm.stats()["graphs_captured"] == captured  # no capture again: the writes kept every pointer


def test_a_partial_update_changes_only_the_tensors_it_names(llama, tmp_path):
    base, trained = llama
    key = "model.layers.1.self_attn.k_proj.weight"  # one shard of a fused qkv projection
    one = _trained(base, tmp_path / "one", seed=1, only=key)
    with LLM(base, **SMALL_ENGINE) as llm:
        llm.update_weights({key: torch.nn.Parameter(_weights(one)[key])})  # a trainer's, requiring grad
        assert _tokens(llm) == hf_greedy(one, PROMPTS, 10) != hf_greedy(base, PROMPTS, 10)


@pytest.mark.parametrize("model", ["qwen2_tied", "phi3_partial_swa", "mixtral", "qwen3_moe", "gpt_oss", "qwen3_5",
                                   "nemotron_h"])
def test_tied_embeddings_fused_checkpoints_and_experts_take_new_weights(model, tiny_models, tmp_path):
    """Qwen2's tied head (the embedding's lookups read the head's panels), Phi-3's fused qkv_proj / gate_up_proj,
    MoE experts per expert (Mixtral's w1/w3/w2, Qwen3-MoE's) or in gpt-oss's interleaved float layout, with
    its sinks and biases, and the hybrids' recurrent layers (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2); a tied
    checkpoint's lm_head.weight is skipped, as at load."""
    base = tiny_models[model]
    trained = _trained(base, tmp_path / model, seed=2)
    weights = _weights(trained)
    if model == "qwen2_tied":
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    with LLM(base, **SMALL_ENGINE) as llm:
        update = llm.update_weights(weights)
        assert _tokens(llm) == hf_greedy(trained, PROMPTS, 10) != hf_greedy(base, PROMPTS, 10)
    assert update.skipped == (("lm_head.weight",) if model == "qwen2_tied" else ())


@pytest.fixture
def onednn_only(monkeypatch):
    """The variant engine's projections held only in oneDNN's blocked layout (a model that streams its weights,
    without the CPU kernels), for a tiny model."""
    from graphdecode.kernels import cpu
    from graphdecode.models import cpu_linear

    monkeypatch.setattr(cpu, "cpu_kernels", lambda: None)  # as GRAPHDECODE_CPU_KERNELS=0 makes it
    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)


@pytest.mark.parametrize("layout", ["bf16 panels", "oneDNN only"])
def test_updates_give_a_fresh_engines_bits(llama, layout, request):
    """bf16 on the panels (pairs where the CPU has avx512_bf16), or the variant engine's oneDNN blocked weights
    laid out again from the new rows: logprobs equal to the bit those of an engine loaded from the new checkpoint."""
    from graphdecode.models.cpu_linear import PackedWeight, PanelWeight

    base, trained = llama
    if layout == "bf16 panels":
        options, kind = dict(SMALL_ENGINE, dtype="bfloat16"), PanelWeight
    else:
        request.getfixturevalue("onednn_only")
        options, kind = dict(SMALL_ENGINE, dtype="float32", batch_invariant=False), PackedWeight
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run(llm):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(token_prompts(PROMPTS), params, use_tqdm=False)]

    with LLM(trained, **options) as fresh:
        want = run(fresh)
    with LLM(base, **options) as llm:
        model = llm.engine.runner.model
        assert type(model.model.layers[0].self_attn.qkv_proj.packed) is kind and type(model.packed_head) is kind
        before = run(llm)
        if kind is PackedWeight:  # laid out again whole: a part of a fused projection is refused, naming it
            key = "model.layers.0.self_attn.q_proj.weight"
            with pytest.raises(ValueError, match="q_proj.*send every tensor it fuses"):
                llm.update_weights({key: _weights(trained)[key]})
        llm.update_weights(_weights(trained))
        assert run(llm) == want != before


def test_bad_tensors_are_named_before_anything_is_written(llama):
    base, trained = llama
    new = _weights(trained)
    with LLM(base, **SMALL_ENGINE) as llm:
        want = _tokens(llm)
        q = "model.layers.0.self_attn.q_proj.weight"
        cases = [
            ({"model.layers.9.mlp.up_proj.weight": new[q]}, ValueError, "'model.layers.9.mlp.up_proj.weight' has no place"),
            ({q: new[q][:-1]}, ValueError, f"'{q}' has shape"),
            ({q: new[q].to(torch.int32)}, ValueError, f"'{q}' has dtype"),
            ({q: torch.full_like(new[q], float("nan"))}, ValueError, f"'{q}' holds NaN"),
            ([(q, new[q]), (q, new[q])], ValueError, "fills the same rows"),
            ([(q, new[q].tolist())], TypeError, "must be a torch.Tensor"),
            ([q], TypeError, r"\(name, tensor\) pair"),
        ]
        for weights, error, match in cases:
            # every good tensor listed first: none of them may be written when a later one is refused
            with pytest.raises(error, match=match):
                llm.update_weights([*[(k, v) for k, v in new.items() if k != q], *(
                    weights.items() if isinstance(weights, dict) else weights)])
        with pytest.raises(TypeError, match="weight_version"):
            llm.update_weights({}, weight_version=3)
        with pytest.raises(ValueError, match="model_path"):
            llm.update_weights_from_disk(str(base) + "-missing")
        assert _tokens(llm) == want and llm.weight_version == "0"


def test_an_open_stream_stops_an_update_and_refused_engines_say_why(llama, tiny_models, tmp_path):
    base, trained = llama
    with LLM(base, **SMALL_ENGINE) as llm:
        stream = llm.stream(token_prompts(PROMPTS[:1]), GREEDY)
        next(iter(stream))
        with pytest.raises(RuntimeError, match="unfinished"):
            llm.update_weights(_weights(trained))
        list(stream)
        llm.update_weights(_weights(trained))
        assert _tokens(llm) == hf_greedy(trained, PROMPTS, 10)
    with LLM(tiny_models["llama_gqa_llama3"], **SMALL_ENGINE, enable_lora=True, max_loras=1, max_lora_rank=8) as lora:
        with pytest.raises(ValueError, match="LoRA engine.*merge"):
            lora.update_weights(_weights(trained))
    from graphdecode.models.quant.rtn import quantize_checkpoint

    quantized = quantize_checkpoint(base, str(tmp_path / "int8"), "int-quantized", bits=8, group=None)
    with LLM(quantized, **SMALL_ENGINE) as llm:
        with pytest.raises(ValueError, match="is quantized; updating quantized weights is not supported"):
            llm.update_weights({})
    with LLM(tiny_models["qwen3_next"], **SMALL_ENGINE) as grouped:
        with pytest.raises(ValueError, match=r"GatedDeltaNet \(model.layers.0.linear_attn\) derives"):
            grouped.update_weights({})


@pytest.mark.parametrize("model, split", [("llama_gqa_llama3", dict(tensor_parallel_size=2)),
                                          ("llama_gqa_llama3", dict(pipeline_parallel_size=2)),
                                          ("qwen3_moe", dict(tensor_parallel_size=2))])
def test_every_rank_writes_its_part(model, split, llama, tiny_models, tmp_path):
    """Tensor parallelism (each rank its rows of q/k/v, gate/up, every expert's and the vocabulary, its columns of
    o/down) and pipeline stages (each its own layers; nothing is skipped by every stage); rank 0 refuses a bad
    tensor before any rank writes."""
    base, trained = llama if model == "llama_gqa_llama3" else (
        tiny_models[model], _trained(tiny_models[model], tmp_path / model, seed=6))
    want = {}
    for path in (base, trained):  # transformers', or one rank's where they stop at an EOS (the MoE's do)
        if model == "llama_gqa_llama3":
            want[path] = hf_greedy(path, PROMPTS, 10)
            continue
        with LLM(path, **SMALL_ENGINE) as one:
            want[path] = _tokens(one)
    with LLM(base, **SMALL_ENGINE, **split) as llm:
        q = "model.layers.1.self_attn.q_proj.weight"
        with pytest.raises(ValueError, match="has shape"):
            llm.update_weights([*_weights(trained).items(), (q, torch.zeros(3, 3))])
        assert _tokens(llm) == want[base]
        update = llm.update_weights(_weights(trained))
        assert update.updated == len(_weights(trained)) and update.skipped == ()
        assert _tokens(llm) == want[trained] != want[base]
