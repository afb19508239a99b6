"""Smoke tests for the benchmarks: tiny configurations, well-formed JSON, never timings."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from graphdecode.bench.common import script_module
from graphdecode.bench.presets import build_preset, ensure_preset, llama_tensor_shapes, preset_config
from graphdecode.models.model_config import parse_model_config
from tests.helpers import REPO


def _script(name: str):
    return script_module(os.path.join(REPO, "profiling", f"{name}.py"))


def _load(prefix) -> dict:
    with open(f"{prefix}.json") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def micro_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("presets") / "micro")
    build_preset("micro", path)
    return path


def test_llama_1b_preset_config_matches_llama_3_2_1b():
    raw = preset_config("llama-3.2-1b")
    cfg = parse_model_config(raw)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2048, 16, 32, 8, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (8192, 128256, True)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 32.0
    shapes = llama_tensor_shapes(raw)
    params = sum(math.prod(shape) for shape in shapes.values())
    assert 1.2e9 < params < 1.3e9  # Llama-3.2-1B has 1.24B parameters
    assert "lm_head.weight" not in shapes


def test_micro_preset_is_cached_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path))
    path = ensure_preset("micro")
    assert path.startswith(str(tmp_path))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(path))
    assert ensure_preset("micro") == path  # second call reuses it
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_bucket_sweep_smoke(micro_dir, tmp_path):
    from graphdecode.bench.sweep import main

    out = tmp_path / "sweep"
    main(["--model", micro_dir, "--device", "cpu", "--buckets", "1,2", "--steps", "1,2",
          "--prompt-len", "4", "--gen-len", "5", "--out", str(out)])
    result = _load(out)
    assert [(p["k"], p["batch"]) for p in result["points"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert result["engine_config"]["buckets"] == [1, 2]
    for p in result["points"]:
        assert p["generated_tokens"] == p["batch"] * 5 and p["prefill_tokens"] == p["batch"] * 4
        assert p["tokens_per_s"] > 0 and p["ms_per_decode_step"] > 0 and 0 <= p["padding_waste"] < 1
        assert set(p["host_ms_per_window"]) == {"schedule", "launch", "pythonize", "blocked"}
        assert p["bandwidth_fraction"] is not None and p["step_bytes"] > 0
    assert [b["batch"] for b in result["baseline"]] == [1, 2]
    assert all(0 <= b["rows_matching_engine"] <= b["batch"] for b in result["baseline"])
    assert len(result["speedups"]) == 4 and all(s["speedup"] > 0 for s in result["speedups"])
    assert result["machine"]["date"] and result["model_sizes"]["weight_bytes"] > 0
    assert os.path.getsize(f"{out}.png") > 0


def test_bucket_sweep_interleaves_the_baseline_and_survives_its_failure(micro_dir, tmp_path, monkeypatch):
    """transformers' repeats of a batch run between the engine's (the same minutes of a drifting machine);
    a baseline that fails is recorded and the engine's points stay."""
    from graphdecode.bench import sweep as bench

    events = []
    timed, generate = bench._timed_generate, bench.Baseline._generate
    monkeypatch.setattr(bench, "_timed_generate", lambda llm, prompts, *a: events.append(("engine", len(prompts)))
                        or timed(llm, prompts, *a))
    monkeypatch.setattr(bench.Baseline, "_generate", lambda self, ids, n: events.append(("hf", ids.shape[0]))
                        or generate(self, ids, n))
    out = tmp_path / "sweep"
    bench.main(["--model", micro_dir, "--device", "cpu", "--buckets", "1,2", "--steps", "1", "--prompt-len", "4",
                "--gen-len", "5", "--repeats", "2", "--out", str(out)])
    want = []
    for b in (1, 2):  # per repeat: the engine's prefill-only and full runs, then transformers' (a warm-up first)
        want += [("engine", b)] * 2 + [("hf", b)] * 3 + [("engine", b)] * 2 + [("hf", b)] * 2
    assert events == want
    assert [b["batch"] for b in _load(out)["baseline"]] == [1, 2]

    monkeypatch.setattr(bench.Baseline, "_load", lambda self: (_ for _ in ()).throw(OSError("no weights")))
    bench.main(["--model", micro_dir, "--device", "cpu", "--buckets", "1", "--steps", "1", "--prompt-len", "4",
                "--gen-len", "5", "--out", str(out)])
    result = _load(out)
    assert result["baseline"] == [] and "no weights" in result["baseline_skipped"]
    assert len(result["points"]) == 1 and result["speedups"][0]["speedup"] is None


def test_cli_bench_without_baseline(micro_dir, tmp_path):
    from graphdecode.cli import main

    out = tmp_path / "cli"
    assert main(["bench", "--model", micro_dir, "--buckets", "3", "--steps", "2", "--prompt-len", "3",
                 "--gen-len", "4", "--no-baseline", "--out", str(out)]) == 0
    result = _load(out)
    (point,) = result["points"]
    assert point["bucket"] == 3 and result["baseline"] == [] and result["speedups"][0]["speedup"] is None
    assert result["engine_config"]["buckets"] == [3]  # only the asked-for bucket was built


def test_scale_smoke(micro_dir, tmp_path):
    out = tmp_path / "scale"
    result = _script("bench_scale").main(["--model", micro_dir, "--num-prompts", "20,40", "--warmup", "0",
                                          "--max-batch-size", "8", "--out", str(out)])
    assert _load(out)["ratios"] == result["ratios"] and list(result["ratios"]) == ["40/20"]
    for p, count in zip(result["points"], (20, 40)):
        assert p["num_prompts"] == count and p["requests_per_s"] > 0
        assert p["mean_prompt_tokens"] == 16 and p["mean_output_tokens"] == 16  # text prompts: exactly 16 tokens
        assert p["steps"]["num_steps"] > 0 and p["setup_s"] >= 0 and p["collect_s"] >= 0


def test_parallel_sampling_smoke(micro_dir, tmp_path):
    out = tmp_path / "n"
    result = _script("bench_n").main(["--model", micro_dir, "--n", "1,3", "--max-tokens", "1,3",
                                      "--prompt-len", "40", "--repeats", "1", "--out", str(out)])
    assert len(_load(out)["points"]) == 8
    for p in result["points"]:
        assert p["completions"] == p["n"] and p["generated_tokens"] == p["n"] * p["max_tokens"]
        assert p["prefill_tokens"] == (40 if p["mode"] == "n" else 40 * p["n"])  # n>1 prefills once
    assert set(result["ratios"]) == {f"{m}: max_tokens={t} n=3/n=1" for m in ("n", "copies") for t in (1, 3)}


def test_host_overhead_smoke(micro_dir, tmp_path):
    out = tmp_path / "host"
    result = _script("bench_host").main(["--model", micro_dir, "--batches", "1,2", "--steps", "1,2",
                                         "--measured-steps", "2", "--warm", "2", "--out", str(out)])
    assert [(p["k"], p["batch"]) for p in _load(out)["points"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for p in result["points"]:
        assert p["windows_measured"] == 2 and p["window_us"] > 0 and p["host_us"] >= 0
        assert 0 <= p["host_fraction"] <= 1


def test_nsys_script_skips_without_nsys(tmp_path):
    env = dict(os.environ, PATH="/usr/bin:/bin", NSYS="")
    done = subprocess.run(["bash", os.path.join(REPO, "profiling", "nsys.sh"), str(tmp_path)], env=env, check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "nsys not found" in done.stderr


def test_sampler_bench_smoke(tmp_path):
    out = tmp_path / "sampler.json"
    result = _script("bench_sampler").main(["--rows", "4", "--vocab", "300", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result and all(ms > 0 for ms in result["ms"].values())


def test_batch_invariance_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "invariance.json"
    result = _script("bench_batch_invariance").main(["--model", micro_dir, "--dtype", "float32", "--threads", "1",
                                                     "--batches", "1", "3", "--gen", "4", "--prompt-len", "8",
                                                     "--prefill-len", "16", "--rounds", "1", "--out", str(out)])
    assert set(result["decode"]) == {1, 3} and json.loads(out.read_text())["prefill"]["tokens"] == 16
    for point in [*result["decode"].values(), result["prefill"]]:
        assert all(tps > 0 for tps in point["tokens_per_s"].values()) and point["ratio"] > 0


def test_lora_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "lora.json"
    result = _script("bench_lora").main(["--model", micro_dir, "--threads", "1", "--batches", "1", "2", "--gen", "4",
                                         "--prompt-len", "8", "--prefill-len", "16", "--rounds", "1", "--rank", "4",
                                         "--adapter", str(tmp_path / "adapter"), "--out", str(out)])
    assert set(result["decode"]) == {1, 2} and json.loads(out.read_text())["prefill"]["tokens"] == 16
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    for point in [*result["decode"].values(), result["prefill"]]:
        assert all(tps > 0 for tps in point["tokens_per_s"].values()) and point["cost"] > 0


def test_weight_update_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "weights.json"
    result = _script("bench_weight_update").main(["--model", micro_dir, "--threads", "1", "--rounds", "1",
                                                  "--trained", str(tmp_path / "trained"), "--out", str(out)])
    assert json.loads(out.read_text())["rounds"] == 1 and result["checkpoint_bytes"] > 0
    assert all(len(ts) == 1 and ts[0] > 0 for ts in result["seconds"].values())


def test_prefix_cache_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "prefix"
    result = _script("bench_prefix_cache").main(["--model", micro_dir, "--requests", "6", "--prefix-len", "40",
                                                 "--suffix-len", "5", "--max-tokens", "3", "--out", str(out)])
    on, off = result["modes"]
    assert _load(out)["unique_tokens"] == 40 + 6 * 5 and result["outputs_identical"]
    assert off["prefill_tokens"] == 6 * 45 and on["prefill_tokens"] == 40 + 6 * 5  # the prefix computed once
    assert on["prefix_cache_hits"] == 5 * 40  # 2 full pages + 8 tokens of the first prompt's last page, each
    assert all(m["ttft_p50_s"] > 0 and m["output_tokens"] == 18 for m in result["modes"])


def test_stall_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "stall"
    result = _script("bench_stall").main(["--model", micro_dir, "--streams", "3", "--long-len", "100",
                                          "--budgets", "16,512", "-k", "2", "--warm-steps", "3", "--out", str(out)])
    chunked, whole = _load(out)["points"]
    assert (chunked["budget"], whole["budget"]) == (16, 512)
    assert chunked["steps_until_first_token"] == 7 + 1 and whole["steps_until_first_token"] == 1 + 1  # + the lag
    assert all(p["longest_gap_s"] > 0 and p["window_step_s"] > 0 for p in result["points"])


def test_tensor_parallel_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "tp"
    result = _script("bench_tp").main(["--model", micro_dir, "--batches", "2", "--gen-len", "4", "-k", "2",
                                       "--out", str(out)])
    assert [(p["tp"], p["batch"]) for p in _load(out)["points"]] == [(1, 2), (2, 2)]
    assert result["same_tokens"] and result["points"][1]["collective_s"] > 0
    from graphdecode.models.parallel import TPGroup

    assert TPGroup.all_reduce.__name__ == "all_reduce"  # the timing wrappers are gone again


def test_tensor_parallel_start_bench_smoke(micro_dir, tmp_path):
    """bench_tp_start: engines with forkserver ranks and spawned ranks in turn, the same tokens, every part timed;
    the driver's start method is its own again afterwards."""
    from graphdecode.device import tensor_parallel

    before = tensor_parallel._rank_context
    out = tmp_path / "tp_start"
    result = _script("bench_tp_start").main(["--model", micro_dir, "--rounds", "1", "--first", "spawn",
                                             "--out", str(out)])
    assert _load(out)["median"] == result["median"] and result["same_tokens"]
    assert set(result["median"]) == {"forkserver", "spawn"} and result["first_engine"]["kind"] == "spawn"
    assert all(v > 0 for row in result["median"].values() for v in row.values())
    assert tensor_parallel._rank_context is before


def test_serve_bench_smoke(micro_dir, tmp_path):
    out = tmp_path / "serve"
    cpus = os.sched_getaffinity(0)
    result = _script("bench_serve").main(["--model", micro_dir, "--clients", "1,3", "--prompt-len", "4",
                                          "--max-tokens", "4", "-k", "2", "--repeats", "1", "--pin", "--out", str(out)])
    assert _load(out)["points"] == result["points"] and result["server_exit_status"] == 0
    assert os.sched_getaffinity(0) == cpus  # --pin gave this process its CPUs back
    for point, n in zip(result["points"], (1, 3)):
        served, in_process = point["served"], point["in_process"]
        assert served["clients"] == in_process["clients"] == n
        assert served["output_tokens"] == in_process["output_tokens"] == 4 * n
        assert served["tokens_per_s"] > 0 and served["ttft_p50_s"] > 0 and served["itl_p99_s"] > 0
        assert in_process["window_mean_s"] > 0 and point["served_over_in_process"] > 0
        # the server's own view, read from /metrics (its names must match the server's)
        assert served["server_ttft_mean_s"] > 0 and served["engine_windows"] > 0
    assert list(result["goals"]) == ["served / in-process tokens/s at 3 clients (>= 0.9)"]


def test_serve_bench_clients_in_worker_processes(micro_dir, tmp_path):
    """--client-procs 2: the users spread over two processes, every stream complete; token-id
    prompts with the raw client."""
    out = tmp_path / "serve_procs"
    result = _script("bench_serve").main(["--model", micro_dir, "--clients", "3", "--prompt-len", "4",
                                          "--max-tokens", "4", "-k", "2", "--repeats", "1", "--client-procs", "2",
                                          "--client", "raw", "--prompt-kind", "ids", "--out", str(out)])
    (point,) = result["points"]
    assert point["served"]["output_tokens"] == point["in_process"]["output_tokens"] == 12
    assert point["served"]["content_chunks"] >= 3 * 2 and point["served"]["cpu_s"]["client"] > 0


def test_speculative_bench_smoke(text_model, tmp_path):
    out = tmp_path / "spec"
    result = _script("bench_spec").main(["--model", text_model, "--batches", "2", "--max-tokens", "8", "-k", "2",
                                         "-d", "3", "--repeats", "2", "--out", str(out)])
    assert [(p["set"], p["batch"]) for p in _load(out)["points"]] == [("input-grounded", 2), ("open-ended", 2)]
    assert all(p["same_tokens"] and p["plain_tokens_per_s"] > 0 and p["spec_tokens_per_s"] > 0
               for p in result["points"])
    assert all(p["speedup_paired"] > 0 for p in result["points"])


def test_inert_rows_ab_smoke(text_model, tmp_path):
    result = _script("ab_inert_rows").main(["--model", text_model, "--rounds", "1", "--max-tokens", "6",
                                            "--threads", "1", "--out", str(tmp_path / "inert")])
    assert {p["saving"] for p in result["points"]} == {"verify", "logits"}
    assert all(p["same_tokens"] and p["on_tokens_per_s"] > 0 and p["off_tokens_per_s"] > 0 for p in result["points"])


def test_top_filter_ab_runs_both_paths_with_the_same_tokens(text_model, tmp_path):
    """profiling/ab_top_filter.py: a point per (engine, filter, batch), the candidates against the sort, the same
    tokens at each."""
    result = _script("ab_top_filter").main(["--model", text_model, "--rounds", "1", "--max-tokens", "6",
                                            "--threads", "1", "--out", str(tmp_path / "top_filter")])
    assert {p["filter"] for p in result["points"]} == {"top_p 0.95", "top_k 50", "min_p 0.05"}
    assert all(p["same_tokens"] and p["candidates_tokens_per_s"] > 0 and p["sorted_tokens_per_s"] > 0
               for p in result["points"])


def test_speculative_bench_methods_and_temperatures(text_model, tmp_path):
    """--methods ngram,draft_model (the model as its own draft), greedy and seeded T=0.7: a point per
    (method, set, temperature, batch), the plain tokens at each, the identical draft accepting drafts."""
    result = _script("bench_spec").main(["--model", text_model, "--batches", "1", "--max-tokens", "6", "-k", "2",
                                         "-d", "2", "--repeats", "1", "--methods", "ngram,draft_model",
                                         "--draft-model", text_model, "--temperatures", "0,0.7",
                                         "--out", str(tmp_path / "spec")])
    keys = [(p["method"], p["set"], p["temperature"]) for p in result["points"]]
    assert keys == [(m, s, t) for m in ("ngram", "draft_model") for s in ("input-grounded", "open-ended")
                    for t in (0.0, 0.7)]
    assert all(p["same_tokens"] and p["spec_tokens_per_s"] > 0 for p in result["points"])
    assert any(p["accepted_per_verify"] > 0 for p in result["points"] if p["method"] == "draft_model")


def test_distil_draft_smoke(text_model, tmp_path, monkeypatch):
    """distil_draft: a 1-layer truncated copy trained for a few seconds on the model's own answers, saved
    under the cache directory with its report, reused by a second call, and its acceptance reported."""
    import json as json_

    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    module = _script("distil_draft")
    result = module.main(["--model", text_model, "--layers", "1", "--minutes", "0.05", "--max-tokens", "8",
                          "--eval-prompts", "4", "-d", "2", "--threads", "1", "--out", str(tmp_path / "distil")])
    draft = result["draft"]
    assert draft.startswith(str(tmp_path / "cache" / "drafts"))
    assert json_.load(open(os.path.join(draft, "config.json")))["num_hidden_layers"] == 1
    report = result["report"]
    assert report["steps"] >= 1 and report["answer_tokens"] > 0 and report["sequences"] > 0
    for name in ("untrained", "distilled"):
        assert 0 <= result[name]["accepted_per_verify"] <= 2 and 0 <= result[name]["accepted_per_draft"] <= 1
    again, _ = module.distilled_draft(text_model, 1, 0.05, max_tokens=8, threads=1)
    assert again == draft  # cached: not trained again


def test_distil_eagle3_and_its_bench_smoke(text_model, tmp_path, monkeypatch):
    """distil_eagle3: a head trained for a few seconds on the model's own answers (its last three layers'
    hidden states: a 4-layer model), saved under the cache directory in the EAGLE-3 format the engine loads,
    its acceptance reported per position; bench_spec's eagle3 method runs it beside plain decoding."""
    import json as json_

    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    result = _script("distil_eagle3").main(["--model", text_model, "--minutes", "0.05", "--max-tokens", "8",
                                            "--draft-vocab", "128", "--train-prompts", "6", "-d", "2",
                                            "--val-every", "3", "--threads", "1", "--out", str(tmp_path / "distil")])
    head = result["head"]
    assert head.startswith(str(tmp_path / "cache" / "eagle3"))
    config = json_.load(open(os.path.join(head, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 128
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    report, acceptance = result["report"], result["acceptance"]
    assert report["steps"] >= 1 and report["sequences"] == 12 and 0 < report["draft_vocab_coverage"] <= 1
    assert 0 <= acceptance["accepted_per_verify"] <= 2 and len(acceptance["accepted_per_position"]) == 2
    # prompts 2 and 5 of 6 held out: their greedy answers validate, neither of their answers trains
    validation = report["validation"]
    assert report["training_sequences"] == 8 and validation["sequences"] == 2
    assert len(validation["depth_accuracy"]) == len(validation["accepted_per_verify"]) == report["depths"] == 2
    assert all(0 <= a <= d for d, a in enumerate(validation["accepted_per_verify"], 1))
    # another head's settings reuse the target's answers and features (cached apart from the head)
    module = _script("distil_eagle3")
    answers = module.target_answers
    monkeypatch.setattr(module, "target_answers", lambda *a, **k: pytest.fail("answers generated again"))
    other, other_report = module.distilled_head(text_model, 0.05, draft_vocab=128, max_tokens=8, threads=1,
                                                train_prompts=6, val_every=3, lr=1e-3, depths=3)
    assert other != head and other_report["validation"]["sequences"] == 2
    assert len(other_report["validation"]["accepted_per_verify"]) == 3
    # and a run on the first prompts of theirs, its seconds scaled to its share
    fewer, fewer_report = module.distilled_head(text_model, 0.05, draft_vocab=128, max_tokens=8, threads=1,
                                                train_prompts=3, val_every=3)
    assert fewer_report["sequences"] == 6 and fewer_report["data_scaled_from"] == 6
    assert fewer_report["generate_seconds"] == pytest.approx(report["generate_seconds"] / 2)
    # a run on more prompts generates only the rest; its data begins with the cached run's
    def data(n):
        prompts = module.training_prompts(text_model, module.distil_draft.EVAL_PROMPTS, n)
        return module.target_data(text_model, prompts, 8, 1, module.data_dtype(), (1, 2, 3)), prompts

    (before, _), asked = data(6), []
    monkeypatch.setattr(module, "target_answers", lambda target, prompts, *a: asked.append(prompts) or answers(
        target, prompts, *a))
    _, more_report = module.distilled_head(text_model, 0.05, draft_vocab=128, max_tokens=8, threads=1,
                                           train_prompts=9, val_every=3)
    more, prompts = data(9)
    assert asked == [prompts[6:]] and more_report["sequences"] == 18 and more_report["data_extended_from"] == 6
    assert [p for p, _ in more["sequences"][:9]] == prompts and more["sequences"][:6] == before["sequences"][:6]
    assert data(6)[0]["sequences"] == before["sequences"]  # now cut from the larger entry
    bench = _script("bench_spec").main(["--model", text_model, "--batches", "1", "--max-tokens", "6", "-k", "2",
                                        "-d", "2", "--repeats", "1", "--methods", "eagle3", "--eagle3-head", head,
                                        "--out", str(tmp_path / "spec")])
    assert [p["method"] for p in bench["points"]] == ["eagle3", "eagle3"]
    assert all(p["same_tokens"] and p["spec_tokens_per_s"] > 0 for p in bench["points"])


def test_distil_eagle3_validation_walks_the_engines_greedy_rounds():
    """validate: a round at q drafts depth j's prediction at q + j - 1, accepts up to the first wrong draft, and
    the next round starts past the accepted drafts and the verify's own token; depth accuracy from the prompt's
    last position on."""
    import torch

    module = _script("distil_eagle3")
    labels = torch.tensor([0, 1, 2, 3, 0, 1])  # the target's argmax at positions 1..6 (position i predicts i + 1)
    hits = [[1, 1, 0, 1, 1, 1], [1, 0, 1, 1, 1, 1]]  # depth 1, depth 2: is the head's argmax the target's there

    def model(aux, next_ids, depths):
        assert aux.shape[:2] == next_ids.shape == (1, 6) and depths == 2
        return [torch.nn.functional.one_hot(torch.where(torch.tensor(h) == 1, labels, (labels + 1) % 4), 4)[None]
                .float() for h in hits]

    feature = {"ids": torch.arange(7), "aux": torch.zeros(7, 3), "prompt": 1,
               "top_ids": torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.stack([labels, labels], 1)])}
    result = module.validate(model, [feature], torch.arange(4), 2)
    # d = 1: rounds at 0 (1 accepted), 2 (0), 3 (1), 5 (1); d = 2: at 0 (1), 2 (0), 3 (2)
    assert result["accepted_per_verify"] == [0.75, 1.0]
    assert result["depth_accuracy"] == [round(5 / 6, 4), 0.8] and result["sequences"] == 1


def test_moe_bench_smoke(tmp_path, monkeypatch):
    """bench_moe --tiny: both implementations and transformers at batch 1 and 2, every number positive, the
    MoE layers' share of a step in (0, 1), the preset built under the (temporary) cache directory."""
    import torch

    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    out = tmp_path / "moe.json"
    result = _script("bench_moe").main(["--tiny", "--batches", "1,2", "--new-tokens", "2", "--prompt-len", "4",
                                        "--repeats", "1", "-k", "2", "--compare-impls", "--json", str(out)])
    assert json.loads(out.read_text())["points"] == json.loads(json.dumps(result["points"]))
    assert result["model_dir"].startswith(str(tmp_path)) and result["family"] == "qwen3_moe"
    assert result["impls"] == ["grouped", "reference"] and result["config"]["model_type"] == "qwen3_moe"
    assert (result["summary"]["num_experts"], result["summary"]["sparse_layers"]) == (8, 2)
    assert result["transformers"]["moe_layers"] == 2
    assert [p["batch"] for p in result["points"]] == [1, 2]
    for point in result["points"]:
        sides = [*point["graphdecode"].values(), point["transformers"]]
        assert list(point["graphdecode"]) == ["grouped", "reference"] and all(r > 0 for r in point["ratio"].values())
        for side in sides:
            assert side["decode_tokens_per_s"] > 0 and side["ms_per_decode_step"] > 0 and side["decode_s"] > 0
            assert len(side["output_ids"]) == point["batch"] and side["moe"]["moe_s"] > 0
            assert 0 < side["moe"]["share"] < 1 and side["moe"]["moe_calls"] > 0
        for mine in point["graphdecode"].values():  # fp32: the same greedy tokens as transformers
            assert mine["moe"]["moe_calls"] == mine["moe"]["steps"] * 2  # every step's two MoE layers
            assert mine["same_rows_as_transformers"] == point["batch"] == mine["same_rows_as_first_impl"]
    assert torch.get_num_threads() == threads  # --threads 1 was this process's for the run only


def test_hybrid_bench_smoke(tmp_path, monkeypatch):
    """bench_hybrid --preset tiny: decode beside transformers (the same fp32 tokens) and the per-token cost at two
    contexts for the hybrid and its dense contrast, every number positive, the presets built in the cache."""
    monkeypatch.setenv("GRAPHDECODE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "hybrid.json"
    result = _script("bench_hybrid").main(["--preset", "tiny", "--batches", "1,2", "--contexts", "16,48",
                                           "--new-tokens", "4", "--prompt-len", "8", "--repeats", "1",
                                           "--threads", "1", "--json", str(out)])
    assert json.loads(out.read_text())["decode"] == json.loads(json.dumps(result["decode"]))
    assert [p["batch"] for p in result["decode"]] == [1, 2]
    for point in result["decode"]:
        assert point["graphdecode_decode_tokens_per_s"] > 0 and point["transformers_decode_tokens_per_s"] > 0
        assert point["rows_equal"] == point["rows"]
    for kind in ("hybrid", "dense"):
        assert [p["context"] for p in result["context"][kind]] == [16, 48]
        assert all(p["ms_per_token"] > 0 for p in result["context"][kind])


def test_cpu_peers_bench_smoke(micro_dir, tmp_path):
    """bench_cpu_peers with graphdecode alone (the peers need their own installs): each point
    positive, CPU-seconds per token never negative, the table and JSON written; and the helpers that
    pick each point's best round and compare greedy rows."""
    module = _script("bench_cpu_peers")
    out = tmp_path / "peers"
    report = module.main(["--model", micro_dir, "--threads", "1", "--batches", "1,3", "--prefill", "32",
                          "--prompt-len", "8", "--gen-len", "4", "--repeats", "1", "--rounds", "1", "--out", str(out)])
    assert _load(out)["tables"] == report["tables"] and "graphdecode" in report["tables"][0]
    mine = report["threads"][1]["graphdecode"]
    assert [p["batch"] for p in mine["decode"]] == [1, 3] and [p["tokens"] for p in mine["prefill"]] == [32]
    for point in mine["decode"] + mine["prefill"]:
        assert point["tokens_per_s"] > 0 and point["cpu_s_per_token"] >= 0  # /proc's 10 ms ticks: tiny runs read 0
    assert [len(p["output_ids"]) for p in mine["decode"]] == [1, 3]
    assert all(len(row) == 4 for p in mine["decode"] for row in p["output_ids"])
    slow = {"decode": [{"tokens_per_s": 1.0, "batch": 1}], "prefill": [{"tokens_per_s": 9.0, "tokens": 8}]}
    fast = {"decode": [{"tokens_per_s": 2.0, "batch": 1}], "prefill": [{"tokens_per_s": 3.0, "tokens": 8}]}
    best = module.best_of([slow, fast])
    assert best["decode"][0]["tokens_per_s"] == 2.0 and best["prefill"][0]["tokens_per_s"] == 9.0
    other = {"decode": [dict(mine["decode"][1], output_ids=[[0] * 4] + mine["decode"][1]["output_ids"][1:])]}
    assert module.agreement({"graphdecode": {"decode": mine["decode"][1:]}, "vllm": other}) == [
        "graphdecode, batch 3: 2/3 rows of greedy tokens equal vLLM's"]
    # --compile both: eager and compiled graphdecode, each against every peer
    cpu = {name: {kind: [dict(p, cpu_s_per_token=0.0) for p in points] for kind, points in run.items()}
           for name, run in (("fast", fast), ("slow", slow))}
    twice = {"graphdecode": cpu["fast"], "graphdecode compiled": cpu["fast"], "llama.cpp": cpu["slow"]}
    text = module.table(2, twice, None)
    assert "graphdecode / llama.cpp | graphdecode compiled / llama.cpp |" in text.splitlines()[0]
    assert text.splitlines()[2].endswith("| 2.00x | 2.00x |") and text.splitlines()[3].endswith("| 0.33x | 0.33x |")


def test_ab_cpu_prefill_smoke(micro_dir):
    """ab_cpu_prefill: the prefill kernel and SDPA alternate in one engine, whole and chunked (later chunks
    over cached keys); both give the same first tokens and every time is positive."""
    from graphdecode.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built")
    results = _script("ab_cpu_prefill").main(["--model", micro_dir, "--lengths", "40,150", "--batch", "2",
                                              "--chunk", "64", "--rounds", "1"])
    assert [r["length"] for r in results] == [40, 150]
    for r in results:
        assert r["same_tokens"] and r["sdpa_s"] > 0 and r["kernel_s"] > 0 and r["best_ratio"] > 0


def test_cpu_kernels_bench_smoke():
    """bench_cpu_kernels: every kernel beside its baseline (torch's op; the gated one pass beside the engine's two
    passes) at a small shape, both times positive."""
    from graphdecode.kernels.cpu import cpu_kernels

    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built")
    rows = _script("bench_cpu_kernels").main(["--dtype", "bfloat16", "--rows", "20", "--threads", "1",
                                              "--rounds", "1", "--shape", "64,128,4,2,32"])
    assert [r["case"] for r in rows] == ["linear qkv", "linear o", "linear gate_up", "linear down", "swiglu",
                                         "gated one pass", "down + residual", "prefill attention"]
    assert all(r["kernel_ms"] > 0 and r["torch_ms"] > 0 for r in rows)


def test_ab_cpu_decode_layers_smoke(micro_dir, monkeypatch):
    """ab_cpu_decode_layers: the one-call decode layers and the eager forward alternate in one engine (the micro
    model's weights counted as streaming, so they take the panels) and decode the same tokens."""
    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models import cpu_linear

    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built")
    monkeypatch.setattr(cpu_linear, "STREAM_BYTES", 0)
    results = _script("ab_cpu_decode_layers").main(["--model", micro_dir, "--batches", "1,3", "--gen", "5",
                                                    "--prompt-len", "6", "--rounds", "1"])
    assert [r["batch"] for r in results] == [1, 3]
    for r in results:
        # decode time is a difference of two timed runs: on a loaded machine it can come out negative, so only
        # its presence is checked here (tests do not assert timings)
        assert r["same_tokens"] and all(math.isfinite(r[k]) for k in ("eager_tokens_per_s", "layers_tokens_per_s"))


def test_kv_fp8_bench_smoke(micro_dir, tmp_path):
    """bench_kv_fp8: the capacity table (4x float32's pages at the same bytes), perplexities, decode with both
    caches through bench_cpu_peers' worker, the calibrated-scales checkpoint written, the JSON."""
    out = tmp_path / "kv"
    report = _script("bench_kv_fp8").main(["--model", micro_dir, "--threads", "1", "--batches", "1,2",
                                           "--prompt-len", "8", "--gen-len", "4", "--repeats", "1", "--rounds", "1",
                                           "--pool-bytes", str(8 << 20), "--context", "256",
                                           "--work", str(tmp_path / "work"), "--out", str(out)])
    assert _load(out)["table"] == report["table"]
    capacity = report["capacity"]["float32"]
    assert capacity["fp8"]["pages"] == 4 * capacity["auto"]["pages"]
    assert capacity["fp8"]["sequences"] >= 4 * capacity["auto"]["sequences"]
    assert all(p > 1 for p in report["perplexity"].values()) and len(report["perplexity"]) == 3
    for kv in ("auto", "fp8"):
        assert [p["batch"] for p in report["decode"][kv]["decode"]] == [1, 2]
        assert all(p["tokens_per_s"] > 0 for p in report["decode"][kv]["decode"])
    assert os.path.isfile(tmp_path / "work" / (os.path.basename(micro_dir) + "-kv-scales") / "config.json")


def test_ab_huge_pages_smoke(text_model, tmp_path):
    """ab_huge_pages: four engines, the two named with huge pages, rotating rounds; a ratio per round and batch."""
    result = _script("ab_huge_pages").main(["--model", text_model, "--batches", "1,2", "--max-tokens", "4",
                                            "--repeats", "2", "--threads", "1", "--out", str(tmp_path / "hp")])
    assert [pt["batch"] for pt in result["points"]] == [1, 2] and len(result["collapsed_bytes"]) == 4
    for pt in result["points"]:
        assert len(pt["ratios"]) == 2 and all(r > 0 for r in pt["ratios"]) and pt["huge"] == [1, 2]
        assert len(pt["engine_medians"]) == 4 and 0 <= pt["wins"] <= 2
    assert os.path.isfile(tmp_path / "hp.json")
