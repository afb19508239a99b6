#!/usr/bin/env bash
# The one script for a lent GPU (one H200, torch cu130, Python 3.12, no network, no flashinfer).
#
# Stages, each with its own time limit, each logged, the next one running even if one fails:
#   env        GPU, driver, python and package versions
#   kit        FlashInfer from the gpu-kit (carried in .gpu/gpu-kit), plus the kit's own smoke test
#   build      csrc/ with nvcc (sm_90 + PTX) into graphdecode/_kernels
#   pytest     pytest -m gpu (CUDA advance_step, FlashInfer vs torch reference, graph runner)
#   bench      the bucket sweep on a random bf16 model shaped like Llama-3.2-1B (forward eager
#              inside the graphs), then, if time is left, a torch.compile'd subset (bench_compiled)
# Everything lands in $OUT (at most 8 files come back): gpu_check.log (all output),
# pytest_gpu.xml, bench_buckets.{json,png}, bench_buckets_compiled.{json,png}, summary.json.
# A summary is printed last.
#
# Before the device call, once per checkout (copies the kit into the git-ignored .gpu/):
#   bash profiling/gpu_check.sh --prepare            # from /work/shared/gpu-kit, or $GDKIT_SRC
# The device call (see docs/gpu.md):
#   run(command="bash profiling/gpu_check.sh", carry=[".gpu"], timeout_s=540)
# Total budget: GPU_CHECK_BUDGET_S (default 450 s) for all stages, under the 8 minutes allowed.
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

OUT="${OUT:-$ROOT/profiling/out/gpu_check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1
export GRAPHDECODE_CACHE="${GRAPHDECODE_CACHE:-/tmp/graphdecode-cache}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
START=$SECONDS
STAGES=()
declare -A RC DUR

left() { echo $(( BUDGET - (SECONDS - START) )); }

# stage NAME LIMIT_S COMMAND...: run under `timeout`, cut to what is left of the budget
stage() {
  local name=$1 limit=$2 budget_left
  shift 2
  budget_left=$(left)
  (( limit > budget_left )) && limit=$budget_left
  STAGES+=("$name")
  if (( limit < 15 )); then
    echo "=== [$name] skipped: budget spent"
    RC[$name]=skipped; DUR[$name]=0
    return
  fi
  echo "=== [$name] start $(date +%T), limit ${limit}s"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  RC[$name]=$?
  DUR[$name]=$(( SECONDS - t0 ))
  echo "=== [$name] rc=${RC[$name]} in ${DUR[$name]}s$( [ "${RC[$name]}" = 124 ] && echo ' (TIMED OUT)')"
}

# ------------------------------------------------------------------ env
echo "=== gpu_check $(date -u +%FT%TZ) in $ROOT, OUT=$OUT, budget ${BUDGET}s"
git log -1 --format='commit %H %s' 2>/dev/null
git status --short 2>/dev/null | head -20
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
nvcc --version 2>&1 | tail -1
"$PY" - <<'EOF' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "matplotlib"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:  # report and go on: later stages say what it breaks
        print(f"{name} MISSING ({type(exc).__name__}: {exc})")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-",
      torch.cuda.get_device_capability() if torch.cuda.is_available() else "-")
EOF

# ------------------------------------------------------------------ kit
STAGES+=("kit")
if [ -f .gpu/gpu-kit/setup.sh ]; then
  KIT_ENV="$(bash .gpu/gpu-kit/setup.sh)"
  eval "$KIT_ENV"
  RC[kit]=$?
else
  echo "=== [kit] .gpu/gpu-kit is missing: was it prepared (--prepare) and carried (carry=[\".gpu\"])?"
  RC[kit]=missing
fi
DUR[kit]=$(( SECONDS - START ))
# for a dry run of this script elsewhere (e.g. cp311 tvm_ffi/nvtx ahead of the kit's cp312 ones)
[ -n "${GPU_CHECK_PYTHONPATH_FIRST:-}" ] && export PYTHONPATH="$GPU_CHECK_PYTHONPATH_FIRST:$PYTHONPATH"
"$PY" -c "import flashinfer, tvm_ffi, nvtx; print('flashinfer', flashinfer.__version__, flashinfer.__file__)" \
  2>&1 || RC[kit]=import-failed
echo "=== [kit] rc=${RC[kit]}"
if [ -f .gpu/gpu-kit/check.py ]; then
  stage kit_check 90 "$PY" .gpu/gpu-kit/check.py
fi

# ------------------------------------------------------------------ build
stage build 120 "$PY" - <<'EOF'
import os, time, torch
from graphdecode.compiled import cuda_kernels, kernel_build
cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
out = os.path.join(kernel_build.package_dir(), "_kernels", kernel_build.LIB_NAME)
t0 = time.perf_counter()
kernel_build.build(out, kernel_build.source_dir(), kernel_build.arch_flags_for(cap))
lib = cuda_kernels.open_library(out)
print(f"built {out} for {cap} in {time.perf_counter() - t0:.1f}s, ABI {lib.graphdecode_kernels_abi_version()}")
assert cuda_kernels.library_path() == out, "the loader does not pick the packaged library"
EOF

# ------------------------------------------------------------------ pytest -m gpu
PYTEST_ARGS=(-m gpu -v -rs -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml")
"$PY" -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout=150)
if [ "${RC[kit]}" = 0 ]; then REQUIRE=1; else REQUIRE=0; fi  # with a working kit, FlashInfer tests must not skip
stage pytest 270 env CUBLAS_WORKSPACE_CONFIG=:4096:8 GRAPHDECODE_REQUIRE_FLASHINFER=$REQUIRE \
  "$PY" -m pytest "${PYTEST_ARGS[@]}" tests

# ------------------------------------------------------------------ bench
# First the whole sweep with the forward eager inside the CUDA graphs: torch.compile of a 16-layer
# model costs tens of seconds per bucket on a cold machine (9 buckets x 2 values of k), which would
# eat the budget before the first point. Then, with what is left, a compiled subset.
stage bench "$(left)" "$PY" profiling/bench_buckets.py --preset llama-3.2-1b --device cuda --dtype bfloat16 \
  --buckets 1,2,4,8,16,32,64,128,256 --steps 1,8 --prompt-len 128 --gen-len 128 --compile off \
  --out "$OUT/bench_buckets"
if (( $(left) >= 120 )); then
  stage bench_compiled "$(left)" "$PY" profiling/bench_buckets.py --preset llama-3.2-1b --device cuda \
    --dtype bfloat16 --buckets 1,16,128 --steps 8 --prompt-len 128 --gen-len 128 --compile on --no-baseline \
    --out "$OUT/bench_buckets_compiled"
fi

# ------------------------------------------------------------------ summary
RESULTS=""
for name in "${STAGES[@]}"; do RESULTS+="$name=${RC[$name]}:${DUR[$name]} "; done
"$PY" - "$OUT" "$RESULTS" $(( SECONDS - START )) <<'EOF'
import json, os, sys
import xml.etree.ElementTree as ET

out, results, total = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
stages = {}
for item in results:
    name, rest = item.split("=", 1)
    rc, seconds = rest.rsplit(":", 1)
    stages[name] = {"rc": rc, "seconds": int(seconds), "ok": rc == "0"}
summary = {"stages": stages, "seconds": total}
xml_path = os.path.join(out, "pytest_gpu.xml")
if os.path.isfile(xml_path):
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary["pytest"] = {**counts, "failed": failed}
bench = os.path.join(out, "bench_buckets.json")
summary["bench_json"] = os.path.isfile(bench)
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
print("=" * 60)
print(f"gpu_check summary ({total}s)")
for name, s in stages.items():
    print(f"  {name:<10} {'ok' if s['ok'] else 'FAIL rc=' + s['rc']:<16} {s['seconds']:>4}s")
if "pytest" in summary:
    p = summary["pytest"]
    print(f"  pytest: {p['tests']} tests, {p['failures']} failures, {p['errors']} errors, {p['skipped']} skipped")
    for name in p["failed"]:
        print(f"    FAILED {name}")
print(f"  bench json: {'written' if summary['bench_json'] else 'MISSING'}")
print("  files:", ", ".join(sorted(os.listdir(out))))
EOF
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null  # the log is complete before the device tool collects $OUT
exit 0
