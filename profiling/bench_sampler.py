"""Sampler cost per step: the int32 noise hash against the int64 one it replaced, and the
stop-id mask in place / skipped against the out-of-place scatter it replaced, side by side.

    python profiling/bench_sampler.py --rows 64 --vocab 128256 --device cpu

Each variant is timed as the median of --repeats calls (after warm-up; CUDA synchronised).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from graphdecode.device import sampler as S


def _noise_int64(seed, position, keys64):
    """The previous implementation: the whole [R, V] hash on int64."""
    bits = S.hash32(S.row_keys(seed, position)[:, None] ^ keys64[None, :]) >> (32 - S.NOISE_BITS)
    return S.unit_interval(bits)


def _mask_out_of_place(logits, rows, next_pos):
    blocked = (next_pos < rows.min_len)[:, None] & (rows.stop_ids >= 0)
    penalty = torch.where(blocked, float("-inf"), 0.0)
    return logits.scatter_add(1, rows.stop_ids.clamp(min=0), penalty)


def _time(fn, device, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="write a JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    seed = torch.randint(0, 1 << 62, (args.rows,), generator=g).to(device)
    pos = torch.randint(0, 4096, (args.rows,), generator=g).to(device)
    keys32 = S.make_vocab_keys(args.vocab, device)
    keys64 = S.hash32(torch.arange(args.vocab, dtype=torch.int64, device=device) + 0x5BD1E995)
    logits = torch.randn(args.rows, args.vocab, generator=g).to(device)
    rows = S.SamplingRows(
        temperature=torch.ones(args.rows, device=device), top_p=torch.ones(args.rows, device=device),
        top_k=torch.zeros(args.rows, dtype=torch.int32, device=device), min_p=torch.zeros(args.rows, device=device),
        seed=seed, stop_ids=torch.full((args.rows, 4), 2, dtype=torch.int64, device=device),
        min_len=torch.full((args.rows,), 8192, dtype=torch.int32, device=device),
        max_len=torch.full((args.rows,), 8192, dtype=torch.int32, device=device),
    )
    assert torch.equal(S.uniform_noise(seed, pos, keys32), _noise_int64(seed, pos, keys64))
    sampler = S.Sampler(args.vocab, device)
    result = {
        "rows": args.rows, "vocab": args.vocab, "device": str(device),
        "ms": {
            "noise_int64 (before)": _time(lambda: _noise_int64(seed, pos, keys64), device, args.repeats),
            "noise_int32 (now)": _time(lambda: S.uniform_noise(seed, pos, keys32), device, args.repeats),
            "mask out of place (before, every step)": _time(lambda: _mask_out_of_place(logits, rows, pos), device,
                                                            args.repeats),
            "mask in place (now, min_tokens windows only)": _time(lambda: S._mask_stop_ids_(logits, rows, pos),
                                                                  device, args.repeats),
            "sample step, SAMPLE variant (now)": _time(
                lambda: sampler(logits.clone(), rows, pos, S.SamplerVariant(S.SamplerMode.SAMPLE)), device,
                args.repeats),
            "sample step, GREEDY variant (now)": _time(lambda: sampler(logits.clone(), rows, pos, S.GREEDY), device,
                                                       args.repeats),
        },
    }
    for name, ms in result["ms"].items():
        print(f"{name:<48} {ms:8.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
