"""The CPU quantized panels' matmul alone against the float32 panels (BENCHMARKS section 19's microbenchmark).

SmolLM2's shapes ([3072, 576] gate_up, [576, 1536] down), 30 distinct random weights per kind so that they stream
from memory, 1, 4, 16 and 64 rows, on 1 and 2 threads: microseconds per matmul (best of 3 passes of 10 sweeps) for
float32 panels, int8, int4 (groups of 64) and FP8 (one scale per row), and the rate each streams its bytes at.

    python profiling/bench_qpanels.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphdecode.kernels.cpu import cpu_kernels  # noqa: E402
from graphdecode.models.cpu_linear import PanelWeight  # noqa: E402
from graphdecode.models.quant.linear import QuantizedWeight  # noqa: E402
from graphdecode.models.quant.tensor import QuantizedTensor  # noqa: E402

COPIES = 30  # distinct weights per kind: more than the caches hold


def best_us(fn, sweeps: int = 10) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(sweeps):
            fn()
        best = min(best, (time.perf_counter() - t0) / sweeps * 1e6)
    return best


def weights(n: int, k: int) -> dict[str, list]:
    cpu, f32 = torch.device("cpu"), torch.float32

    def quantized(values, scale, group, bits, kind=None):
        return QuantizedWeight(QuantizedTensor(values, scale, None, group, bits), f32, cpu, "panels", kind)

    def int8(kind=None):
        return quantized(torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n, 1) * 0.01, k, 8, kind)

    def int4(kind=None):
        return quantized(torch.randint(-8, 8, (n, k), dtype=torch.int8), torch.rand(n, k // 64) * 0.01, 64, 4, kind)

    kinds = {
        "fp32": [PanelWeight(torch.randn(n, k) * 0.02, cpu_kernels()) for _ in range(COPIES)],
        "int8": [int8("int8") for _ in range(COPIES)],
        "int4": [int4("int4") for _ in range(COPIES)],
        "fp8": [quantized(torch.randn(n, k).to(torch.float8_e4m3fn), torch.rand(n, 1) * 0.01, k, 8)
                for _ in range(COPIES)],
    }
    if cpu_kernels().vnni:  # the integer dot products (activations quantized per 32 columns): the default here
        kinds["int8_vnni"] = [int8("int8_vnni") for _ in range(COPIES)]
        kinds["int4_vnni"] = [int4("int4_vnni") for _ in range(COPIES)]
    return kinds


def main() -> None:
    bytes_per = {"fp32": 4, "int8": 1, "int4": 0.5, "fp8": 1, "int8_vnni": 1, "int4_vnni": 0.5}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n, k in ((3072, 576), (576, 1536)):
            kinds = weights(n, k)
            for rows in (1, 4, 16, 64):
                x = torch.randn(rows, k)
                us = {name: best_us(lambda ws=ws: [w.run(x) for w in ws]) / COPIES for name, ws in kinds.items()}
                rates = " ".join(f"{name} {n * k * bytes_per[name] / us[name] / 1e3:.1f}" for name in us)
                print(f"{threads} thread(s) [{n}, {k}] {rows} rows: "
                      + " ".join(f"{name} {v:.0f}" for name, v in us.items()) + f" us; GB/s {rates}", flush=True)


if __name__ == "__main__":
    main()
