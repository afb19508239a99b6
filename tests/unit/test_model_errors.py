"""Broken model directories: every defect is a plain ValueError naming the file and, for
weights, the checkpoint's own tensor name (never the fused qkv_proj / gate_up_proj, never a
library's exception), raised before the weights are materialised where the headers tell.
NaN or inf weights are caught at load."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from graphdecode import LLM
from graphdecode.models.loader import load_model
from graphdecode.models.model_config import load_model_config
from tests.helpers import copy_model, edit_tensors, remove_tensor, rewrite_config

GQA = "llama_gqa_llama3"  # hidden 64, 4 heads, 2 KV heads, no head_dim, untied, 2 layers, intermediate 128
QWEN = "qwen2_tied"  # q/k/v biases, tied embeddings
HEAD_DIM = "llama_head_dim"  # explicit head_dim 32


def _expect_error(model_dir: str, *fragments: str, **engine_args) -> str:
    """LLM(model_dir) raises a plain ValueError (not a subclass such as JSONDecodeError)
    whose message contains every fragment; returns the message."""
    with pytest.raises(Exception) as info:
        LLM(model_dir, max_model_len=64, max_batch_size=2, **engine_args)
    assert type(info.value) is ValueError, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    for internal in ("qkv_proj", "gate_up_proj"):
        assert internal not in message
    return message


# ------------------------------------------------------------------------------ config.json
def _truncate(path: str, keep) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(keep(data))


BROKEN_FILES = [
    ("config.json", lambda data: data[: len(data) // 2], "not valid JSON"),
    ("config.json", lambda data: b"", "not valid JSON"),
    ("config.json", lambda data: b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe garbage", "not valid JSON"),
    ("config.json", lambda data: b"[1, 2, 3]", "expected a JSON object"),
    ("generation_config.json", lambda data: data[:10], "not valid JSON"),
]


@pytest.mark.parametrize("filename,damage,fragment", BROKEN_FILES)
def test_unreadable_json_names_the_file(tiny_models, tmp_path, filename, damage, fragment):
    model_dir = copy_model(tiny_models, GQA, tmp_path)
    path = os.path.join(model_dir, filename)
    assert os.path.exists(path)
    _truncate(path, damage)
    _expect_error(model_dir, path, fragment)


def _delete(key):
    return lambda raw: raw.pop(key)


BAD_CONFIG_VALUES = [
    # (model, edit, fragments the message must contain)
    (GQA, dict(hidden_size="sixty-four"), ["hidden_size", "'sixty-four'"]),
    (GQA, dict(hidden_size=True), ["hidden_size"]),
    (GQA, dict(hidden_size=64.5), ["hidden_size"]),
    (GQA, dict(vocab_size=0), ["vocab_size", "0"]),
    (GQA, dict(vocab_size=-512), ["vocab_size"]),
    (GQA, dict(hidden_size=2**63), ["hidden_size", "at most 2147483647"]),  # no wrap, no unbounded tensor
    (GQA, dict(max_position_embeddings=2**32 + 1), ["max_position_embeddings", "at most"]),
    (GQA, dict(num_hidden_layers=0), ["num_hidden_layers"]),
    (GQA, dict(num_attention_heads=-4), ["num_attention_heads"]),
    (GQA, dict(num_key_value_heads=0), ["num_key_value_heads"]),
    (GQA, dict(intermediate_size=None), ["intermediate_size is missing"]),
    (GQA, _delete("vocab_size"), ["vocab_size is missing"]),
    (GQA, dict(num_attention_heads=6, head_dim=None), ["hidden_size (64)", "num_attention_heads (6)",
                                                               "head_dim"]),
    (GQA, dict(num_key_value_heads=3), ["num_attention_heads (4)", "num_key_value_heads (3)"]),
    (HEAD_DIM, dict(head_dim=33), ["head_dim (33)"]),
    (HEAD_DIM, dict(head_dim=0), ["head_dim"]),
    (GQA, dict(max_position_embeddings="1024"), ["max_position_embeddings"]),
    (GQA, dict(rms_norm_eps=float("nan")), ["rms_norm_eps"]),
    (GQA, dict(rms_norm_eps=-1e-6), ["rms_norm_eps"]),
    (HEAD_DIM, dict(rope_theta=-10000.0, rope_parameters=None), ["rope_theta"]),
    (HEAD_DIM, dict(rope_parameters="default"), ["rope_parameters"]),
    (GQA, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, rope_parameters=None),
     ["high_freq_factor"]),
    (GQA, dict(tie_word_embeddings="yes"), ["tie_word_embeddings"]),
    (GQA, dict(dtype=["float32"]), ["dtype"]),
    (GQA, dict(sliding_window=0, model_type="mistral"), ["sliding_window"]),
    ("phi3_longrope", dict(original_max_position_embeddings=1), ["original_max_position_embeddings"]),
]


@pytest.mark.parametrize("model,edit,fragments", BAD_CONFIG_VALUES)
def test_bad_config_value_names_file_and_field(tiny_models, tmp_path, model, edit, fragments):
    model_dir = copy_model(tiny_models, model, tmp_path)
    rewrite_config(model_dir, edit if callable(edit) else lambda raw: raw.update(edit))
    _expect_error(model_dir, os.path.join(model_dir, "config.json"), *fragments)


def test_bad_eos_id_in_generation_config(tiny_models, tmp_path):
    model_dir = copy_model(tiny_models, GQA, tmp_path)
    path = os.path.join(model_dir, "generation_config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["eos_token_id"] = ["two"]
    with open(path, "w") as f:
        json.dump(raw, f)
    _expect_error(model_dir, path, "eos_token_id")


def test_config_checks_keep_real_configs_working(tiny_models):
    """Integral floats are fine; the tiny models and their HF twins still load."""
    for name in (GQA, QWEN, HEAD_DIM):
        cfg = load_model_config(tiny_models[name])
        assert cfg.head_dim in (16, 32) and cfg.num_heads % cfg.num_kv_heads == 0


# ------------------------------------------------------------------------------ safetensors
def _weights(model_dir: str) -> str:
    return os.path.join(model_dir, "model.safetensors")


BROKEN_SAFETENSORS = [
    ("truncated data", lambda data: data[:-100]),
    ("header only", lambda data: data[:20]),
    ("empty", lambda data: b""),
    ("text", lambda data: b"this is not a safetensors file, just some text " * 20),
]


@pytest.mark.parametrize("what,damage", BROKEN_SAFETENSORS, ids=[c[0] for c in BROKEN_SAFETENSORS])
def test_broken_safetensors_file_names_the_file(tiny_models, tmp_path, what, damage):
    model_dir = copy_model(tiny_models, GQA, tmp_path)
    _truncate(_weights(model_dir), damage)
    _expect_error(model_dir, _weights(model_dir), "not a readable safetensors file")


def _reshape(key, shape):
    return lambda t: t.__setitem__(key, torch.zeros(shape))


def _retype(key, dtype):
    return lambda t: t.__setitem__(key, t[key].to(dtype))


def _add(key, shape):
    return lambda t: t.__setitem__(key, torch.zeros(shape))


BAD_TENSORS = [
    # (model, edit, fragments): the checkpoint's own names, never the fused ones
    (GQA, remove_tensor("model.layers.1.self_attn.k_proj.weight"),
     ["'model.layers.1.self_attn.k_proj.weight'", "missing"]),
    (GQA, remove_tensor("model.layers.0.mlp.up_proj.weight"), ["'model.layers.0.mlp.up_proj.weight'", "missing"]),
    (GQA, remove_tensor("model.norm.weight"), ["'model.norm.weight'", "missing"]),
    (GQA, remove_tensor("lm_head.weight"), ["'lm_head.weight'", "missing", "tie_word_embeddings"]),
    (QWEN, remove_tensor("model.layers.1.self_attn.v_proj.bias"),
     ["'model.layers.1.self_attn.v_proj.bias'", "missing"]),
    (GQA, _reshape("model.layers.1.mlp.up_proj.weight", (127, 64)),
     ["'model.layers.1.mlp.up_proj.weight'", "(127, 64)", "expected (128, 64)"]),
    (GQA, _reshape("model.layers.0.mlp.gate_proj.weight", (64, 128)),  # transposed: same size, wrong shape
     ["'model.layers.0.mlp.gate_proj.weight'", "(64, 128)", "expected (128, 64)"]),
    (GQA, _reshape("model.layers.0.self_attn.v_proj.weight", (64, 64)),
     ["'model.layers.0.self_attn.v_proj.weight'", "expected (32, 64)"]),
    (QWEN, _reshape("model.layers.0.self_attn.q_proj.bias", (63,)), ["'model.layers.0.self_attn.q_proj.bias'",
                                                                      "expected (64,)"]),
    (GQA, _reshape("model.layers.1.self_attn.o_proj.weight", (64, 32)), ["'model.layers.1.self_attn.o_proj.weight'"]),
    (GQA, _reshape("model.embed_tokens.weight", (500, 64)), ["'model.embed_tokens.weight'", "expected (512, 64)"]),
    (GQA, _retype("model.norm.weight", torch.int64), ["'model.norm.weight'", "I64", "floating point"]),
    (GQA, _retype("model.layers.0.self_attn.q_proj.weight", torch.int32), ["'model.layers.0.self_attn.q_proj.weight'",
                                                                           "I32"]),
    (GQA, _retype("model.layers.0.input_layernorm.weight", torch.bool), ["input_layernorm", "BOOL"]),
    (GQA, _add("model.layers.2.mlp.up_proj.weight", (128, 64)), ["'model.layers.2.mlp.up_proj.weight'", "no place"]),
    (GQA, _add("model.layers.0.self_attn.q_proj.bias", (64,)), ["'model.layers.0.self_attn.q_proj.bias'", "no place"]),
]


@pytest.mark.parametrize("model,edit,fragments", BAD_TENSORS)
def test_bad_tensor_names_file_and_checkpoint_key_before_allocating(tiny_models, tmp_path, monkeypatch, model, edit,
                                                                    fragments):
    model_dir = copy_model(tiny_models, model, tmp_path)
    edit_tensors(model_dir, edit)

    def no_weights_yet(*args, **kwargs):
        raise AssertionError("the weights were materialised before the checkpoint headers were checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", no_weights_yet)
    _expect_error(model_dir, _weights(model_dir), *fragments)


def test_tensor_is_checked_against_the_untouched_model_too(tiny_models, tmp_path):
    """The same directories load once repaired: the checks reject nothing a good checkpoint has."""
    for name in (GQA, QWEN, HEAD_DIM):
        model_dir = copy_model(tiny_models, name, tmp_path)
        edit_tensors(model_dir, lambda t: None)  # re-saved by safetensors.torch, same tensors
        assert LLM(model_dir, max_model_len=64, max_batch_size=2).generate({"prompt_token_ids": [3, 4]})[0].finished


def _shard(model_dir: str) -> tuple[str, str]:
    """Split model.safetensors into two files with an index; returns their paths."""
    tensors = load_file(_weights(model_dir))
    os.remove(_weights(model_dir))
    keys = sorted(tensors)
    first, second = keys[: len(keys) // 2], keys[len(keys) // 2:]
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for part, name in zip((first, second), names):
        save_file({k: tensors[k] for k in part}, os.path.join(model_dir, name), metadata={"format": "pt"})
    weight_map = {k: names[0] for k in first} | {k: names[1] for k in second}
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return tuple(os.path.join(model_dir, n) for n in names)


def test_sharded_checkpoint_errors(tiny_models, tmp_path):
    model_dir = copy_model(tiny_models, GQA, tmp_path)
    first, second = _shard(model_dir)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    assert LLM(model_dir, max_model_len=64, max_batch_size=2).generate({"prompt_token_ids": [3, 4]})[0].finished

    # a tensor in both shards
    a, b = load_file(first), load_file(second)
    key = sorted(a)[0]
    save_file(b | {key: a[key]}, second, metadata={"format": "pt"})
    _expect_error(model_dir, key, "is also in", first)

    # a tensor in neither: the message names the index, and the checkpoint key
    gone = "model.layers.0.mlp.gate_proj.weight"
    for path, tensors in ((first, a), (second, b)):
        save_file({k: v for k, v in tensors.items() if k != gone}, path, metadata={"format": "pt"})
    _expect_error(model_dir, index, repr(gone), "missing")

    # a truncated shard, an index naming a file that is not there, an index that is not JSON
    save_file(a, first, metadata={"format": "pt"})
    save_file(b, second, metadata={"format": "pt"})
    _truncate(second, lambda data: data[:-10])
    _expect_error(model_dir, second, "not a readable safetensors file")
    os.remove(second)
    _expect_error(model_dir, index, second, "does not exist")
    _truncate(index, lambda data: data[:30])
    _expect_error(model_dir, index, "not valid JSON")


# ------------------------------------------------------------------------------ NaN / inf
NON_FINITE = [
    (GQA, "model.layers.0.mlp.gate_proj.weight", float("nan"), "1 NaN and 0 infinite"),
    (GQA, "model.layers.1.self_attn.k_proj.weight", float("inf"), "0 NaN and 1 infinite"),
    (GQA, "model.embed_tokens.weight", -float("inf"), "0 NaN and 1 infinite"),
    (GQA, "lm_head.weight", float("nan"), "NaN"),
    (QWEN, "model.layers.1.self_attn.v_proj.bias", float("nan"), "NaN"),
    (QWEN, "model.norm.weight", float("nan"), "NaN"),
]


@pytest.mark.parametrize("model,key,value,fragment", NON_FINITE)
def test_non_finite_weights_are_refused_at_load(tiny_models, tmp_path, model, key, value, fragment):
    model_dir = copy_model(tiny_models, model, tmp_path)

    def poison(tensors):
        flat = tensors[key].view(-1)
        flat[flat.numel() // 2] = value

    edit_tensors(model_dir, poison)
    _expect_error(model_dir, _weights(model_dir), repr(key), fragment, "corrupt")


def test_values_that_overflow_the_load_dtype_are_refused(tiny_models, tmp_path):
    """A finite float32 weight beyond float16's range would load as inf: say so, and what to do."""
    model_dir = copy_model(tiny_models, GQA, tmp_path)
    key = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(model_dir, lambda t: t[key].view(-1).__setitem__(7, 1e6))
    cfg = load_model_config(model_dir)
    with pytest.raises(ValueError) as info:
        load_model(model_dir, cfg, torch.float16, torch.device("cpu"), 64)
    message = str(info.value)
    assert repr(key) in message and _weights(model_dir) in message and "float16" in message
    assert "1e+06" in message and "bfloat16" in message
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), 64)  # fine in float32
    gate_up = model.model.layers[1].mlp.gate_up_proj
    weight = gate_up.weight if gate_up.packed is None else gate_up.packed.panels  # CPU panels: the weight's copy
    assert math.isclose(float(weight.detach().max()), 1e6)


def test_a_large_checkpoint_shows_its_loading_progress(text_model, monkeypatch):
    """A checkpoint of PROGRESS_BYTES or more shows a bar on a terminal (a small one, or no terminal: none)."""
    import io

    from graphdecode.models import loader

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    def load():
        err = Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        load_model(text_model, load_model_config(text_model), torch.float32, torch.device("cpu"), 64)
        monkeypatch.undo()
        return err.getvalue()

    assert "loading" not in load()  # a tiny checkpoint
    monkeypatch.setattr(loader, "PROGRESS_BYTES", 1)
    bar = load()
    assert "loading text_model" in bar and "100%" in bar
