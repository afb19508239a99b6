"""Bucket sweep: tokens/s, ms per decode step, host ms per window, padding waste and
memory for each (batch bucket, k), beside transformers `generate` (static cache,
greedy) on the same model and lengths. Writes PREFIX.json, PREFIX.png, prints a table.

    python profiling/bench_buckets.py --preset micro --buckets 1,4,16,64 --steps 1,8
    python profiling/bench_buckets.py --preset llama-3.2-1b --device cuda --dtype bfloat16 \
        --buckets 1,2,4,8,16,32,64,128,256 --steps 1,8 --prompt-len 128 --gen-len 128 --out $OUT/bench_buckets

The implementation is graphdecode.bench.sweep (also `graphdecode bench`).
"""

from graphdecode.bench.sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
