#!/usr/bin/env bash
# Profile a short bucket sweep under Nsight Systems, with graphdecode's nvtx ranges
# (graphdecode.schedule / launch / prefill / window / pythonize, see docs/profiling.md).
#
#   bash profiling/nsys.sh [OUT_DIR] [extra bench_buckets.py args...]
#
# Needs nsys on PATH (or NSYS=/path/to/nsys) and a CUDA device; without nsys it says
# so and exits 0 (nothing to do), so a GPU check script may call it unconditionally.
# Writes OUT_DIR/graphdecode.nsys-rep, the sweep's JSON/PNG, and OUT_DIR/nvtx_sum.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-profiling/out}/nsys}
shift || true
NSYS=${NSYS:-$(command -v nsys || true)}
if [[ -z "$NSYS" || ! -x "$NSYS" ]]; then
    echo "nsys.sh: nsys not found (set NSYS=/path/to/nsys); skipped" >&2
    exit 0
fi
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
"$NSYS" profile --trace=cuda,nvtx,osrt --sample=none --force-overwrite=true \
    --output="$OUT_DIR/graphdecode" \
    "$PY" profiling/bench_buckets.py --preset "${PRESET:-micro}" --buckets 1,16 --steps 8 \
    --prompt-len 32 --gen-len 32 --no-baseline --out "$OUT_DIR/bench_buckets" "$@"
"$NSYS" stats --report nvtx_sum --format table "$OUT_DIR/graphdecode.nsys-rep" | tee "$OUT_DIR/nvtx_sum.txt" \
    || echo "nsys.sh: nsys stats failed; the .nsys-rep is still in $OUT_DIR" >&2
