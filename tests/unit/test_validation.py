"""Bad input raises ValueError naming the field, before any work, and never harms other requests."""

from __future__ import annotations

import shutil

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import first_tokens, random_prompts, rewrite_config, token_prompts

BAD_PARAMS = [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(n=0), "n"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=10, max_tokens=5), "min_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(output_kind="sometimes"), "output_kind"),
    # what the device holds: int32 counts and lengths, float32 numbers
    (dict(n=2**31), "n"),
    (dict(top_k=2**31), "top_k"),
    (dict(top_k=10**30), "top_k"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(min_tokens=2**31, max_tokens=None), "min_tokens"),
    (dict(logprobs=2**31), "logprobs"),
    (dict(prompt_logprobs=2**63), "prompt_logprobs"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=1e-46), "top_p"),
    (dict(repetition_penalty=1e-46), "repetition_penalty"),
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(stop_token_ids=[1, 2.0]), "stop_token_ids"),  # a list holding a non-integer: vLLM's ValueError
    (dict(allowed_token_ids=[3, "4"]), "allowed_token_ids"),
]

WRONG_TYPES = [
    (dict(seed=1.5), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop=123), "stop"),
    (dict(stop=["a", 1]), "stop"),
    (dict(stop_token_ids="x"), "stop_token_ids"),
    (dict(bad_words={"a", "b"}), "bad_words"),
    (dict(bad_words="word"), "bad_words"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(allowed_token_ids={3, 4}), "allowed_token_ids"),
    (dict(temperature="0.5"), "temperature"),
    (dict(max_tokens=10.0), "max_tokens"),
    (dict(n=True), "n"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(output_kind=3), "output_kind"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert type(info.value) is ValueError


def test_the_device_limits_themselves_are_accepted():
    top = 2**31 - 1
    params = SamplingParams(n=top, top_k=top, max_tokens=top, min_tokens=top, logprobs=top, prompt_logprobs=top,
                            temperature=3.4e38, top_p=1e-45, repetition_penalty=1e-45, seed=-(10**30))
    assert params.top_k == top and params.temperature == 3.4e38
    assert SamplingParams(repetition_penalty=3.4e38, top_k=-1, logprobs=-1).top_k == -1


@pytest.mark.parametrize("kwargs,field", WRONG_TYPES)
def test_wrong_types_are_type_errors_naming_the_field(kwargs, field):
    with pytest.raises(TypeError, match=f"^{field}") as info:
        SamplingParams(**kwargs)
    assert type(info.value) is TypeError


def test_checks_hold_under_python_O():
    """The checks are plain raises, not asserts: `python -O` keeps them."""
    import subprocess
    import sys

    code = ("from graphdecode import SamplingParams\n"
            "for kw in ({'temperature': float('inf')}, {'stop': 123}):\n"
            "    try:\n        SamplingParams(**kw)\n    except (TypeError, ValueError) as e:\n"
            "        print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["ValueError", "TypeError"], out.stderr


def test_sampling_params_are_mutable_and_checked_again_at_submission(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    params.max_tokens = 7  # takes effect, like vLLM's
    params.seed = 100
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    params.top_p = 2.0  # set after construction: caught when the request is submitted, by name
    with pytest.raises(ValueError, match=r"prompts\[0\]: top_p must be in \(0, 1\]"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    params.top_p = 1.0
    params.stop = 5
    with pytest.raises(TypeError, match=r"prompts\[0\]: stop must be a string"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, params)
    with pytest.raises(AttributeError):
        params.max_token = 3  # a misspelt field is an error, not a silent new attribute


def test_params_changed_after_submission_do_not_reach_the_request(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=5)
    request = engine.add_request({"prompt_token_ids": [5, 6, 7]}, params)
    params.max_tokens = 1  # the engine holds its own copy
    while engine.has_unfinished():
        engine.step()
    assert request.seqs[0].num_output_tokens == 5


def test_max_tokens_beyond_the_context_stops_at_max_model_len_like_vllms_engine(llm):
    """vLLM's offline API (its test_max_model_len): max_tokens past the context is accepted and the request
    ends with "length" at max_model_len; a prompt that leaves no room is still refused (the server refuses
    the former too: tests/serving)."""
    for max_tokens in (200, 125):
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 125 and out[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt: 128 tokens leave no room to generate"):
        llm.generate({"prompt_token_ids": [5] * 128}, SamplingParams(max_tokens=1))


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["llama_gqa_llama3"], num_decode_steps=4, max_model_len=128, max_batch_size=8)


BAD_REQUESTS = [
    # (prompt, params, exception, pattern): the bad prompt is prompts[1], after a good one
    ({"prompt_token_ids": []}, SamplingParams(), ValueError, r"prompts\[1\]: prompt_token_ids is empty"),
    ({"prompt_token_ids": list(range(3, 131))}, SamplingParams(), ValueError,  # 128 tokens >= max_model_len
     r"prompts\[1\]: prompt: 128 tokens"),
    ({"prompt_token_ids": [5, 512]}, SamplingParams(), ValueError,  # outside the vocabulary
     r"prompts\[1\]: prompt_token_ids\[1\] = 512 is outside the vocabulary"),
    ({"prompt_token_ids": [5, -1]}, SamplingParams(), ValueError, r"prompts\[1\]: prompt_token_ids\[1\] = -1"),
    ({"prompt_token_ids": [5, "x"]}, SamplingParams(), TypeError,
     r"prompts\[1\]\['prompt_token_ids'\]\[1\] must be an int, got str"),
    ({"prompt_token_ids": [True, 5]}, SamplingParams(), TypeError,
     r"prompt_token_ids'\]\[0\] must be an int, got bool"),
    ({"prompt_token_ids": [5, 6.0]}, SamplingParams(), TypeError,
     r"prompt_token_ids'\]\[1\] must be an int, got float"),
    ({"prompt_token_ids": "5 6"}, SamplingParams(), TypeError, r"prompts\[1\]\['prompt_token_ids'\] must be a list"),
    ({"prompt_token_ids": [5, 6], "prompt": 7}, SamplingParams(), TypeError, r"prompts\[1\]\['prompt'\] must be a str"),
    ({}, SamplingParams(), ValueError, r"prompts\[1\]: a prompt dict needs 'prompt'.*or 'prompt_token_ids'"),
    ({"prompt_ids": [5, 6]}, SamplingParams(), ValueError, r"prompts\[1\]: unknown key 'prompt_ids'"),
    ("a text prompt", SamplingParams(), ValueError, r"prompts\[1\]: a text prompt needs a tokenizer"),
    (42, SamplingParams(), TypeError, r"prompts\[1\] must be a str or a dict.*got int; token ids go in a dict"),
    ([5, 6], SamplingParams(), TypeError, r"prompts\[1\] must be a str or a dict.*got list"),
    (None, SamplingParams(), TypeError, r"prompts\[1\] must be a str or a dict.*got NoneType"),
    # one SamplingParams for both prompts: the first prompt is the one named
    ({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=[600]), ValueError, r"prompts\[0\]: stop_token_ids"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(stop_token_ids=list(range(3, 40))), ValueError, "stop_token_ids"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(logprobs=21), ValueError, r"prompts\[0\]: logprobs"),
    ({"prompt_token_ids": [5, 6]}, SamplingParams(n=9), ValueError, r"prompts\[0\]: n: 9"),  # more than max_batch_size
    ({"prompt_token_ids": [5, 6]}, [SamplingParams(), SamplingParams(logprobs=21)], ValueError,
     r"prompts\[1\]: logprobs"),
    ({"prompt_token_ids": [5, 6]}, "not params", TypeError, "sampling_params must be a SamplingParams"),
    ({"prompt_token_ids": [5, 6]}, {"temperature": 0}, TypeError, r"sampling_params must be .*SamplingParams\(\*\*"),
    ({"prompt_token_ids": [5, 6]}, [SamplingParams(), 0.5], TypeError,
     r"sampling_params\[1\] must be a SamplingParams"),
]


@pytest.mark.parametrize("prompt,params,error,pattern", BAD_REQUESTS)
def test_bad_request_raises_and_other_requests_keep_running(llm, prompt, params, error, pattern):
    good_prompts = token_prompts(random_prompts(3, [5, 30, 70], seed=21))
    greedy = SamplingParams(temperature=0, max_tokens=20)
    expected = first_tokens(llm.generate(good_prompts, greedy))

    engine = llm.engine
    running = [engine.add_request(p, greedy) for p in good_prompts]
    engine.step()
    engine.step()
    before = dict(engine.requests)
    waiting_before = len(engine.scheduler.waiting)
    with pytest.raises(error, match=pattern) as info:
        llm.generate([good_prompts[0], prompt], params)  # a bad one in a list adds nothing at all
    assert type(info.value) is error and "\n" not in str(info.value)
    assert engine.requests == before
    assert len(engine.scheduler.waiting) == waiting_before
    while engine.has_unfinished():
        engine.step()
    assert [r.seqs[0].output_token_ids for r in running] == expected


@pytest.mark.parametrize("prompts", [42, None, b"bytes", 3.5])
def test_prompts_of_the_wrong_type(llm, prompts):
    with pytest.raises(TypeError, match="prompts must be a str, a dict with 'prompt' or 'prompt_token_ids', or a list"):
        llm.generate(prompts)


def test_numpy_token_ids_are_accepted(llm):
    import numpy as np

    ids = np.array([5, 6, 7])
    greedy = SamplingParams(temperature=0, max_tokens=3)
    as_numpy = llm.generate({"prompt_token_ids": list(ids)}, greedy)[0]
    as_ints = llm.generate({"prompt_token_ids": ids.tolist()}, greedy)[0]
    assert as_numpy.outputs[0].token_ids == as_ints.outputs[0].token_ids
    assert as_numpy.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in as_numpy.prompt_token_ids)


def test_lone_surrogate_in_a_text_prompt(text_model):
    llm = LLM(text_model, max_model_len=64, max_batch_size=2)
    with pytest.raises(ValueError, match=r"prompts\[1\]: the text is not valid Unicode: lone surrogate '\\ud800'"):
        llm.generate(["fine", "abc\ud800"])
    with pytest.raises(ValueError, match=r"prompts\[0\]: .*Unicode"):
        llm.generate({"prompt": "\udfff"})
    assert llm.generate("fine", SamplingParams(max_tokens=2))[0].finished  # nothing was left behind


def test_unknown_llm_argument_is_a_type_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(TypeError) as info:
        LLM(max_model_length=64)
    message = str(info.value)
    assert message.startswith("LLM() got an unexpected keyword argument 'max_model_length'")
    assert "did you mean 'max_model_len'?" in message and "EngineConfig" in message
    assert "num_decode_steps" in message  # the valid ones are listed
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'frobnicate' \(engine"):
        LLM(frobnicate=True)
    assert not (tmp_path / "cache").exists()  # refused before the default model was built


def test_sampling_params_list_length_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": [4]}] * 2, [SamplingParams()] * 3)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=2), request_id="dup")
    while engine.has_unfinished():
        engine.step()


def test_unknown_model_type(tiny_models, tmp_path):
    dst = tmp_path / "unknown"
    shutil.copytree(tiny_models["llama_head_dim"], dst)
    rewrite_config(str(dst), lambda raw: raw.update(model_type="gpt_bigcode"))
    with pytest.raises(ValueError, match="model_type.*gpt_bigcode"):
        LLM(str(dst))


def test_unsupported_rope_and_a_sliding_window_that_now_loads(tiny_models, tmp_path):
    dst = tmp_path / "dynamic"
    shutil.copytree(tiny_models["llama_head_dim"], dst)
    rewrite_config(str(dst), lambda raw: raw.update(
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}))
    with pytest.raises(ValueError, match="rope_type"):
        LLM(str(dst))
    dst = tmp_path / "yarn"  # supported since gpt-oss (issue 23); tests/host/test_moe.py checks its tables
    shutil.copytree(tiny_models["llama_head_dim"], dst)
    rewrite_config(str(dst), lambda raw: raw.update(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    rope = LLM(str(dst), max_model_len=64).config.model_config.rope
    assert rope.rope_type == "yarn" and rope.original_max_position_embeddings == 1024
    dst = tmp_path / "swa"
    shutil.copytree(tiny_models["llama_head_dim"], dst)
    rewrite_config(str(dst), lambda raw: raw.update(model_type="mistral", sliding_window=64))
    # a window shorter than the context is run (tests/host/test_model_families.py checks its tokens)
    llm = LLM(str(dst), max_model_len=128)
    assert llm.engine.runner.model.attention_specs[0].sliding_window == 64
    assert llm.generate([{"prompt_token_ids": [3, 4]}])[0].finished


BAD_CONFIG = [
    (dict(page_size=12), "page_size"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(num_decode_steps=0), "num_decode_steps"),
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(attention_backend="magic"), "attention_backend"),
    (dict(attention_backend="flashinfer", device="cpu"), "attention_backend"),
    (dict(cuda_graphs="yes"), "cuda_graphs"),
    (dict(check_bounds="on"), "check_bounds"),
    (dict(num_pages=3, max_model_len=256), "num_pages"),
    (dict(max_model_len=100_000), "max_model_len"),
    (dict(cpu_threads=0), "cpu_threads"),
    (dict(cpu_threads=1.5), "cpu_threads"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes=4096, max_model_len=256), "kv_cache_memory_bytes"),
    (dict(gpu_memory_utilization=1.01), "gpu_memory_utilization"),
    (dict(num_pages=64, gpu_memory_utilization=0.5), "num_pages and gpu_memory_utilization"),
]


@pytest.mark.parametrize("kwargs,field", BAD_CONFIG)
def test_engine_config_names_the_field(tiny_models, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_models["llama_head_dim"], **kwargs)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "nope"))


def test_cpu_threads_is_one_engine_argument_and_stats_say_it(tiny_models):
    """The engine sets its own torch threads from EngineConfig.cpu_threads (here 1: the suite sets
    GRAPHDECODE_CPU_THREADS=1, which the default reads before the usable cores), and stats() reports
    what is in effect."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # whatever the process had: the default engine still takes one
        llm = LLM(tiny_models["llama_head_dim"], max_model_len=64, max_batch_size=2)
        assert llm.config.cpu_threads == 1 and llm.stats()["cpu_threads"] == 1 == torch.get_num_threads()
        llm = LLM(tiny_models["llama_head_dim"], max_model_len=64, max_batch_size=2, cpu_threads=2)
        assert llm.stats()["cpu_threads"] == 2
    finally:
        torch.set_num_threads(before)
