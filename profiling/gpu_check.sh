#!/usr/bin/env bash
# The one script for a lent GPU (one H200, torch cu130, Python 3.12, no network, no flashinfer).
# The stages are run by profiling/gpu_check.py (its docstring and docs/gpu.md say what each proves):
#
#   env  kit  build  pytest_advance_step  pytest_flashinfer  pytest_graphs  pytest_hf_parity
#   bench  bench_spec  bench_tp  bench_serve  bench_compiled
#
# each in its own process group under its own time limit, cut to what is left of the budget
# (GPU_CHECK_BUDGET_S, default 300 s, so that a failed run can be rerun at once in the same
# device slot); a failed or timed-out stage does not stop the next. $OUT/summary.json is
# rewritten as each stage starts and ends and when the script is terminated; the summary table
# is printed last. $OUT holds at most 8 files: gpu_check.log, summary.json, pytest_<name>.xml
# (one per test file), bench_buckets.json, bench_buckets_compiled.json.
#
# Before the device call, once per checkout (copies the kit into the git-ignored .gpu/):
#   bash profiling/gpu_check.sh --prepare            # from /work/shared/gpu-kit, or $GDKIT_SRC
# The device call (see docs/gpu.md):
#   run(command="bash profiling/gpu_check.sh", carry=[".gpu"], timeout_s=360)
# Rerun some stages:  bash profiling/gpu_check.sh --only bench,pytest_graphs   (env always runs)
# Rehearse on CPU:    bash profiling/gpu_check.sh --dry-run                    (tests/test_gpu_check.py)
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1

if [ "${1:-}" = "--prepare" ]; then
  SRC="${GDKIT_SRC:-/work/shared/gpu-kit}"
  [ -f "$SRC/setup.sh" ] || { echo "no gpu-kit at $SRC (set GDKIT_SRC)"; exit 1; }
  [ -d .gpu/gpu-kit ] && chmod -R u+w .gpu/gpu-kit
  mkdir -p .gpu && rm -rf .gpu/gpu-kit && cp -r "$SRC" .gpu/gpu-kit && chmod -R u+w .gpu/gpu-kit || exit 1
  git check-ignore -q .gpu/gpu-kit || echo "warning: .gpu/ is not git-ignored: it would travel twice"
  du -sh .gpu/gpu-kit
  exit 0
fi

PY="${PYTHON:-python3}"
export PYTHON="$PY"
exec "$PY" "$ROOT/profiling/gpu_check.py" "$@"
