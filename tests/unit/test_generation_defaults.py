"""The model's recommended sampling defaults (generation_config.json, vLLM's generation_config="auto"): which
fields are read, how "vllm", a directory and override_generation_config change them, and every bad value a
ValueError naming its file and field before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest

from graphdecode.config import EngineConfig
from graphdecode.generation_defaults import capped_max_tokens, sampling_defaults

QWEN3_LIKE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 512, "pad_token_id": 0}


def _model(text_model, tmp_path, generation: dict | None):
    path = tmp_path / "model"
    shutil.copytree(text_model, path)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def test_the_recommended_fields_and_nothing_else(text_model, tmp_path):
    model = _model(text_model, tmp_path, QWEN3_LIKE)
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 512}
    assert sampling_defaults(model) == expected
    assert EngineConfig(model=model).sampling_defaults == expected
    assert sampling_defaults(model, "vllm") == {}
    # a file with no sampling fields (what save_pretrained writes) recommends nothing
    assert sampling_defaults(_model(text_model, tmp_path / "plain", {"eos_token_id": 2})) == {}


def test_a_directory_and_overrides(text_model, tmp_path):
    model = _model(text_model, tmp_path, QWEN3_LIKE)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    assert sampling_defaults(model, str(other)) == {"temperature": 0.2}
    # laid over the file; a null removes that field's default; over "vllm" it is all there is
    over = {"temperature": 0.0, "max_new_tokens": 8, "top_k": None}
    assert sampling_defaults(model, "auto", over) == {"temperature": 0.0, "top_p": 0.95, "min_p": 0.05,
                                                       "repetition_penalty": 1.1, "max_tokens": 8}
    assert sampling_defaults(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}
    config = EngineConfig(model=model, generation_config="vllm", override_generation_config={"min_p": 0.2})
    assert config.sampling_defaults == {"min_p": 0.2}


@pytest.mark.parametrize("generation, fragment", [
    ({"temperature": -0.5}, "generation_config.json: temperature must be a number >= 0"),
    ({"top_p": 1.5}, "generation_config.json: top_p"),
    ({"top_k": 2.5}, "generation_config.json: top_k"),
    ({"max_new_tokens": 0}, "generation_config.json: max_new_tokens must be an integer >= 1"),
    ({"repetition_penalty": "high"}, "generation_config.json: repetition_penalty"),
])
def test_a_bad_recommendation_names_the_file_and_field(text_model, tmp_path, generation, fragment):
    model = _model(text_model, tmp_path, generation)
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")) as info:
        EngineConfig(model=model)
    assert model in str(info.value)
    EngineConfig(model=model, generation_config="vllm")  # the file's values are not read at all then


@pytest.mark.parametrize("options, fragment", [
    (dict(override_generation_config={"temprature": 0.5}), "override_generation_config: 'temprature' is not"),
    (dict(override_generation_config={"min_p": 2}), "override_generation_config: min_p"),
    (dict(override_generation_config=[("top_p", 0.5)]), "override_generation_config must be a dict"),
    (dict(generation_config="greedy"), "generation_config: 'greedy' is not a directory"),
    (dict(generation_config=3), "generation_config must be 'auto', 'vllm' or a directory"),
])
def test_bad_options_name_the_field(text_model, options, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineConfig(model=text_model, **options)


def test_the_recommended_max_tokens_caps_a_servers_request():
    assert capped_max_tokens({}, 100) == 100 and capped_max_tokens({}, None) is None
    assert capped_max_tokens({"max_tokens": 8}, 100) == 8
    assert capped_max_tokens({"max_tokens": 8}, 3) == 3
    assert capped_max_tokens({"max_tokens": 8}, None) == 8
