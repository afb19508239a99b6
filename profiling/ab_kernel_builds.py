"""Two or more builds of the CPU kernels side by side in one process: the panel linears on SmolLM2-135M's four
projections (gate_up, qkv, down, o), alternating calls, best of `--rounds`, each build's summed time over oneDNN's
(`F.linear`) at each row count. Build each variant first, e.g. from a checkout of the old sources:

    g++ -O3 -march=native -fno-math-errno -std=c++17 -shared -fPIC -fopenmp -o /tmp/old.so <old csrc>/cpu_*.cpp
    python profiling/ab_kernel_builds.py --libraries /tmp/old.so,/tmp/new.so --rows 1,16,64,512,2048 --threads 2

`--dtype bfloat16` runs bf16 weights and rows (the panels widen them; oneDNN's bf16 GEMM beside them).

(BENCHMARKS.md 18h.) The builds must carry this checkout's kernel ABI.
"""

from __future__ import annotations

import argparse
import os
import time

SHAPES = [(3072, 576), (960, 576), (576, 1536), (576, 576)]  # [N, K]: gate_up, qkv, down, o


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--libraries", required=True, help="comma-separated paths of kernel builds")
    p.add_argument("--rows", default="1,16,64,512,2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' and rows' dtype")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from graphdecode.kernels.cpu import CpuKernels
    from graphdecode.models.cpu_linear import PanelWeight

    torch.set_num_threads(args.threads)
    builds = {os.path.basename(path): CpuKernels(path) for path in args.libraries.split(",")}
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        total = dict.fromkeys([*builds, "oneDNN"], 0.0)
        for n, k in SHAPES:
            w, x = (torch.randn(n, k, generator=g) * 0.05).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
            fns = {name: (lambda p=PanelWeight(w, kernels, invariant=True), x=x: p.run(x))
                   for name, kernels in builds.items()}
            fns["oneDNN"] = lambda w=w, x=x: F.linear(x, w)
            best = dict.fromkeys(fns, float("inf"))
            for fn in fns.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    start = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - start)
            for name in fns:
                total[name] += best[name]
        results[rows] = total
        print(f"{rows:5d} rows: " + "  ".join(f"{name} {t * 1e3:.2f} ms ({t / total['oneDNN']:.3f}x oneDNN)"
                                            for name, t in total.items()))
    return results


if __name__ == "__main__":
    main()
