"""The automatic attention backend never picks something that cannot run, and an explicit
FlashInfer that cannot run is refused by name before any work.

The decision is tested with a stand-in probe; the probe itself against flashinfer
0.7.2's real module naming and lookup (when flashinfer is importable: CI installs its
Python package), with a fake prebuilt-module directory.
"""

from __future__ import annotations

import logging

import pytest
import torch

from graphdecode.config import choose_attention_backend

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def can_run(head_dim, dtype):
    return None


def cannot_run(head_dim, dtype):
    return f"no prebuilt kernel module for head_dim {head_dim} and dtype {dtype}"


def test_auto_picks_flashinfer_only_when_it_can_run(caplog):
    assert choose_attention_backend(None, CUDA, torch.bfloat16, 64, probe=can_run) == "flashinfer"
    with caplog.at_level(logging.WARNING, logger="graphdecode"):
        assert choose_attention_backend(None, CUDA, torch.bfloat16, 32, probe=cannot_run) == "torch"
    (record,) = caplog.records
    assert "torch" in record.getMessage() and "head_dim 32" in record.getMessage()
    assert choose_attention_backend(None, CPU, torch.bfloat16, 64, probe=can_run) == "torch"


def test_explicit_flashinfer_that_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="head_dim 32"):
        choose_attention_backend("flashinfer", CUDA, torch.bfloat16, 32, probe=cannot_run)
    with pytest.raises(ValueError, match="CUDA"):
        choose_attention_backend("flashinfer", CPU, torch.bfloat16, 64, probe=can_run)
    with pytest.raises(ValueError, match="attention_backend"):
        choose_attention_backend("magic", CUDA, torch.bfloat16, 64, probe=can_run)
    assert choose_attention_backend("torch", CUDA, torch.float32, 32, probe=cannot_run) == "torch"


@pytest.fixture
def probe_env(monkeypatch, tmp_path):
    pytest.importorskip("flashinfer")
    from flashinfer.jit import env as jit_env

    from graphdecode.attention import flashinfer_probe

    monkeypatch.setattr(jit_env, "FLASHINFER_AOT_DIR", tmp_path / "aot")
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "jit")
    flashinfer_probe.flashinfer_unavailable_reason.cache_clear()
    yield flashinfer_probe, tmp_path
    flashinfer_probe.flashinfer_unavailable_reason.cache_clear()


def _install(root, name):
    (root / name).mkdir(parents=True)
    (root / name / f"{name}.so").write_bytes(b"")


def test_probe_finds_prebuilt_and_jit_cached_modules(probe_env, monkeypatch):
    probe, tmp = probe_env
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")  # as the gpu-kit sets it
    name64 = probe.kernel_module_name(64, torch.bfloat16)
    assert name64.startswith("batch_prefill_with_kv_cache_dtype_q_bf16") and "head_dim_qk_64" in name64
    assert name64.endswith("_kv_stride_equal")  # the module the gpu-kit ships for our wrappers
    _install(tmp / "aot", name64)
    _install(tmp / "jit", probe.kernel_module_name(128, torch.float16))
    assert probe.flashinfer_unavailable_reason(64, torch.bfloat16) is None
    assert probe.flashinfer_unavailable_reason(128, torch.float16) is None
    reason = probe.flashinfer_unavailable_reason(128, torch.bfloat16)
    assert "head_dim 128" in reason and "bfloat16" in reason and "FLASHINFER_DISABLE_JIT" in reason
    assert "head_dim 32" in probe.flashinfer_unavailable_reason(32, torch.bfloat16)
    assert "float32" in probe.flashinfer_unavailable_reason(64, torch.float32)
    with pytest.raises(ValueError, match="head_dim 128"):
        choose_attention_backend("flashinfer", CUDA, torch.bfloat16, 128)


def test_probe_allows_jit_only_with_nvcc(probe_env, monkeypatch):
    probe, tmp = probe_env
    monkeypatch.delenv("FLASHINFER_DISABLE_JIT", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp))  # no nvcc on it
    assert "nvcc" in probe.flashinfer_unavailable_reason(64, torch.bfloat16)
    probe.flashinfer_unavailable_reason.cache_clear()
    (tmp / "cuda" / "bin").mkdir(parents=True)
    (tmp / "cuda" / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp / "cuda"))
    assert probe.flashinfer_unavailable_reason(64, torch.bfloat16) is None  # flashinfer compiles it at first use


def test_gpu_tests_skip_through_the_engines_probe(probe_env, monkeypatch):
    """The GPU tests' `require_flashinfer` asks the same probe: with the gpu-kit's bf16 modules
    and JIT off, fp16 skips (it used to fail the stage with the engine's ValueError), bf16 runs,
    and under gpu_check a combination the kit promises fails instead of skipping."""
    from tests.helpers import require_flashinfer

    probe, tmp = probe_env
    monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")
    _install(tmp / "aot", probe.kernel_module_name(64, torch.bfloat16))
    monkeypatch.delenv("GRAPHDECODE_REQUIRE_FLASHINFER", raising=False)
    require_flashinfer(64, torch.bfloat16)  # runs
    with pytest.raises(pytest.skip.Exception, match="head_dim 64 torch.float16.*FLASHINFER_DISABLE_JIT"):
        require_flashinfer(64, "float16")
    with pytest.raises(ValueError, match="head_dim 64"):  # where the engine refuses, the test skipped
        choose_attention_backend("flashinfer", CUDA, torch.float16, 64)
    monkeypatch.setenv("GRAPHDECODE_REQUIRE_FLASHINFER", "1")
    with pytest.raises(pytest.skip.Exception):
        require_flashinfer(64, torch.float16)  # not in the kit: still a skip
    with pytest.raises(pytest.fail.Exception, match="gpu-kit promises FlashInfer for head_dim 128"):
        require_flashinfer(128, torch.bfloat16)  # in the kit's list but missing: a broken kit fails
