"""The CPU kernels one call at a time beside torch's own op for the same work, at a model's shapes.

Each case alternates the kernel and its baseline `--rounds` times in one process (best of each):

* linear: `PanelWeight(invariant=True).run` (csrc/cpu_linear.cpp: fp32 FMA panels, bf16 vdpbf16ps or AMX
  tiles) against `F.linear` (oneDNN) on each projection's shape (qkv, o, gate_up, down) at `--rows`;
* swiglu: `CpuKernels.swiglu` against `F.silu(gate) * up`;
* gated one pass (where the intermediate size is a whole number of 64-column panels):
  `CpuKernels.panel_linear_swiglu` (the gate_up projection and its SwiGLU in one pass, as the engine runs it)
  against the two passes it replaces (`PanelWeight.run`, then `CpuKernels.swiglu`): its
  baseline is graphdecode's own, not torch's;
* down + residual (one pass): `CpuKernels.panel_linear_add` (down_proj and the layer's residual add in one pass)
  against `residual + PanelWeight.run(x)`, graphdecode's own two ops;
* prefill attention: `CpuKernels.prefill_attention` over a paged cache, one layer, one causal prompt of `--rows`
  tokens, against SDPA's flash kernel on the same K / V, contiguous and repeated to every query head.

Prints a table of milliseconds and kernel / baseline; returns the rows (BENCHMARKS.md sections 18f, 18g).

    python profiling/bench_cpu_kernels.py --threads 2 --dtype bfloat16 --rows 512,2048
"""

from __future__ import annotations

import argparse
import time


def _best(fns: dict, rounds: int) -> dict:
    """Each callable once to warm up, then `rounds` alternating timed calls: the best seconds of each."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="512,2048", help="rows (tokens) per call, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--shape", default="576,1536,9,3,64",
                   help="hidden, intermediate, heads, kv heads, head dim (default: SmolLM2-135M's)")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from graphdecode.kernels.cpu import cpu_kernels
    from graphdecode.models.cpu_linear import PanelWeight

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("needs the CPU kernels (a C++ compiler)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hidden, inter, heads, kv_heads, head_dim = (int(v) for v in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    projections = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                   "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        cases = {}
        for name, (n, k) in projections.items():
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            x = torch.randn(rows, k, generator=g).to(dtype)
            panels = PanelWeight(w, kernels, invariant=True)
            cases[f"linear {name}"] = ((lambda p=panels, x=x: p.run(x)), (lambda w=w, x=x: F.linear(x, w)),
                                       2 * rows * n * k)
        gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)

        def torch_swiglu(gate_up=gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        cases["swiglu"] = ((lambda: kernels.swiglu(gate_up)), torch_swiglu, 0)
        if inter % 64 == 0:
            w = (torch.randn(2 * inter, hidden, generator=g) * 0.05).to(dtype)
            x = torch.randn(rows, hidden, generator=g).to(dtype)
            gated = PanelWeight(w, kernels, invariant=True)
            cases["gated one pass"] = ((lambda x=x: kernels.panel_linear_swiglu(x, gated.panels, inter)),
                                       (lambda x=x: kernels.swiglu(gated.run(x))),
                                       2 * rows * 2 * inter * hidden)
        w = (torch.randn(hidden, inter, generator=g) * 0.05).to(dtype)
        x = torch.randn(rows, inter, generator=g).to(dtype)
        residual = torch.randn(rows, hidden, generator=g).to(dtype)
        down = PanelWeight(w, kernels, invariant=True)
        cases["down + residual"] = ((lambda x=x: kernels.panel_linear_add(x, down.panels, hidden, residual)),
                                    (lambda x=x: residual + down.run(x)), 2 * rows * hidden * inter)
        page = 16
        pages = -(-rows // page)
        kv = torch.randn(pages, 2, page, kv_heads, head_dim, generator=g).to(dtype)
        q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
        table = torch.arange(pages, dtype=torch.int32).view(1, -1)
        lens = torch.tensor([rows])
        keys, values = (kv[:, i].reshape(-1, kv_heads, head_dim)[:rows].transpose(0, 1)
                        .repeat_interleave(heads // kv_heads, 0).unsqueeze(0).contiguous() for i in (0, 1))
        qt = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, heads, rows, head_dim]: SDPA's flash kernel
        cases["prefill attention"] = (
            (lambda: kernels.prefill_attention(q, kv, table, torch.tensor([0]), lens, lens, scale=head_dim**-0.5)),
            (lambda: F.scaled_dot_product_attention(qt, keys, values, is_causal=True)),
            2 * 2 * heads * head_dim * rows * (rows + 1) // 2)
        for name, (kernel, baseline, flops) in cases.items():
            best = _best({"kernel": kernel, "torch": baseline}, args.rounds)
            row = {"case": name, "rows": rows, "dtype": args.dtype, "threads": args.threads,
                   "kernel_ms": best["kernel"] * 1e3, "torch_ms": best["torch"] * 1e3,
                   "ratio": best["kernel"] / best["torch"]}
            if flops:
                row["kernel_gflops"] = flops / best["kernel"] / 1e9
            results.append(row)
    print(f"| {args.dtype}, {args.threads} threads | rows | kernel ms | baseline ms | kernel / baseline "
          f"| kernel GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        gflops = f"{r['kernel_gflops']:.0f}" if "kernel_gflops" in r else "-"
        print(f"| {r['case']} | {r['rows']} | {r['kernel_ms']:.3f} | {r['torch_ms']:.3f} | {r['ratio']:.2f}x "
              f"| {gflops} |")
    return results


if __name__ == "__main__":
    main()
