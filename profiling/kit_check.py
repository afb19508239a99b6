#!/usr/bin/env python3
"""Informational check of the FlashInfer modules graphdecode uses, as graphdecode uses them.

Run by profiling/gpu_check.sh (stage `kit`) after the gpu-kit's environment is applied; its
exit status never fails the GPU check. It prints the flashinfer in use and whether the
prebuilt (AOT) modules graphdecode loads are there, then, with CUDA, compares against a
torch reference (bf16, page 16, NHD, GQA 4):

  * BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True, backend="fa2"), planned with
    disable_split_kv=True (as attention/flashinfer_backend.py plans it), head_dim 64 and 128
  * BatchPrefillWithPagedKVCacheWrapper(backend="fa2"), causal, head_dim 64 and 128

and nothing else of the kit (no fa3, page, sampling or use_tensor_cores=False module). The
paged-cache builder and the reference attention are the kit's own (`check.py` in the kit
folder, imported, not copied); only the wrapper calls are ours.

    python profiling/kit_check.py [--kit-dir .gpu/gpu-kit]

Output lines start with PASS / FAIL / SKIP / INFO (gpu_check.py counts them). Exit status
0 if everything that ran passed, 1 if a check failed, 2 if flashinfer does not import.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_DIMS = (64, 128)


def module_name(head_dim: int) -> str:
    """The fa2 module both wrappers load (the `_kv_stride_equal` primary prefill module)."""
    return (
        "batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_"
        f"head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0_use_swa_False_use_logits_cap_False_"
        "f16qk_False_kv_stride_equal"
    )


def load_kit_helpers(kit_dir: str):
    path = os.path.join(kit_dir, "check.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found (the kit's check.py holds the reference helpers)")
    spec = importlib.util.spec_from_file_location("gdkit_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("paged_kv", "gather_kv", "ref_attention", "TOL", "PAGE", "HQ", "HKV"):
        if not hasattr(module, name):
            raise AttributeError(f"{path} has no {name}")
    return module


def check_decode(torch, flashinfer, kit, head_dim: int, dev) -> float:
    gen = torch.Generator().manual_seed(1000 + head_dim)
    kv_lens = [1, kit.PAGE + 1, 3 * kit.PAGE - 7]  # one token, a page crossing, several pages
    cache, pages, indptr, last = kit.paged_kv(torch, kv_lens, head_dim, dev, gen)
    q = torch.randn(len(kv_lens), kit.HQ, head_dim, generator=gen).to(dev, torch.bfloat16)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True, backend="fa2")
    wrapper.plan(indptr, pages, last, kit.HQ, kit.HKV, head_dim, kit.PAGE,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=True)
    out = wrapper.run(q, cache)
    worst = 0.0
    for row, length in enumerate(kv_lens):
        k, v = kit.gather_kv(torch, cache, pages, indptr, row, length)
        expected = kit.ref_attention(torch, q[row : row + 1], k, v, causal=False)[0]
        worst = max(worst, (out[row].float() - expected).abs().max().item())
    return worst


def check_prefill(torch, flashinfer, kit, head_dim: int, dev) -> float:
    gen = torch.Generator().manual_seed(2000 + head_dim)
    query_lens, kv_lens = [3, kit.PAGE + 2], [kit.PAGE + 5, 2 * kit.PAGE + 2]
    cache, pages, indptr, last = kit.paged_kv(torch, kv_lens, head_dim, dev, gen)
    qo_indptr = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
    q = torch.randn(sum(query_lens), kit.HQ, head_dim, generator=gen).to(dev, torch.bfloat16)
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    wrapper.plan(qo_indptr, indptr, pages, last, kit.HQ, kit.HKV, head_dim, kit.PAGE, causal=True,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(q, cache)
    worst = 0.0
    for row, length in enumerate(kv_lens):
        k, v = kit.gather_kv(torch, cache, pages, indptr, row, length)
        start, end = int(qo_indptr[row]), int(qo_indptr[row + 1])
        expected = kit.ref_attention(torch, q[start:end], k, v, causal=True)
        worst = max(worst, (out[start:end].float() - expected).abs().max().item())
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kit-dir", default=os.environ.get("GPU_CHECK_KIT_DIR", os.path.join(ROOT, ".gpu", "gpu-kit")))
    args = parser.parse_args(argv)

    import torch

    try:
        import flashinfer
        import nvtx  # noqa: F401 - the kit ships these two beside flashinfer
        import tvm_ffi  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - report whatever breaks the import
        print(f"FAIL  import flashinfer, nvtx, tvm_ffi: {type(exc).__name__}: {exc}")
        return 2
    # gpu_check.py takes this line as the proof that the kit imports (the checks below are informational)
    print(f"INFO  flashinfer {flashinfer.__version__} from {os.path.dirname(flashinfer.__file__)}")
    print(f"INFO  torch {torch.__version__} (cuda {torch.version.cuda}), python {sys.version.split()[0]}")
    jit_disabled = os.environ.get("FLASHINFER_DISABLE_JIT") == "1"
    failed = 0
    try:
        from flashinfer.jit import env as jit_env

        aot_dir = jit_env.FLASHINFER_AOT_DIR
    except Exception as exc:  # noqa: BLE001
        aot_dir = None
        print(f"INFO  cannot locate flashinfer's AOT folder: {type(exc).__name__}: {exc}")
    for head_dim in HEAD_DIMS:
        name = module_name(head_dim)
        present = aot_dir is not None and os.path.isfile(os.path.join(aot_dir, name, name + ".so"))
        if present:
            print(f"PASS  prebuilt fa2 module, head_dim {head_dim}")
        elif jit_disabled:
            print(f"FAIL  prebuilt fa2 module, head_dim {head_dim}: missing and FLASHINFER_DISABLE_JIT=1 ({name})")
            failed += 1
        else:
            print(f"INFO  no prebuilt fa2 module for head_dim {head_dim}: flashinfer would JIT-compile it")

    if not torch.cuda.is_available():
        print("SKIP  kernel checks: CUDA not available")
        return 1 if failed else 0
    try:
        kit = load_kit_helpers(args.kit_dir)
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL  kit helpers: {type(exc).__name__}: {exc}")
        return 1
    dev = torch.device("cuda")
    print(f"INFO  device {torch.cuda.get_device_name(0)} sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}")
    checks = []
    for head_dim in HEAD_DIMS:
        checks.append((f"decode use_tensor_cores=True fa2 hd={head_dim}", check_decode, head_dim))
        checks.append((f"prefill fa2 causal hd={head_dim}", check_prefill, head_dim))
    kernel_failed = 0
    for name, fn, head_dim in checks:
        try:
            err = fn(torch, flashinfer, kit, head_dim, dev)
            torch.cuda.synchronize()
            ok = err <= kit.TOL
            print(f"{'PASS' if ok else 'FAIL'}  {name}: max abs err {err:.3g} (tol {kit.TOL})")
        except Exception as exc:  # noqa: BLE001 - one broken module must not hide the others
            ok = False
            first = str(exc).splitlines()[0] if str(exc) else ""
            print(f"FAIL  {name}: {type(exc).__name__}: {first}")
            traceback.print_exc(limit=3, file=sys.stdout)
        kernel_failed += not ok
    print(f"INFO  {len(checks) - kernel_failed} of {len(checks)} kernel checks passed")
    return 1 if failed or kernel_failed else 0


if __name__ == "__main__":
    sys.exit(main())
