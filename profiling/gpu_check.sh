#!/usr/bin/env bash
# The one script for a lent GPU (one H200, torch cu130, Python 3.12, no network, no flashinfer).
# The stages are run by profiling/gpu_check.py (its docstring and docs/gpu.md say what each proves),
# the must-pass core first (about 240 s by its estimates; summary.json's must_pass says which passed):
#
#   core:  env  kit  build  pytest_advance_step  pytest_flashinfer  pytest_hf_parity  pytest_graphs
#   then:  pytest_extended  bench  bench_spec  pytest_compile  bench_tp  bench_serve  bench_structured
#          bench_moe  bench_compiled
#
# each in its own process group under its own time limit, cut to what is left of the budget
# (--budget S or GPU_CHECK_BUDGET_S, default 420 s). A stage is not started with less budget left
# than its estimated need; one stopped by the budget is `cut`, not failed. $OUT/summary.json is
# rewritten as each stage starts and ends and when the script is terminated; the summary table is
# printed last and ends with the command that reruns what failed, was cut or did not fit. $OUT
# holds 4 files: gpu_check.log, summary.json, bench_buckets.json, bench_buckets_compiled.json.
#
# Before the device call, once per checkout: copy the kit into the git-ignored .gpu/ and download
# the server stage's wheels (fastapi, uvicorn, openai, ...; profiling/gpu_wheels.txt) for Python 3.12:
#   bash profiling/gpu_check.sh --prepare     # the kit from ../shared/gpu-kit, or $GDKIT_SRC
# The device call (see docs/gpu.md):
#   run(command="bash profiling/gpu_check.sh", carry=[".gpu"], timeout_s=480)
# Rerun some stages:  bash profiling/gpu_check.sh --only bench,pytest_graphs --budget 200   (env always runs;
#                     --only core: the must-pass core)
# Rehearse on CPU:    bash profiling/gpu_check.sh --dry-run                    (tests/gpu/test_gpu_check.py)
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

if [ "${1:-}" = "--prepare" ]; then
  SRC="${GDKIT_SRC:-../shared/gpu-kit}"                 # relative to the repository root
  KIT="${GPU_CHECK_KIT_DIR:-.gpu/gpu-kit}"
  WHEELS="${GPU_CHECK_WHEELS_DIR:-.gpu/wheels}"
  [ -f "$SRC/setup.sh" ] || { echo "no gpu-kit at $SRC (set GDKIT_SRC)"; exit 1; }
  [ -d "$KIT" ] && chmod -R u+w "$KIT"
  mkdir -p "$(dirname "$KIT")" && rm -rf "$KIT" && cp -r "$SRC" "$KIT" && chmod -R u+w "$KIT" || exit 1
  git check-ignore -q "$KIT" || echo "warning: $KIT is not git-ignored: it would travel twice"
  du -sh "$KIT"
  if [ "${GPU_CHECK_NO_WHEELS:-}" = "1" ]; then
    echo "GPU_CHECK_NO_WHEELS=1: no wheels downloaded (bench_serve skips where its packages are missing)"
    exit 0
  fi
  # bench_serve's packages that the GPU machine's image lacks, pure Python or cp312 manylinux builds;
  # gpu_check installs them there with pip --no-index --target (no network).
  rm -rf "$WHEELS" && mkdir -p "$WHEELS" || exit 1
  if "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS" -r profiling/gpu_wheels.txt; then
    ls "$WHEELS"
    du -sh "$WHEELS"
  else
    echo "warning: the wheels could not be downloaded: bench_serve will be skipped where its packages are missing"
    rm -rf "$WHEELS"
  fi
  exit 0
fi

PY="${PYTHON:-python3}"
export PYTHON="$PY"
exec "$PY" "$ROOT/profiling/gpu_check.py" "$@"
