"""What tests of every layer share besides fixtures (those are in conftest.py), once: the small
engine most CPU tests build, prompts as requests and the token ids of outputs, transformers'
oracles (greedy `generate`, fp32 logits), edits of a model directory, a live server, and the
FlashInfer checks of the GPU tests. A helper only one file uses stays in that file."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import time

import httpx
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]  # the checkout: graphdecode/, profiling/, tests/
# tests/gpu/test_gpu_check.py's full dry run runs in the background from that module on (a minute and a half, one
# stage's process at a time); its test, which waits for it, runs last in the session (tests/conftest.py), so that
# the rest of the suite runs beside it rather than the suite waiting for it
GPU_CHECK_DRY_RUN_TEST = "test_dry_run_rehearses_every_stage"

# The small engine the CPU tests build; a file that needs more says what differs:
# dict(SMALL_ENGINE, max_batch_size=16).
SMALL_ENGINE = dict(num_decode_steps=4, max_model_len=256, max_batch_size=8)


# ------------------------------------------------------------------------- prompts and outputs
def random_prompts(count: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(count)]


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    """Token-id prompts as LLM.generate's requests."""
    return [{"prompt_token_ids": p} for p in prompts]


def first_tokens(outputs) -> list[list[int]]:
    """The token ids of each request's first (for n = 1: only) completion."""
    return [o.outputs[0].token_ids for o in outputs]


def generate_tokens(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """Generate from token-id prompts; each request's first completion's token ids."""
    return first_tokens(llm.generate(token_prompts(prompts), params))


def completions(outputs) -> list[list[tuple]]:
    """(token ids, finish reason) of every completion of every request."""
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


# ------------------------------------------------------------------------- transformers, the oracle
_HF_CACHE: dict = {}
_HF_MODELS: dict = {}


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate, greedy, fp32, CPU, one prompt at a time (cached per model)."""
    from transformers import AutoModelForCausalLM

    key = (model_dir, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            outs.append(gen[0, len(p) :].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


def hf_model(model_dir: str):
    """transformers' fp32 model of a directory (loaded once per directory)."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return _HF_MODELS[model_dir]


def hf_logits(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [T, V] of a whole sequence (teacher forcing)."""
    with torch.no_grad():
        return hf_model(model_dir)(torch.tensor([tokens])).logits[0].float()


def hf_prompt_logprobs(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 log_softmax [T, V] of a sequence: row j predicts token j + 1."""
    return torch.log_softmax(hf_logits(model_dir, tokens), dim=-1)


def peft_adapter(model_dir: str, out: str, seed: int, r: int = 8, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                 "gate_proj", "up_proj", "down_proj"), scale: float = 0.3, **lora_config) -> str:
    """A PEFT LoRA adapter of the model at `out` (peft's save_pretrained), its A and B random (PEFT starts B at
    zero, which would change nothing); made once per directory."""
    if os.path.isfile(os.path.join(out, "adapter_config.json")):
        return out
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora_config = {"lora_alpha": 2 * r, "lora_dropout": 0.0, **lora_config}
    model = get_peft_model(base, LoraConfig(r=r, target_modules=list(targets), **lora_config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * scale)
    model.save_pretrained(out)
    return out


def peft_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers + PEFT generate, greedy, fp32, CPU, one prompt at a time (None: the base model's, hf_greedy)."""
    if adapter is None:
        return hf_greedy(model_dir, prompts, max_new_tokens)
    key = (model_dir, adapter, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _HF_CACHE:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                          adapter)
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
            outs.append(gen[0, len(p) :].tolist())
        _HF_CACHE[key] = outs
    return _HF_CACHE[key]


# ------------------------------------------------------------------------- model directories
def rewrite_config(model_dir: str, edit) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    edit(raw)
    with open(path, "w") as f:
        json.dump(raw, f, indent=2)


def copy_model(tiny_models: dict, model: str, tmp_path, name: str | None = None) -> str:
    """A copy of one of the tiny models, to edit, at tmp_path / name (default: the model's name)."""
    path = str(tmp_path / (name or model))
    shutil.copytree(tiny_models[model], path)
    return path


def edit_tensors(model_dir: str, edit) -> None:
    """Load model.safetensors, edit(tensors) the dict in place, save it back."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def remove_tensor(key: str):
    """An edit for edit_tensors: drop one tensor."""
    return lambda tensors: tensors.pop(key)


# ------------------------------------------------------------------------- the CLI and a live server
def one_line_cli_error(capsys, argv: list[str], clean: bool = False) -> str:
    """`graphdecode ARGV` exits 2 with exactly one line on stderr, `graphdecode: error: ...`; returns it.
    clean: and no traceback, nothing on stdout."""
    from graphdecode.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphdecode: error: "), captured.err
    if clean:
        assert "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def engine_config_stub(max_model_len: int = 64):
    """What the server's metrics read of an engine's config, for a stand-in engine."""
    from types import SimpleNamespace

    return SimpleNamespace(max_model_len=max_model_len, page_size=16, kv_cache_dtype="auto",
                           enable_prefix_caching=True, num_pages=8, kv_cache_memory_bytes=None,
                           torch_device=torch.device("cpu"), enable_lora=False, max_loras=1)


@contextlib.contextmanager
def live_server(model: str, log_dir, served_name: str, *extra: str, env: dict | None = None):
    """`graphdecode serve` on a free loopback port with the tests' common flags (one thread, quiet);
    yields its URL, and checks it drained and exited 0 afterwards."""
    from graphdecode.server.launch import start_server, stop_server

    log = os.path.join(str(log_dir), "server.log")
    proc, url = start_server(["--model", model, "--served-model-name", served_name, "--threads", "1",
                              "--no-access-log", "--log-level", "warning", *extra], log, timeout_s=180, env=env)
    try:
        yield url
    finally:
        code = stop_server(proc, 40)
    assert code == 0, open(log).read()


def stream_events(url: str, body: dict, result: dict, timeout: float = 60) -> None:
    """Stream a completion into `result`: "text", "finish" (each chunk's finish_reason) and "errors"
    (error events), as the chunks arrive (so another thread can watch them)."""
    result.update(text="", finish=[], errors=[])
    with httpx.Client(timeout=timeout) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    result["errors"].append(event["error"])
                    continue
                result["text"] += event["choices"][0]["text"]
                result["finish"].append(event["choices"][0]["finish_reason"])


@contextlib.contextmanager
def signalled_mid_stream(url: str, body: dict, proc, sig, timeout: float = 60):
    """Stream a completion; once its first chunk has arrived, send `sig` to the server process `proc`; yield
    the stream's remaining SSE lines (the caller reads them, and may do more before it does)."""
    with httpx.Client(timeout=timeout) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        proc.send_signal(sig)
        yield lines


# ------------------------------------------------------------------------- FlashInfer on a GPU
# What the GPU machine's kit (../shared/gpu-kit) prebuilds: bf16 at head_dim 64 and 128. Under
# profiling/gpu_check (GRAPHDECODE_REQUIRE_FLASHINFER=1) these must run, so a broken kit fails.
KIT_KERNELS = frozenset({(64, torch.bfloat16), (128, torch.bfloat16)})


def require_flashinfer(head_dim: int, dtype: torch.dtype) -> None:
    """Skip a GPU test that picks FlashInfer for (head_dim, dtype) unless it can run here.

    The decision is the engine's own (`flashinfer_unavailable_reason`, the probe behind
    `attention_backend` auto and the refusal of an explicit "flashinfer"), so a test
    skips exactly where the engine would refuse, with the probe's reason. Under
    gpu_check a combination the kit promises fails instead of skipping."""
    from graphdecode.attention.flashinfer_probe import flashinfer_unavailable_reason

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    reason = flashinfer_unavailable_reason(head_dim, dtype)
    if reason is None:
        return
    if os.environ.get("GRAPHDECODE_REQUIRE_FLASHINFER") == "1" and (head_dim, dtype) in KIT_KERNELS:
        pytest.fail(f"the gpu-kit promises FlashInfer for head_dim {head_dim} {dtype}, but: {reason}")
    pytest.skip(f"FlashInfer cannot run head_dim {head_dim} {dtype} here: {reason}")


def assert_padded_ctas_masked(wrapper, rows: int) -> None:
    """flashinfer issue #4002: a CUDA-graph plan launches a padded grid (padded_batch_size CTAs
    per KV head, more than the scheduled blocks) and, before the fix, padded CTAs read stale
    schedule entries when split-KV was off. 0.7.2.post1's plan allocates `block_valid_mask`
    for every CUDA-graph plan and its run binds it (docs/gpu.md); check that this plan has it
    and that it marks exactly a prefix of scheduled blocks, at least one per row.
    PrefillPlanInfo fields: [0] padded_batch_size, [12] block_valid_mask_offset,
    [13] enable_cuda_graph, [14] split_kv."""
    info = [int(x) for x in wrapper._plan_info]
    padded, offset, cuda_graph, split_kv = info[0], info[12], info[13], info[14]
    assert cuda_graph == 1 and split_kv == 0, info
    assert offset != 0, f"no block_valid_mask in a CUDA-graph plan: {info}"
    mask = wrapper._pin_memory_int_workspace_buffer[offset:offset + padded].view(torch.bool)
    scheduled = int(mask.sum())
    assert rows <= scheduled <= padded and bool(mask[:scheduled].all()), (scheduled, padded)


def staged_spec_state(prompts: list[list[int]], vocab: int, d: int, steps: int, max_len: int = 64):
    """A speculative DecodeState with `prompts` staged as live rows (history, next input, position, a block
    table of 8 pages each from page 1), for unit tests of speculative_window and the drafters."""
    from graphdecode.device.decode_state import DecodeState

    state = DecodeState(len(prompts), 8, 2, num_decode_steps=steps, max_logprobs=1, device="cpu", vocab_size=vocab,
                        spec_tokens=d, history_len=max_len + d + 1)
    for row, prompt in enumerate(prompts):
        state.speculation.history[row, : len(prompt)] = torch.tensor(prompt)
        state.input_ids[row] = prompt[-1]
        state.positions[row] = len(prompt) - 1
        state.seq_lens[row] = len(prompt)
        state.block_table[row] = torch.arange(1, 9) + 8 * row
    state.done[: len(prompts)] = False
    state.max_len[: len(prompts)] = max_len
    return state


def assert_same_outputs(got, want, tolerance: float = 1e-4) -> None:
    """The same completions, and where logprobs were asked for, the same tokens in each position's dict
    with logprobs within `tolerance` (speculation against plain decoding)."""
    assert completions(got) == completions(want)
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < tolerance for t in x)


def add_mtp_layer(model_dir: str, source_layer: int, seed: int = 0, std: float = 0.05) -> str:
    """Give a Qwen3.5 / Qwen3-Next checkpoint MTP tensors as those checkpoints ship them: mtp.layers.0.* a copy
    of its full-attention decoder layer `source_layer` (so transformers' own layer is the oracle for it), random
    mtp.fc [hidden, 2 x hidden] and (1 + w) norms near 1 (pre_fc_norm_embedding / pre_fc_norm_hidden / norm)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.") if any(k.startswith(p) for k in tensors))
    source = f"{prefix}{source_layer}."
    for key in [k for k in tensors if k.startswith(source)]:
        tensors["mtp.layers.0." + key[len(source):]] = tensors[key].clone()
    hidden = tensors[prefix.replace("layers.", "norm.weight")].shape[0]
    dtype = tensors[prefix.replace("layers.", "norm.weight")].dtype
    tensors["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * std).to(dtype)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = (torch.randn(hidden, generator=g) * 0.1).to(dtype)  # (1 + w) norms
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def assert_hf_tokens_on_every_path(path: str, batch: list[list[int]], params, expected: list[list[int]]):
    """transformers' greedy tokens `expected` through plain windows (k = 1), chunked prefill with prefix-cache hits
    (k = 4, 4 rows) and n-gram speculation; the first token's logprobs of two rows within 1e-4 of transformers'.
    Returns the plain engine."""
    from graphdecode import LLM, SamplingParams

    llm = LLM(path, num_decode_steps=1, page_size=16, max_model_len=256, max_batch_size=8)
    assert generate_tokens(llm, batch, params) == expected
    out = llm.generate(token_prompts(batch[:2]), SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)
    for row, result in zip(batch[:2], out):
        want = hf_prompt_logprobs(path, row)[-1]
        for token, logprob in result.outputs[0].logprobs[0].items():
            assert abs(logprob.logprob - float(want[token])) < 1e-4
    chunked = LLM(path, num_decode_steps=4, page_size=32, max_model_len=256, max_batch_size=4,
                  max_num_batched_tokens=32)
    assert generate_tokens(chunked, batch, params) == expected
    assert generate_tokens(chunked, batch, params) == expected
    assert chunked.stats()["prefix_cache_hits"] > 0
    ngram = LLM(path, num_decode_steps=4, max_model_len=256, max_batch_size=8,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert generate_tokens(ngram, batch, params) == expected
    return llm


def assert_graph_twin_gives_plain_tokens(path: str, speculative_config: dict, prompts: list[dict]) -> None:
    """Captured windows in the CPU graph twin under the bounds-checked mode, prefill in chunks of 32, windows
    alternating speculative (`speculative_config`) and plain: the eager plain engine's tokens, greedy and for
    seeded n = 2 forks."""
    from graphdecode import LLM, SamplingParams

    engine = dict(dtype="float32", cpu_threads=1, num_decode_steps=4, max_model_len=256, max_batch_size=8,
                  max_num_batched_tokens=32)
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(n=2, temperature=5.0, seed=11, max_tokens=16, ignore_eos=True)]
    with LLM(path, **engine) as plain:
        want = [completions(plain.generate(prompts, p, use_tqdm=False)) for p in cases]
    with LLM(path, speculative_config=speculative_config, cuda_graphs=True, check_bounds=True, **engine) as spec:
        turn = iter(range(1 << 30))
        spec.engine.spec_policy.speculate = lambda bucket, rows=(): next(turn) % 2 == 0
        got = [completions(spec.generate(prompts, p, use_tqdm=False)) for p in cases]
        stats = spec.stats()
    assert got == want
    assert stats["graphs_captured"] > 0 and stats["spec_windows"] > 0 and stats["spec_draft_tokens"] > 0


def save_routed_model(path: str, model_class, config, seed: int) -> str:
    """A tiny DeepSeek-routed model (GLM-4.5, DeepSeek-V3) saved with every part random: the router's correction
    biases (transformers zeroes them), the linears' biases, norms near 1, and an LM head large enough that the
    logits are far from uniform even at temperature 20 (so hot speculative rounds reject some drafts)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("e_score_correction_bias"):
                    tensor.copy_(torch.randn_like(tensor) * 0.1)
                elif tensor.dim() >= 2:
                    tensor.copy_(torch.randn_like(tensor) * (1.0 if name == "lm_head.weight" else 0.08))
                elif name.endswith(".bias"):
                    tensor.copy_(torch.randn_like(tensor) * 0.05)
                elif name.endswith("norm.weight"):
                    tensor.copy_(1 + torch.randn_like(tensor) * 0.1)
    model.save_pretrained(path)
    return path


def add_nextn_layer(model_dir: str, layers: int, seed: int = 0) -> str:
    """An MTP layer as DeepSeek-V3 and GLM-4.5 ship it: model.layers.{layers}.* a copy of the last decoder layer
    (so transformers' own layer is its oracle), enorm / hnorm / shared_head.norm near 1, a random eh_proj, and
    copies of the embedding and LM head (which graphdecode does not read)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(seed)
    source, at = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for key in [k for k in tensors if k.startswith(source)]:
        tensors[at + key[len(source):]] = tensors[key].clone()
    hidden = tensors["model.norm.weight"].shape[0]
    tensors[at + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{at}{name}.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    tensors[at + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[at + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    return model_dir


def nextn_reference(model_dir: str, tokens: list[int], layers: int):
    """(add_nextn_layer's MTP output at p - 1, the target's final hidden state there) by transformers' modules: the
    final hidden states at 0..p-1, the embeddings of the tokens at 1..p, enorm / hnorm (plain RMSNorms), eh_proj,
    the decoder layer the MTP layer copies over positions 0..p-1, shared_head.norm."""
    import torch
    from safetensors.torch import load_file

    target = hf_model(model_dir)
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    p = len(tokens) - 1

    def norm(name, x):
        x = x.float()
        return w[f"model.layers.{layers}.{name}.weight"] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                                            + target.config.rms_norm_eps))

    with torch.no_grad():
        final = target.model(torch.tensor([tokens[:p]])).last_hidden_state
        embeds = target.model.embed_tokens(torch.tensor([tokens[1:]]))
        x = torch.cat([norm("enorm", embeds), norm("hnorm", final)], dim=-1)
        x = x @ w[f"model.layers.{layers}.eh_proj.weight"].T
        rope = target.model.rotary_emb(x, torch.arange(p)[None])
        out = target.model.layers[layers - 1](x, position_embeddings=rope, attention_mask=None)
        out = norm("shared_head.norm", out[0] if isinstance(out, tuple) else out)
    return out[0, -1], final[0, -1]


def with_chat_template(model_dir: str, path, template: str) -> str:
    """A copy of `model_dir` at `path` whose chat template is `template` (chat_template.jinja; the tokenizer
    config's own template removed, so the file is the one read)."""
    path = pathlib.Path(path)
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(template)
    config = path / "tokenizer_config.json"
    raw = json.loads(config.read_text())
    raw.pop("chat_template", None)
    config.write_text(json.dumps(raw))
    return str(path)


def hot_mid_generation(llm, steps: int = 11) -> set[bool]:
    """Three rows (prompts of 5, 40 and 70 tokens) sampled at temperature 20 (coupled noise dominates both
    distributions, so speculative rounds accept part of their drafts) for `steps` engine steps of a draft-head
    engine; the kinds of windows seen: whether any row ended one plain (its head state stale)."""
    from graphdecode import SamplingParams

    engine = llm.engine
    for i, prompt in enumerate(random_prompts(3, [5, 40, 70], seed=12)):
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=20.0, seed=i, max_tokens=170, ignore_eos=True))
    kinds = set()
    for _ in range(steps):
        engine.step()
        kinds.add(bool(engine.runner.head.stale.any()))
    return kinds


def device_tokens(engine, row: int) -> list[int]:
    """The tokens row `row` holds on the device after the window just launched, through its next input: the
    host's tokens through the window before it (the engine processes a window's output one step late) and the
    last window's output columns (a draft head's rows keep no token history on the device)."""
    state = engine.runner.state
    seq = next(s for s in engine.scheduler.running.values() if s.row == row)
    count = int(state.out_count[row])
    tokens = list(seq.token_ids) + state.out_tokens[row, 1 : 1 + count].tolist()
    assert len(tokens) == int(state.positions[row]) + 1
    return tokens


def assert_head_state_follows(spec, reference) -> None:
    """The MTP head's invariant mid-generation (hot_mid_generation, windows alternating speculative and plain):
    each live row's head output at p - 1, or after a plain window the target's final hidden state there, equals
    `reference(history[: p + 1])` -> (head output, final hidden state), transformers' computation."""
    import torch

    turn = iter(range(1 << 30))
    spec.engine.spec_policy.speculate = lambda bucket, rows=(): next(turn) % 2 == 0
    kinds = hot_mid_generation(spec)
    state, head = spec.engine.runner.state, spec.engine.runner.head
    stats = spec.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # rounds accepting part of their drafts
    live = (~state.done).nonzero()[:, 0].tolist()
    assert len(live) == 3 and kinds == {True, False}  # windows ended plain (stale rows) and speculative
    for row in live:
        p = int(state.positions[row])
        assert p > 40
        out, final = reference(device_tokens(spec.engine, row))
        if head.stale[row]:
            torch.testing.assert_close(head.pending[row], final, atol=2e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(head.prenorm[row], out, atol=2e-4, rtol=1e-4)


def assert_head_drafts_over_stages(model: str, spec: dict, prompts: list[dict], cases: list, partition=None,
                                   **engine) -> list:
    """A draft head over two pipeline stages (replicated on every rank, reading hidden states carried across the
    hand-off and shared by the last stage) drafts what it drafts on one rank: speculating in every window, the
    same completions and the same draft and accepted counts, with drafts accepted (a hot seeded case). Returns
    the completions of each case. partition: the stages' pp_layer_partition."""
    from graphdecode import LLM

    runs = []
    for pp in (1, 2):
        stages = dict(pipeline_parallel_size=2, pp_layer_partition=partition) if pp == 2 else {}
        with LLM(model, speculative_config=spec, **stages, **engine) as llm:
            llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
            got = [completions(llm.generate(prompts, params)) for params in cases]
            stats = llm.stats()
            runs.append((got, stats["spec_draft_tokens"], stats["spec_accepted_tokens"]))
    assert runs[1] == runs[0]
    assert runs[1][1] > runs[1][2] > 0
    return runs[1][0]


def with_tokenizer(model_dir: str, tokenizer_dir: str, path) -> str:
    """A copy of `model_dir` at `path` with `tokenizer_dir`'s tokenizer files (for text prompts and constraints)."""
    shutil.copytree(model_dir, path)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return str(path)


def assert_rank_loss_named(llm, kill, match: str, limit_s: float = 30.0) -> None:
    """Start a long request on `llm`, lose a rank (`kill()`), and expect the engine's next steps to raise
    TPWorkerError matching `match` within `limit_s` (never a hang); closes `llm`."""
    from graphdecode import SamplingParams
    from graphdecode.device.tensor_parallel import TPWorkerError

    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    kill()
    start = time.monotonic()
    with pytest.raises(TPWorkerError, match=match):
        while time.monotonic() - start < 2 * limit_s:
            engine.step()
    assert time.monotonic() - start < limit_s
    llm.close()

