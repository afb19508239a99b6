"""Can FlashInfer run our attention for (head_dim, dtype) on this machine? Asked before any work.

Both of our FlashInfer paths (tensor-core decode and fa2 prefill) load one kernel
module: flashinfer 0.7.2's fa2 batch-prefill module with equal K/V strides, named by
dtype and head_dim. It is usable when a prebuilt (AOT) copy or a JIT-cache copy of it
exists, or when flashinfer may compile it now (JIT not disabled and nvcc found). The
probe reads file names only: it neither builds nor loads anything, so it costs
milliseconds and never crashes later inside plan().

`flashinfer_unavailable_reason` returns None when FlashInfer can run, else a sentence
saying why not; the engine config uses it to fall back to the torch backend (auto
choice) or to refuse an explicit `attention_backend="flashinfer"` by name.

A sliding window or a logits soft-cap is a template parameter of that module (its name
says `use_swa_True` / `use_logits_cap_True`), so a model with such layers needs another
module, and so does an FP8 KV cache (`dtype_kv_e4m3`): `variant_unavailable_reason` asks
the same question for it, and the backend runs the layers whose variant is missing with the
torch reference (one log line says so).
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # what flashinfer's fa2 templates are instantiated for
_PAGED_KV_STRIDE_MODE = "equal"  # our cache holds K and V of a page side by side: equal strides


def kernel_module_name(head_dim: int, dtype: torch.dtype, sliding_window: bool = False,
                       soft_cap: bool = False, kv_dtype: torch.dtype | None = None) -> str:
    """The module our wrappers load (BatchPrefill fa2 / BatchDecode with tensor cores) for a variant
    (kv_dtype: an FP8 cache's; None: the queries' dtype)."""
    from flashinfer.jit.attention import modules

    base = modules.get_batch_prefill_uri(
        "fa2", dtype, kv_dtype or dtype, dtype, torch.int32, head_dim, head_dim, 0, sliding_window, soft_cap, False
    )
    return modules._get_batch_prefill_module_uri(base, "fa2", _PAGED_KV_STRIDE_MODE, "full")


def _module_present(name: str) -> bool:
    from flashinfer.jit import env as jit_env

    if jit_env.get_aot_path(name).is_file():
        return True
    return (jit_env.FLASHINFER_JIT_DIR / name / f"{name}.so").is_file()


def _can_compile() -> str | None:
    """None when flashinfer may JIT-compile a module now, else why not."""
    if os.environ.get("FLASHINFER_DISABLE_JIT"):
        return "JIT compilation is disabled (FLASHINFER_DISABLE_JIT)"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if shutil.which("nvcc") is None and not (cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc"))):
        return "nvcc is not available to compile it"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def flashinfer_unavailable_reason(head_dim: int, dtype: torch.dtype) -> str | None:
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {_name(dtype)} is not supported by FlashInfer attention (bfloat16 or float16)"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not supported by FlashInfer attention (one of {SUPPORTED_HEAD_DIMS})"
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - a broken install (missing CUDA libs, ABI) counts as absent
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return _module_unavailable_reason(
        lambda: kernel_module_name(head_dim, dtype),
        lambda name: f"no prebuilt kernel module for head_dim {head_dim} and dtype {_name(dtype)} ({name})")


def _module_unavailable_reason(module_name, missing) -> str | None:
    """None when the module `module_name()` names is prebuilt here or flashinfer can compile it at
    first use; else why not (`missing(name)` says which module, then why it cannot be compiled)."""
    try:
        name = module_name()
        if _module_present(name):
            return None
    except Exception as exc:  # noqa: BLE001 - private helpers of one flashinfer release: never crash the config
        return f"could not probe flashinfer's kernel modules ({type(exc).__name__}: {exc})"
    why_not = _can_compile()
    return None if why_not is None else f"{missing(name)}, and {why_not}"


@functools.cache
def variant_unavailable_reason(head_dim: int, dtype: torch.dtype, sliding_window: bool, soft_cap: bool,
                               kv_dtype: torch.dtype | None = None) -> str | None:
    """None when the module for this attention variant (an FP8 cache's kv_dtype among them) can be loaded
    (or compiled) here, else why not. The plain variant is flashinfer_unavailable_reason's question (asked by
    the engine config)."""
    kv_dtype = None if kv_dtype == dtype else kv_dtype
    if not (sliding_window or soft_cap or kv_dtype is not None):
        return None
    return _module_unavailable_reason(lambda: kernel_module_name(head_dim, dtype, sliding_window, soft_cap, kv_dtype),
                                      lambda name: f"no prebuilt kernel module {name}")
