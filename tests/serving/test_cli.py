"""The newcomer's main job: `graphdecode generate` on the built-in default model, offline; arguments
checked before any model loads, one-line errors, defaults in --help, readable --stream, bench output."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.cli import main
from graphdecode.config import EngineConfig
from graphdecode.default_model import build_default_model
from tests.helpers import one_line_cli_error


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_model_is_deterministic(tmp_path):
    build_default_model(str(tmp_path / "a"))
    build_default_model(str(tmp_path / "b"))
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(tmp_path / "a" / name) == _digest(tmp_path / "b" / name)


def test_generate_on_the_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    assert main(["generate", "--max-tokens", "5", "--json", "Hello", "The capital of France is"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The capital of France is"]
    assert all(len(line["token_ids"]) == 5 and line["finish_reason"] == "length" for line in lines)
    assert (tmp_path / "default-llama-v2" / "model.safetensors").exists()
    # streaming and n > 1 through the CLI too
    assert main(["generate", "-n", "2", "--temperature", "0.8", "--seed", "1", "--max-tokens", "4", "--stream", "Hi"]) == 0
    out = capsys.readouterr().out
    assert "[finished: length limit reached, 4 tokens]" in out and "completion 1" in out


# ------------------------------------------------------------------ errors, defaults, stream, bench
@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the CLI gets as far as building an LLM."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("LLM() was built before the arguments were checked")

    monkeypatch.setattr(LLM, "__init__", refuse)


SAMPLING_ERRORS = [
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--top-p", "2"], "top_p"),
    (["--top-k", "-5"], "top_k"),
    (["-n", "0"], "n must be"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--stop", ""], "stop"),
]


@pytest.mark.parametrize("args,fragment", SAMPLING_ERRORS)
def test_sampling_errors_are_one_line_before_any_model(no_model_load, capsys, tmp_path, monkeypatch, args, fragment):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    assert fragment in one_line_cli_error(capsys, ["generate", *args, "Hi"], clean=True)
    assert not (tmp_path / "cache").exists()  # not even the default model was built


ENGINE_ERRORS = [
    (["--page-size", "12"], "page_size must be a power of two"),
    (["--max-model-len", "100000"], "max_model_len"),
    (["--dtype", "int8"], "dtype"),
    (["--device", "tpu"], "device"),
    (["--buckets", "4,2"], "buckets"),
    (["--max-batch-size", "5000"], "max_batch_size"),
]


@pytest.mark.parametrize("args,fragment", ENGINE_ERRORS)
def test_engine_errors_are_one_line_before_the_model_loads(no_model_load, capsys, text_model, args, fragment):
    assert fragment in one_line_cli_error(capsys, ["generate", "--model", text_model, *args], clean=True)


def test_missing_or_broken_model_is_one_line(capsys, text_model, tmp_path, no_model_load):
    assert "model must be a HuggingFace model directory" in one_line_cli_error(
        capsys, ["generate", "--model", str(tmp_path / "nope")], clean=True)
    broken = tmp_path / "broken"
    shutil.copytree(text_model, broken)
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert f"{broken / 'config.json'}: not valid JSON" in one_line_cli_error(
        capsys, ["generate", "--model", str(broken)], clean=True)


def test_broken_weights_and_long_prompts_are_one_line(capsys, text_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(text_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    assert f"{weights}: not a readable safetensors file" in one_line_cli_error(
        capsys, ["generate", "--model", str(broken)], clean=True)
    line = one_line_cli_error(capsys, ["generate", "--model", text_model, "--max-model-len", "8", "one two " * 20],
                              clean=True)
    assert "prompts[0]: prompt:" in line and "max_model_len (8)" in line


def test_argparse_errors_exit_2_before_any_model(no_model_load, capsys):
    for argv in (["generate", "--page-size", "0"], ["generate", "-k", "x"], ["generate", "--stream", "--json"],
                 ["bench", "--prompt-len", "nope"], ["generate", "--compile", "maybe"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_bench_arguments_are_checked_before_the_sweep(capsys, monkeypatch):
    from graphdecode.bench import sweep

    def refuse(args):
        raise AssertionError("the sweep started before the arguments were checked")

    monkeypatch.setattr(sweep, "run_bucket_sweep", refuse)
    assert "--buckets" in one_line_cli_error(capsys, ["bench", "--buckets", "1,x"], clean=True)
    assert "--steps" in one_line_cli_error(capsys, ["bench", "--steps", "0"], clean=True)
    assert "--gen-len" in one_line_cli_error(capsys, ["bench", "--gen-len", "0"], clean=True)


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def _field_default(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_help_shows_defaults(capsys, tmp_path, monkeypatch):
    from graphdecode.config import CPU_KV_BUDGET_BYTES, GPU_MEMORY_FRACTION

    text = _help(capsys, "generate")
    for name in ("num_decode_steps", "page_size"):
        assert f"default: EngineConfig's, {_field_default(EngineConfig, name)}" in text
    assert "(default: EngineConfig's: $GRAPHDECODE_CPU_THREADS, else the cores this process may use" in text
    assert f"default: on CUDA {GPU_MEMORY_FRACTION}; on CPU unused" in text
    assert f"on CPU $VLLM_CPU_KVCACHE_SPACE GiB when set, else {CPU_KV_BUDGET_BYTES >> 30} GiB at most" in text
    for name in ("max_tokens", "top_p", "top_k"):
        assert f"default: the model's recommendation (generation_config.json), else SamplingParams', " \
               f"{_field_default(SamplingParams, name)}" in text
    assert f"default: SamplingParams', {_field_default(SamplingParams, 'n')}" in text
    assert "default: 0, greedy" in text and "with -n > 1" in text  # the one departure, and why
    assert "(default: None)" not in text

    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    text = _help(capsys, "bench")
    assert "(default: 1,4,16,64)" in text and "(default: 32)" in text  # --prompt-len had no help string
    squeezed = "".join(text.split())  # argparse may break a long path at a hyphen
    assert f"(default:{tmp_path / 'bench' / 'bench_buckets'})" in squeezed
    assert "(default: None)" not in text


def test_cli_sampling_defaults(capsys, text_model):
    base = ["generate", "--model", text_model, "--json", "--max-tokens", "6", "Hello"]
    runs = []
    for _ in range(2):
        assert main(base) == 0
        runs.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1] and len(runs[0]) == 1  # greedy by default: a first run repeats
    assert len(runs[0][0]["token_ids"]) == 6
    assert main([*base, "-n", "4"]) == 0  # n > 1 without --temperature samples: the completions differ
    texts = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert len(texts) == 4 and len({tuple(t) for t in texts}) > 1
    assert main([*base, "-n", "3", "--temperature", "0"]) == 0  # asked for greedy: identical, as asked
    texts = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert len({tuple(t) for t in texts}) == 1


def test_cli_takes_the_models_recommended_defaults(capsys, text_model, tmp_path):
    """A flag not given takes generation_config.json's recommendation: -n 3 with a recommended temperature of 0
    gives three equal completions of the recommended max_new_tokens; --generation-config vllm ignores the file."""
    model = tmp_path / "model"
    shutil.copytree(text_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    base = ["generate", "--model", str(model), "--json", "-n", "3", "Hello"]
    assert main(base) == 0
    texts = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert len(texts) == 3 and len(texts[0]) == 3 and len({tuple(t) for t in texts}) == 1
    assert main([*base, "--generation-config", "vllm"]) == 0  # SamplingParams' own: 16 tokens, sampled at 1.0
    texts = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert len(texts[0]) == 16 and len({tuple(t) for t in texts}) > 1
    assert main([*base, "--override-generation-config", '{"max_new_tokens": 2}', "--max-tokens", "5"]) == 0
    texts = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert [len(t) for t in texts] == [5] * 3  # a flag given wins over every default
    assert "override_generation_config: 'temp' is not a sampling default" in one_line_cli_error(
        capsys, [*base, "--override-generation-config", '{"temp": 0}'], clean=True)


def test_stream_prints_text_without_empty_chunks(capsys, text_model):
    assert main(["generate", "--model", text_model, "--max-tokens", "9", "--stream", "Hello"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "'Hello' ->"
    assert lines[-1] == "[finished: length limit reached, 9 tokens]"
    assert "".join(lines[1:-1]).strip()  # the text itself, unlabelled

    assert main(["generate", "--model", text_model, "--max-tokens", "9", "-k", "2", "--stream", "-n", "2",
                 "--seed", "3", "Hello", "World"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("streaming 2 prompt(s) x 2 completion(s)")
    assert lines[1:3] == ["  prompt 0: 'Hello'", "  prompt 1: 'World'"]
    body = lines[3:]
    labels = [f"prompt {p}, completion {c}" for p in (0, 1) for c in (0, 1)]
    for line in body:
        label, _, rest = line.partition(": ")
        assert label in labels, line
        assert rest not in ("''", '""', "")  # no empty chunks
    finished = [line for line in body if line.endswith("[finished: length limit reached, 9 tokens]")]
    assert sorted(line.partition(": ")[0] for line in finished) == labels
    assert len(body) > len(finished)  # several text lines per completion (k=2, 9 tokens)


def test_bench_writes_under_the_cache_dir_and_prints_where(capsys, tiny_models, tmp_path, monkeypatch):
    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(cache))
    monkeypatch.chdir(work)
    assert main(["bench", "--model", tiny_models["llama_head_dim"], "--device", "cpu", "--buckets", "2",
                 "--steps", "2", "--prompt-len", "3", "--gen-len", "3", "--no-baseline"]) == 0
    out = capsys.readouterr().out
    expected = os.path.join(str(cache), "bench", "bench_buckets.json")
    assert f"[bench] results written to {expected}" in out
    assert os.path.isfile(expected)
    assert os.listdir(work) == []  # nothing in the current directory, no profiling/


def test_compile_and_thread_options_reach_the_engine(llm_options, text_model):
    """--compile on|off is passed to LLM as compile=True/False, --cpu-threads (alias --threads) as
    cpu_threads; without them EngineConfig decides."""
    seen, Built = llm_options
    for flag in (["--compile", "on"], ["--compile", "off"], [], ["--cpu-threads", "3"], ["--threads", "2"]):
        with pytest.raises(Built):
            main(["generate", "--model", text_model, *flag, "Hi"])
    assert [options.get("compile", "default") for options in seen] == [True, False, "default", "default", "default"]
    assert [options.get("cpu_threads", "default") for options in seen] == ["default"] * 3 + [3, 2]


def test_vllm_flags_that_are_always_on_here_are_accepted():
    """vLLM command lines keep working: flags for what graphdecode always does parse, and change nothing."""
    import argparse

    from graphdecode.server.args import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--enable-auto-tool-choice", "--enable-prompt-tokens-details"])
    assert args.enable_auto_tool_choice and args.enable_prompt_tokens_details
