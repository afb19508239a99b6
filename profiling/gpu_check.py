#!/usr/bin/env python3
"""The GPU check's driver (entry point: `bash profiling/gpu_check.sh`, which also does --prepare).

Runs the stages below in order, each in its own process group under its own time limit cut to
what is left of the budget (--budget S, GPU_CHECK_BUDGET_S, default 420 s). The first seven are
the must-pass core (CORE: about 240 s by their estimated needs): they prove the GPU path works
and run before anything else; summary.json's `must_pass` says which of them passed. A stage is
not started with less budget left than its estimated need (skipped, with the --only command that
runs it); one stopped because the budget ran out is `cut`, not failed; one that hit its own limit
is a `timeout` (a failure). A failed stage does not stop the next. $OUT/summary.json is rewritten
when each stage starts and ends, and on SIGTERM/SIGINT (the running stage's processes are stopped
first), so whatever happens it says how far the check got. A compact table is printed last,
ending with the exact command that reruns what failed, was cut or did not fit.

  must-pass core
  env                  versions, nvidia-smi, nvcc (CUDA must be available, except in a dry run)
  kit                  unpack and apply .gpu/gpu-kit, import flashinfer; then profiling/kit_check.py
                       (informational: its failure does not fail the stage). A dry run only
                       rehearses it (skipped: the kit's packages are cp312 builds for the GPU machine)
  build                csrc/ with nvcc into graphdecode/_kernels (dry run: into a scratch folder),
                       with ptxas's report (-Xptxas -v): each kernel's registers, spills and shared
                       memory go into summary.json, and a kernel whose block would not fit an SM fails
  pytest_advance_step  pytest, one process per stage, so a sticky CUDA error or a timeout loses one
  pytest_flashinfer      stage's results; junit XML in the work folder, counts, per-test durations,
  pytest_hf_parity       failures' first lines in summary.json. hf_parity and graphs run their tests
  pytest_graphs          not marked `extended` (nor `compile`)
  after the core
  pytest_extended      the `extended` GPU tests of test_gpu_hf_parity.py, test_gpu_graphs.py, test_gpu_quantized.py,
                       test_gpu_lora.py and test_gpu_weight_updates.py
                       (head_dim 128 fp32 parity, speculative windows, sliding windows, MoE, LoRA adapters, weight
                       updates)
  pytest_hybrid        hybrid models (Qwen3.5, Nemotron-H tiny presets) in CUDA graphs against the eager fp32
                       reference: chunked prefill, n-gram speculation, a prefix hit; bf16 beside them
  pytest_families      DeepSeek-routed families (GLM-4.5, DeepSeek-V3's latent attention, Nemotron 3's experts)
                       in CUDA graphs against the eager fp32 reference, with their MTP layers drafting
  bench                bucket sweep, llama-3.2-1b shape, bf16, buckets 1,8,64, k=8, --compile off
  bench_spec           speculative decoding vs plain (profiling/bench_spec.py), micro preset, batch 1
                       and 8, --compile off
  pytest_compile       the `compile` cases (real inductor compiles), late because they are slow
  bench_tp             TP=1 vs TP=2 (profiling/bench_tp.py), --compile off; skipped with fewer than two GPUs
  bench_serve          the OpenAI server beside in-process generate (profiling/bench_serve.py),
                       llama-3.2-1b shape, 1/64/256 streaming clients over 4 client processes,
                       --compile off; its server packages come as wheels from .gpu/wheels when the
                       machine lacks them (--prepare downloads them), else it is skipped naming them
  bench_structured     constrained vs unconstrained decode (profiling/bench_structured.py),
                       llama-3.2-1b shape with the built-in tokenizer, batch 1/16/64, --compile off
  bench_moe            MoE decode beside transformers (profiling/bench_moe.py): the wide qwen3_moe
                       preset, bf16, batch 1/16/64, grouped vs dense experts, graphs, --compile off
  bench_quant          quantized decode in graphs beside bf16 (profiling/bench_quant_gpu.py): the llama-3.2-1b
                       preset written as int4 (tinygemm) and FP8 (scaled_mm) checkpoints on the device, and the
                       bf16 model with an FP8 KV cache, batch 1/16/64, --compile off
  bench_compiled       the bucket sweep with --compile on, buckets 1,16
  (bench_spec, bench_tp, bench_serve, bench_structured, bench_moe and bench_quant write their numbers into
  summary.json only: $OUT holds gpu_check.log, summary.json, bench_buckets.json and
  bench_buckets_compiled.json; the device returns 8 files at most)

Modules a stage requires (REQUIRES) and modules some of its tests use (OPTIONAL: outlines_core
for pytest_graphs' structured test) come from the carried wheels (.gpu/wheels) where they do not
import; a missing required module skips the stage, a missing optional one only the tests that
import it (the stage records it as `optional_missing`).

Options: --only STAGE[,STAGE] (env always runs; `pytest` = every pytest_* stage, `core` = the
must-pass core), --budget S, --dry-run (every stage rehearsed on CPU with CPU stand-ins; see
docs/gpu.md).

Knobs (environment): OUT, PYTHON, GPU_CHECK_BUDGET_S, GPU_CHECK_LIMIT_<STAGE> (a stage's own
limit, seconds), GPU_CHECK_NEED_<STAGE> (its estimated need), GPU_CHECK_TEST_TIMEOUT_S
(pytest-timeout per test, 90), GPU_CHECK_KIT_DIR (.gpu/gpu-kit), GPU_CHECK_WHEELS_DIR
(.gpu/wheels). Test hooks: GPU_CHECK_FAIL=STAGE[,STAGE] replaces those stages by a command that
fails; GPU_CHECK_SLEEP=STAGE:SECONDS[,...] by one that sleeps; GPU_CHECK_REQUIRE=STAGE:MOD[+MOD]
adds Python modules a stage requires, GPU_CHECK_OPTIONAL=STAGE:MOD[+MOD] ones it may use.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from gpu_check_report import (
    bench_points,
    junit_report,
    moe_points,
    must_pass,
    quant_points,
    serve_points,
    side_bench_points,
    structured_points,
    table,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTEST_STAGES = {  # stage: (test files, marker expression)
    "pytest_advance_step": (("tests/gpu/test_gpu_advance_step.py",), "gpu"),
    "pytest_flashinfer": (("tests/gpu/test_gpu_flashinfer.py",), "gpu"),
    "pytest_hf_parity": (("tests/gpu/test_gpu_hf_parity.py",), "gpu and not extended"),
    "pytest_graphs": (("tests/gpu/test_gpu_graphs.py",), "gpu and not compile and not extended"),
    "pytest_extended": (("tests/gpu/test_gpu_hf_parity.py", "tests/gpu/test_gpu_graphs.py",
                         "tests/gpu/test_gpu_quantized.py", "tests/gpu/test_gpu_lora.py",
                         "tests/gpu/test_gpu_weight_updates.py"),
                        "gpu and extended and not compile"),
    "pytest_compile": (("tests/gpu/test_gpu_graphs.py",), "gpu and compile"),
    "pytest_hybrid": (("tests/gpu/test_gpu_hybrid.py",), "gpu"),
    "pytest_families": (("tests/gpu/test_gpu_moe_families.py",), "gpu"),
}
# Per stage, in the order they run: its own limit, its estimated need on the GPU and in a dry run
# (seconds). A stage is not started with less budget left than its need; a dry-run need of None
# rehearses that skip (a need above any budget). The must-pass core comes first; its needs add up
# to 240 s (docs/gpu.md: the time budget), the rest of the default budget holds the first stages
# after it.
PLAN = {
    "env": (30, 10, 5),
    "kit": (60, 25, 10),
    "build": (60, 20, 10),
    "pytest_advance_step": (60, 25, 10),
    "pytest_flashinfer": (60, 30, 10),
    "pytest_hf_parity": (120, 60, 10),
    "pytest_graphs": (150, 70, 10),
    # after the core
    "pytest_extended": (200, 110, 10),
    "pytest_hybrid": (150, 70, 10),
    "pytest_families": (150, 70, 10),
    "bench": (120, 60, 20),
    "bench_spec": (90, 45, 20),
    "pytest_compile": (150, 90, 10),
    "bench_tp": (90, 60, 30),
    "bench_serve": (240, 150, 40),
    "bench_structured": (120, 60, 30),
    "bench_moe": (150, 80, 30),
    "bench_quant": (180, 100, 30),
    "bench_compiled": (150, 90, None),
}
STAGES = tuple(PLAN)
CORE = ("env", "kit", "build", "pytest_advance_step", "pytest_flashinfer", "pytest_hf_parity", "pytest_graphs")
assert STAGES[:len(CORE)] == CORE, "the must-pass core runs first"
ALIASES = {"pytest": tuple(PYTEST_STAGES), "core": CORE}
DEFAULT_BUDGET_S = 420
TEST_TIMEOUT_S = 90
GRACE_S = (5, 3)  # after the limit: SIGINT (pytest writes its XML), then SIGTERM, then SIGKILL
# Python modules a stage needs beyond the GPU machine's image; missing ones are installed from
# the carried wheels (.gpu/wheels, downloaded by --prepare), else the stage is skipped naming them.
REQUIRES = {"bench_serve": ("fastapi", "starlette", "pydantic", "uvicorn", "openai", "httpx", "prometheus_client"),
            "bench_structured": ("outlines_core",),  # structured outputs' compiler
            "bench_quant": ("compressed_tensors",)}  # the RTN writer's compressed-tensors checkpoints
# Modules only some of a stage's tests use: installed the same way, but where still missing only
# those tests skip (each skips itself where its import fails), not the stage.
OPTIONAL = {"pytest_graphs": ("outlines_core",),  # the structured-window test
            "pytest_extended": ("compressed_tensors",)}  # the quantized-weights test

BENCH_REAL = ["--preset", "llama-3.2-1b", "--device", "cuda", "--dtype", "bfloat16", "--steps", "8",
              "--prompt-len", "128", "--gen-len", "128", "--no-baseline"]
BENCH_DRY = ["--preset", "micro", "--device", "cpu", "--dtype", "float32", "--steps", "2",
             "--prompt-len", "8", "--gen-len", "8", "--no-baseline"]

ENV_SCRIPT = r"""
import importlib.metadata as md, json, platform, sys
info = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine()}
print("python", info["python"], info["machine"], sys.executable)
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest",
             "pytest-timeout", "matplotlib", "flashinfer-python"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
    print(f"{name} {info[name] or 'MISSING'}")
import torch
info["cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
info["device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
if info["cuda_available"]:
    info["gpu"] = torch.cuda.get_device_name()
    info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
print("cuda", info["cuda"], "available", info["cuda_available"], info.get("gpu", "-"), info.get("capability", "-"))
print("GPU_CHECK_ENV " + json.dumps(info))
"""

BUILD_SCRIPT = r"""
import json, os, sys, time
from graphdecode.kernels import build as kernel_build, ptxas as ptxas_report
if kernel_build.find_nvcc() is None:
    print("nvcc not found (PATH, CUDA_HOME)")
    sys.exit(42)
import torch
from graphdecode.kernels import cuda as cuda_kernels
packaged = os.path.join(kernel_build.package_dir(), "_kernels", kernel_build.LIB_NAME)
out = packaged if sys.argv[1] == "package" else os.path.join(sys.argv[1], kernel_build.LIB_NAME)
cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
t0 = time.perf_counter()
_, report = kernel_build.build_with_report(out, kernel_build.source_dir(), kernel_build.arch_flags_for(cap))
print(report.rstrip())
usages = ptxas_report.parse(report)
print("GPU_CHECK_KERNELS " + json.dumps([u.as_dict() for u in usages]))
lib = cuda_kernels.open_library(out)
print(f"built {out} for {cap} in {time.perf_counter() - t0:.1f}s, ABI {lib.graphdecode_kernels_abi_version()}")
if out == packaged:
    assert cuda_kernels.library_path() == out, "the loader does not pick the packaged library"
problems = ptxas_report.launch_problems(usages)
for problem in problems:
    print("GPU_CHECK_LAUNCH_PROBLEM " + problem)
sys.exit(43 if problems else 0)
"""


class Terminated(BaseException):
    """The driver got SIGTERM/SIGINT/SIGHUP: stop the stage, write the summary, exit."""


def _on_signal(signum, _frame):
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # one is enough: finish the summary undisturbed
    raise Terminated(signal.Signals(signum).name)


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value not in (None, "") else default


def _hooks(name: str) -> dict:
    """GPU_CHECK_FAIL=a,b -> {a: None, b: None}; GPU_CHECK_SLEEP=a:3,b:4 -> {a: 3.0, b: 4.0}."""
    hooks = {}
    for item in os.environ.get(name, "").split(","):
        if item.strip():
            stage, _, value = item.strip().partition(":")
            hooks[stage] = float(value) if value else None
    return hooks


def _module_hooks(name: str) -> dict:
    """GPU_CHECK_REQUIRE=bench_serve:a+b -> {"bench_serve": ("a", "b")} (GPU_CHECK_OPTIONAL alike)."""
    hooks = {}
    for item in os.environ.get(name, "").split(","):
        stage, _, modules = item.strip().partition(":")
        if stage:
            hooks[stage] = tuple(m for m in modules.split("+") if m)
    return hooks


def parse_only(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item in ALIASES:
            names.extend(ALIASES[item])
        elif item in STAGES:
            names.append(item)
        else:
            raise ValueError(f"unknown stage {item!r}; stages: {', '.join(STAGES)} (alias: pytest)")
    return ["env"] + [s for s in STAGES if s in names and s != "env"]


class Check:
    def __init__(self, args):
        self.dry = args.dry_run
        self.only = parse_only(args.only)
        self.out = os.path.abspath(os.environ.get("OUT") or os.path.join(ROOT, "profiling", "out", "gpu_check"))
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu_check_")
        self.python = os.environ.get("PYTHON") or sys.executable
        self.budget = args.budget if args.budget is not None else _env_seconds("GPU_CHECK_BUDGET_S",
                                                                               DEFAULT_BUDGET_S)
        self.kit_dir = os.environ.get("GPU_CHECK_KIT_DIR") or os.path.join(ROOT, ".gpu", "gpu-kit")
        self.wheels_dir = os.environ.get("GPU_CHECK_WHEELS_DIR") or os.path.join(ROOT, ".gpu", "wheels")
        self.fail_hooks = _hooks("GPU_CHECK_FAIL")
        self.sleep_hooks = _hooks("GPU_CHECK_SLEEP")
        required, optional = _module_hooks("GPU_CHECK_REQUIRE"), _module_hooks("GPU_CHECK_OPTIONAL")
        self.requires = {name: REQUIRES.get(name, ()) + required.get(name, ()) for name in STAGES}
        self.optional = {name: OPTIONAL.get(name, ()) + optional.get(name, ()) for name in STAGES}
        self.needs = {name: self.stage_need(name) for name in STAGES}
        self.wheel_site = None  # where the carried wheels were installed (for the stages that use them)
        self.t0 = time.monotonic()
        self.log = open(os.path.join(self.out, "gpu_check.log"), "wb")
        self.lock = threading.Lock()
        self.kit_ok = False
        self.has_pytest_timeout = None
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if not self.dry:  # a dry run keeps the default cache (the micro preset is usually there)
            env.setdefault("GRAPHDECODE_CACHE", "/tmp/graphdecode-cache")
        self.env = env
        self.summary = {
            "check": "gpu_check",
            "dry_run": self.dry,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "budget_s": self.budget,
            "only": self.only,
            "finished": False,
            "terminated": None,
            "ok": None,
            "elapsed_s": 0.0,
            "stages": {name: {"status": "pending", "need_s": self.needs[name]} for name in STAGES},
        }

    # ------------------------------------------------------------------ output
    def say(self, text: str) -> None:
        data = (text + "\n").encode()
        with self.lock:
            for write in (sys.stdout.buffer.write, self.log.write):
                try:
                    write(data)
                except (OSError, ValueError):
                    pass
            for flush in (sys.stdout.buffer.flush, self.log.flush):
                try:
                    flush()
                except (OSError, ValueError):
                    pass

    def _pump(self, stream, captured: list | None) -> None:
        for line in iter(stream.readline, b""):
            with self.lock:
                for write in (sys.stdout.buffer.write, self.log.write):
                    try:
                        write(line)
                    except (OSError, ValueError):
                        pass
                try:
                    sys.stdout.buffer.flush()
                    self.log.flush()
                except (OSError, ValueError):
                    pass
            if captured is not None:
                captured.append(line.decode(errors="replace").rstrip("\n"))
        stream.close()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    # ------------------------------------------------------------------ processes
    def run(self, argv, timeout: float, env: dict | None = None, capture: bool = False) -> dict:
        """Run argv in its own process group, output teed to stdout and the log.

        Returns {"rc", "timed_out", "lines"}. At the limit (or when the driver is told to stop),
        the group gets SIGINT, then SIGTERM, then SIGKILL, a few seconds apart."""
        captured = [] if capture else None
        if timeout <= 0:
            return {"rc": None, "timed_out": True, "lines": captured or []}
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env or self.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
        except OSError as exc:
            self.say(f"cannot start {argv[0]}: {exc}")
            return {"rc": 127, "timed_out": False, "lines": captured or []}
        reader = threading.Thread(target=self._pump, args=(proc.stdout, captured), daemon=True)
        reader.start()
        timed_out = False
        try:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                self.say(f"--- time limit ({timeout:.0f}s) reached: stopping {os.path.basename(argv[0])}")
                self._stop(proc)
        except BaseException:
            self._stop(proc)
            raise
        finally:
            self._kill_group(proc, signal.SIGKILL)  # stragglers (compile workers and the like)
            reader.join(timeout=5)
        return {"rc": proc.returncode, "timed_out": timed_out, "lines": captured or []}

    @staticmethod
    def _kill_group(proc, sig) -> bool:
        try:
            os.killpg(proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _stop(self, proc) -> None:
        for sig, grace in ((signal.SIGINT, GRACE_S[0]), (signal.SIGTERM, GRACE_S[1]), (signal.SIGKILL, 5)):
            if proc.poll() is not None or not self._kill_group(proc, sig):
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue

    # ------------------------------------------------------------------ summary
    def write_summary(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.summary["must_pass"] = must_pass(self.summary, CORE, self.needs)
        self.summary["out_files"] = sorted(f for f in os.listdir(self.out) if not f.startswith("."))
        path = os.path.join(self.out, "summary.json")
        tmp = os.path.join(self.out, ".summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(tmp, path)

    def table(self) -> str:
        return table(self.summary, self.out, self.needs, self.left())

    # ------------------------------------------------------------------ stages
    def stage_limit(self, name: str) -> float:
        """The stage's own limit (GPU_CHECK_LIMIT_<STAGE> overrides it)."""
        own = PLAN[name][0]
        return _env_seconds(f"GPU_CHECK_LIMIT_{name.upper()}", _env_seconds(f"GPU_CHECK_LIMIT_{name}", own))

    def stage_need(self, name: str) -> float:
        """The stage's estimated need (GPU_CHECK_NEED_<STAGE> overrides it); a dry run uses the
        CPU stand-ins' need, or one above the budget where it rehearses the skip."""
        _, need, dry_need = PLAN[name]
        if self.dry:
            need = self.budget + 1 if dry_need is None else dry_need
        return _env_seconds(f"GPU_CHECK_NEED_{name.upper()}", need)

    def skip(self, name: str, reason: str, rerun: bool = False) -> None:
        record = self.summary["stages"][name]
        record.update(status="skipped", reason=reason, seconds=0, **({"rerun": True} if rerun else {}))
        self.say(f"=== [{name}] skipped: {reason}")
        self.write_summary()

    def run_stage(self, name: str) -> None:
        record = self.summary["stages"][name]
        if self.only is not None and name not in self.only:
            record.update(status="skipped", reason="not selected (--only)", seconds=0)
            if name == "kit" and not self.dry and os.path.isfile(os.path.join(self.kit_dir, "setup.sh")):
                kit_env = self._kit_env(time.monotonic() + min(30, max(self.left(), 1)))
                if kit_env is not None:  # the later stages still get FlashInfer (and must not skip its tests)
                    self.env, self.kit_ok = kit_env, True
                    record["reason"] += "; the kit's environment was applied for the later stages"
            return
        inapplicable = self.inapplicable(name)
        if inapplicable:
            return self.skip(name, inapplicable)
        need, own, left = self.needs[name], self.stage_limit(name), self.left()
        if name != "env" and left < need:
            if self.dry and PLAN[name][2] is None and f"GPU_CHECK_NEED_{name.upper()}" not in os.environ:
                why = " (a dry run rehearses this skip)"
            else:
                why = ""
            return self.skip(name, f"needs ~{need:.0f}s, {max(left, 0):.0f}s left of the budget{why}; "
                                   f"run it with --only {name}", rerun=True)
        missing = self.missing_modules(name, self.requires[name])
        if missing:
            return self.skip(name, f"Python packages missing here: {', '.join(missing)} (run --prepare, which "
                                   f"puts their wheels in {os.path.relpath(self.wheels_dir, ROOT)}, and carry it)")
        optional_missing = self.missing_modules(name, self.optional[name])
        if optional_missing:  # the stage runs; the tests that import them skip, saying so
            record["optional_missing"] = optional_missing
            self.say(f"=== [{name}] without {', '.join(optional_missing)}: the tests that use them skip")
        limit = own if name == "env" else min(own, left)
        record.update(status="running", limit_s=round(limit), started_s=round(time.monotonic() - self.t0, 1))
        self.write_summary()
        self.say(f"=== [{name}] start {time.strftime('%H:%M:%S')}, limit {limit:.0f}s, need ~{need:.0f}s, "
                 f"{left:.0f}s left of the budget")
        t0 = time.monotonic()
        try:
            if name in self.fail_hooks or name in self.sleep_hooks:
                result = self.hooked(name, limit)
            else:
                fn = self.pytest_stage if name in PYTEST_STAGES else getattr(self, "stage_" + name)
                result = fn(name, limit) if name in PYTEST_STAGES else fn(limit)
        except Terminated as exc:  # the check itself was stopped (the device call's limit): cut
            record.update(status="cut", reason=f"check terminated by {exc.args[0]} during this stage",
                          seconds=round(time.monotonic() - t0, 1))
            self.after_stage(name, record)
            raise
        except Exception as exc:  # noqa: BLE001 - a driver bug in one stage must not stop the others
            result = {"status": "failed", "rc": None, "reason": f"driver error: {type(exc).__name__}: {exc}"}
        if result["status"] == "timeout" and limit < own:
            result.update(status="cut", reason=f"the budget ran out after {limit:.0f}s (its own limit is "
                                                f"{own:.0f}s); run it with --only {name}")
        record.update(result)
        record["seconds"] = round(time.monotonic() - t0, 1)
        self.after_stage(name, record)
        self.say(f"=== [{name}] {record['status']}"
                 + (f" rc={record['rc']}" if record["status"] == "failed" and record.get("rc") else "")
                 + (f" ({record['reason']})" if record.get("reason") else "") + f" in {record['seconds']:.0f}s")
        self.write_summary()

    def inapplicable(self, name: str) -> str | None:
        """Why a stage cannot run on this machine at all (then it is skipped before the budget is
        asked, and not rerun): bench_tp where fewer than two GPUs are present."""
        if name == "bench_tp" and not self.dry:
            gpus = (self.summary["stages"]["env"].get("env") or {}).get("device_count", 0)
            if gpus < 2:
                return f"{gpus} GPU(s) here: tensor parallelism needs 2"
        return None

    def env_for(self, name: str) -> dict:
        """The environment of a stage: with the carried wheels first on PYTHONPATH if it uses modules
        (required or optional) and they were installed."""
        if self.wheel_site is None or not (self.requires.get(name) or self.optional.get(name)):
            return self.env
        return dict(self.env, PYTHONPATH=self.wheel_site + os.pathsep + self.env["PYTHONPATH"])

    def missing_modules(self, name: str, modules: tuple[str, ...]) -> list[str]:
        """Those of `modules` that do not import for this stage, after installing the carried
        wheels if some are missing (once, into the work folder; only the stages that use such
        modules see them, so nothing else runs against other versions than the image's)."""
        if not modules:
            return []
        probe = ("import importlib, sys\n"
                 "absent = []\n"
                 "for module in sys.argv[1:]:\n"
                 "    try:\n"
                 "        importlib.import_module(module)\n"
                 "    except Exception:\n"  # an ImportError, or a broken install failing otherwise
                 "        absent.append(module)\n"
                 "print('GPU_CHECK_MISSING ' + ' '.join(absent))")

        def missing() -> list[str]:
            result = self.run([self.python, "-c", probe, *modules], 60, env=self.env_for(name), capture=True)
            found = [line for line in result["lines"] if line.startswith("GPU_CHECK_MISSING")]
            return found[-1].split()[1:] if result["rc"] == 0 and found else list(modules)

        absent = missing()
        wheels = sorted(glob.glob(os.path.join(self.wheels_dir, "*.whl")))
        if absent and wheels and self.wheel_site is None:
            site = os.path.join(self.work, "site")
            self.say(f"{name}: {', '.join(absent)} missing; installing {len(wheels)} carried wheels into {site}")
            result = self.run([self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--disable-pip-version-check", "--target", site, *wheels], 120)
            if result["rc"] == 0:
                self.wheel_site = site
                self.summary["stages"][name]["wheels_installed"] = len(wheels)
                absent = missing()
        return absent

    def after_stage(self, name: str, record: dict) -> None:
        """Key numbers from the stage's files (also after a timeout or a kill)."""
        if name in PYTEST_STAGES:
            xml = os.path.join(self.work, f"{name}.xml")
            if os.path.isfile(xml):
                record["tests"] = junit_report(xml)
        elif name in ("bench_spec", "bench_tp", "bench_serve", "bench_structured", "bench_moe",
                      "bench_quant"):  # their JSON in the work dir
            path = os.path.join(self.work, name + ".json")
            if os.path.isfile(path):
                if name == "bench_structured":
                    record["bench"] = structured_points(path)
                elif name == "bench_moe":
                    record["bench"] = moe_points(path)
                elif name == "bench_quant":
                    record["bench"] = quant_points(path)
                else:
                    record["bench"] = (serve_points if name == "bench_serve" else side_bench_points)(path)
        elif name.startswith("bench"):
            prefix = os.path.join(self.out, "bench_buckets" + ("_compiled" if name == "bench_compiled" else ""))
            for extra in (prefix + ".png", prefix + ".json.tmp"):  # keep $OUT to few files
                if os.path.isfile(extra):
                    os.remove(extra)
            if os.path.isfile(prefix + ".json"):
                record["json"] = os.path.basename(prefix + ".json")
                record["bench"] = bench_points(prefix + ".json")

    @staticmethod
    def verdict(result: dict, ok_rcs=(0,)) -> dict:
        if result["timed_out"]:
            return {"status": "timeout", "rc": result["rc"]}
        if result["rc"] in ok_rcs:
            return {"status": "ok", "rc": result["rc"]}
        return {"status": "failed", "rc": result["rc"]}

    def hooked(self, name: str, limit: float) -> dict:
        if name in self.fail_hooks:
            code = "import sys; print('injected failure (GPU_CHECK_FAIL)'); sys.exit(3)"
        else:
            code = (f"import os, time; print('sleeping (GPU_CHECK_SLEEP) pid', os.getpid(), flush=True); "
                    f"time.sleep({self.sleep_hooks[name]})")
        return {**self.verdict(self.run([self.python, "-c", code], limit)), "reason": "test hook"}

    def stage_env(self, limit: float) -> dict:
        deadline = time.monotonic() + limit
        self.say(f"gpu_check {self.summary['started_utc']} in {ROOT}, OUT={self.out}, budget {self.budget:.0f}s"
                 + (", DRY RUN" if self.dry else ""))
        tools = []
        if shutil.which("git") and os.path.isdir(os.path.join(ROOT, ".git")):
            tools.append(["git", "log", "-1", "--format=commit %H %s"])
        if shutil.which("nvidia-smi"):
            tools.append(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm",
                          "--format=csv"])
        if shutil.which("nvcc"):
            tools.append(["nvcc", "--version"])
        for argv in tools:  # informational
            self.run(argv, min(10, deadline - time.monotonic()))
        result = self.run([self.python, "-c", ENV_SCRIPT], deadline - time.monotonic(), capture=True)
        verdict = self.verdict(result)
        for line in result["lines"]:
            if line.startswith("GPU_CHECK_ENV "):
                verdict["env"] = json.loads(line[len("GPU_CHECK_ENV "):])
        if verdict["status"] == "ok" and not self.dry and not verdict.get("env", {}).get("cuda_available"):
            verdict.update(status="failed", reason="CUDA not available: every GPU test would skip")
        return verdict

    def stage_kit(self, limit: float) -> dict:
        """Apply the kit, then kit_check.py: its "INFO  flashinfer" line proves the import (the
        stage's status); its kernel checks are informational. A dry run only rehearses it."""
        deadline = time.monotonic() + limit
        kit = os.path.relpath(self.kit_dir, ROOT)
        have_kit = os.path.isfile(os.path.join(self.kit_dir, "setup.sh"))
        if self.dry:
            return self._kit_rehearsal(deadline, kit, have_kit)
        if not have_kit:
            return {"status": "failed", "rc": None, "reason": f"{kit} missing: run --prepare, carry .gpu"}
        kit_env = self._kit_env(deadline)
        if kit_env is None:
            return {"status": "failed", "rc": None, "reason": "the kit's setup.sh failed"}
        self.env = kit_env
        check = self._kit_check(deadline)
        if check.get("flashinfer") is None:
            return {**check, "status": "failed" if check["status"] != "timeout" else "timeout",
                    "reason": "flashinfer does not import with the kit"}
        self.kit_ok = True
        result = {**check, "status": "ok", "rc": 0, "source": "gpu-kit"}
        if check["check"]["status"] != "ok":
            result["reason"] = "the kit check failed (informational, see the log)"
        return result

    def _kit_check(self, deadline: float) -> dict:
        """profiling/kit_check.py under the current environment: the flashinfer it imports and its checks."""
        check = self.run([self.python, os.path.join(ROOT, "profiling", "kit_check.py"), "--kit-dir", self.kit_dir],
                         deadline - time.monotonic(), capture=True)
        lines = check["lines"]
        version = [line.split()[2] for line in lines if line.startswith("INFO  flashinfer ")]
        return {**self.verdict(check), "flashinfer": version[0] if version else None,
                "check": {"status": self.verdict(check)["status"], "rc": check["rc"],
                          "passed": sum(line.startswith("PASS") for line in lines),
                          "failed": [line[6:] for line in lines if line.startswith("FAIL")]}}

    def _kit_rehearsal(self, deadline: float, kit: str, have_kit: bool) -> dict:
        """A dry run never applies the kit (its tvm_ffi and nvtx are cp312 builds for the GPU
        machine), prepared or not: the stage is skipped, saying why. What can be rehearsed here
        is: a prepared kit's setup.sh unpacks, and kit_check.py runs on a local flashinfer."""
        notes = []
        if have_kit:
            notes.append(f"{kit}'s setup.sh " + ("unpacked it" if self._kit_env(deadline) else "FAILED"))
        else:
            notes.append(f"no {kit} (prepare it with --prepare before the device call)")
        check = self._kit_check(deadline)
        notes.append(f"kit_check.py on the local flashinfer {check['flashinfer']}: {check['check']['passed']} PASS"
                     if check["flashinfer"] else "no local flashinfer for kit_check.py")
        return {"status": "skipped", "rc": None, "rehearsal": check,
                "reason": "a dry run does not apply the kit (cp312 packages for the GPU machine); " + "; ".join(notes)}

    def _kit_env(self, deadline: float) -> dict | None:
        """Run the kit's setup.sh and return the environment its output sets (None on failure)."""
        env_file = os.path.join(self.work, "kit.env")
        script = 'code="$(bash "$1/setup.sh")" || exit 1; eval "$code" || exit 1; env -0 > "$2"'
        env = dict(self.env, GDKIT_PYTHON=self.python)
        result = self.run(["bash", "-c", script, "gpu_check", self.kit_dir, env_file], deadline - time.monotonic(),
                          env=env)
        if result["rc"] != 0 or result["timed_out"] or not os.path.isfile(env_file):
            return None
        with open(env_file, "rb") as f:
            items = [item.decode(errors="replace") for item in f.read().split(b"\0") if b"=" in item]
        exported = dict(item.split("=", 1) for item in items)
        changed = {key: value for key, value in exported.items()
                   if self.env.get(key) != value and key not in ("_", "SHLVL", "PWD", "OLDPWD", "GDKIT_PYTHON")}
        for key, value in sorted(changed.items()):
            self.say(f"kit: {key}={value}")
        return {**self.env, **changed}

    def stage_build(self, limit: float) -> dict:
        """nvcc with ptxas's report: the kernels' registers, spills and shared memory into summary.json;
        failed (rc 43) when a kernel's block would not fit an SM (ptxas_report.launch_problems)."""
        target = os.path.join(self.work, "kernels") if self.dry else "package"
        run = self.run([self.python, "-c", BUILD_SCRIPT, target], limit, capture=True)
        result = self.verdict(run)
        for line in run["lines"]:
            if line.startswith("GPU_CHECK_KERNELS "):
                result["kernels"] = json.loads(line[len("GPU_CHECK_KERNELS "):])
        problems = [line[len("GPU_CHECK_LAUNCH_PROBLEM "):] for line in run["lines"]
                    if line.startswith("GPU_CHECK_LAUNCH_PROBLEM ")]
        if run["rc"] == 42:
            if self.dry:
                return {"status": "skipped", "rc": 42, "reason": "nvcc not found"}
            result["reason"] = "nvcc not found"
        elif run["rc"] == 43 and problems:
            result["reason"] = "; ".join(problems)
        return result

    def pytest_stage(self, name: str, limit: float) -> dict:
        paths, marker = PYTEST_STAGES[name]
        xml = os.path.join(self.work, f"{name}.xml")  # read into summary.json: $OUT keeps to 4 files
        if os.path.exists(xml):
            os.remove(xml)
        absent = [path for path in paths if not os.path.isfile(os.path.join(ROOT, path))]
        if absent:
            return {"status": "skipped", "rc": None, "reason": f"{', '.join(absent)} missing"}
        argv = [self.python, "-m", "pytest", *paths, "-m", marker, "-v", "-rfEs", "--durations=0", "-p",
                "no:cacheprovider", f"--junitxml={xml}"]
        if self.has_pytest_timeout is None:
            probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytest_timeout') is None)"
            self.has_pytest_timeout = self.run([self.python, "-c", probe], min(20, limit))["rc"] == 0
        if self.has_pytest_timeout:
            per_test = min(_env_seconds("GPU_CHECK_TEST_TIMEOUT_S", TEST_TIMEOUT_S), limit - GRACE_S[0])
            argv.append(f"--timeout={max(5, int(per_test))}")
        env = dict(self.env_for(name), CUBLAS_WORKSPACE_CONFIG=":4096:8",
                   GRAPHDECODE_REQUIRE_FLASHINFER="1" if self.kit_ok else "0")
        result = self.verdict(self.run(argv, limit, env=env))
        reasons = {2: "interrupted", 3: "pytest internal error", 4: "pytest usage error", 5: "no test selected"}
        if result["status"] == "failed" and result["rc"] in reasons:
            result["reason"] = reasons[result["rc"]]
        return result

    def _bench(self, name: str, limit: float, compile_flag: str, buckets: str) -> dict:
        prefix = os.path.join(self.out, "bench_buckets" + ("_compiled" if name == "bench_compiled" else ""))
        for stale in (prefix + ".json", prefix + ".png"):
            if os.path.exists(stale):
                os.remove(stale)
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_buckets.py"),
                *(BENCH_DRY if self.dry else BENCH_REAL), "--buckets", buckets, "--compile", compile_flag,
                "--out", prefix]
        return self.verdict(self.run(argv, limit))

    def stage_bench(self, limit: float) -> dict:
        return self._bench("bench", limit, "off", "1,2" if self.dry else "1,8,64")

    def stage_bench_compiled(self, limit: float) -> dict:
        return self._bench("bench_compiled", limit, "on", "1,2" if self.dry else "1,16")

    def stage_bench_spec(self, limit: float) -> dict:
        """Speculative decoding vs plain (profiling/bench_spec.py) on the micro preset (head_dim 64, bf16)."""
        sizes = (["--device", "cpu", "--batches", "1", "--max-tokens", "8", "-k", "2", "-d", "3"] if self.dry
                 else ["--device", "cuda", "--batches", "1,8", "--max-tokens", "64"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_spec.py"), "--preset", "micro", *sizes,
                "--repeats", "1", "--compile", "off", "--out", os.path.join(self.work, "bench_spec")]
        return self.verdict(self.run(argv, limit))

    def stage_bench_tp(self, limit: float) -> dict:
        """TP=1 vs TP=2 (profiling/bench_tp.py): only where more than one GPU is present (`inapplicable`)."""
        sizes = (["--device", "cpu", "--preset", "micro", "--batches", "2", "--gen-len", "4", "-k", "2"] if self.dry
                 else ["--device", "cuda", "--batches", "1,16"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_tp.py"), *sizes, "--compile", "off",
                "--out", os.path.join(self.work, "bench_tp")]
        return self.verdict(self.run(argv, limit))

    def stage_bench_serve(self, limit: float) -> dict:
        """The OpenAI server beside in-process generate (profiling/bench_serve.py): issue 10's goals on a GPU."""
        sizes = (["--clients", "1,2", "--max-tokens", "8", "-k", "2"] if self.dry
                 else ["--preset", "llama-3.2-1b", "--device", "cuda", "--client-procs", "4", "--clients", "1,64,256"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_serve.py"), *sizes, "--compile", "off",
                "--repeats", "1" if self.dry else "2", "--out", os.path.join(self.work, "bench_serve")]
        return self.verdict(self.run(argv, limit, env=self.env_for("bench_serve")))

    def stage_bench_structured(self, limit: float) -> dict:
        """Constrained vs unconstrained decode (profiling/bench_structured.py): llama-3.2-1b's shapes
        (its 128k-vocabulary masks) with the built-in tokenizer, inside CUDA graphs."""
        sizes = (["--preset", "micro", "--device", "cpu", "--batches", "1,2", "--max-tokens", "16", "-k", "2"]
                 if self.dry else ["--preset", "llama-3.2-1b", "--device", "cuda", "--batches", "1,16,64"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_structured.py"), *sizes, "--compile", "off",
                "--repeats", "1" if self.dry else "2", "--out", os.path.join(self.work, "bench_structured")]
        return self.verdict(self.run(argv, limit, env=self.env_for("bench_structured")))

    def stage_bench_moe(self, limit: float) -> dict:
        """MoE decode beside transformers (profiling/bench_moe.py): the grouped GEMM (bf16, sm90) and the
        dense fallback inside CUDA graphs, and the MoE layers' share of a step."""
        sizes = (["--tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,2", "--new-tokens", "4", "-k",
                  "2", "--prompt-len", "8"] if self.dry
                 else ["--device", "cuda", "--dtype", "bfloat16", "--batches", "1,16,64"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_moe.py"), *sizes, "--compile", "off",
                "--impls", "grouped,dense", "--repeats", "1" if self.dry else "2",
                "--json", os.path.join(self.work, "bench_moe.json")]
        return self.verdict(self.run(argv, limit))

    def stage_bench_quant(self, limit: float) -> dict:
        """Quantized weights (int4 tinygemm, FP8 scaled_mm) and an FP8 KV cache in the window's graphs beside the
        bf16 engine (profiling/bench_quant_gpu.py), tokens/s side by side."""
        sizes = (["--device", "cpu", "--preset", "micro", "--batches", "1,2", "--prompt-len", "8", "--gen-len", "4",
                  "--repeats", "1"] if self.dry else ["--device", "cuda", "--attention", "flashinfer"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_quant_gpu.py"), *sizes,
                "--formats", "bf16,int4,fp8,kv-fp8", "--work", os.path.join(self.work, "quant"),
                "--out", os.path.join(self.work, "bench_quant")]
        return self.verdict(self.run(argv, limit))

    # ------------------------------------------------------------------ main
    def main(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _on_signal)
        code = 0
        try:
            self.write_summary()
            for name in STAGES:
                self.run_stage(name)
        except Terminated as exc:
            self.summary["terminated"] = exc.args[0]
            for st in self.summary["stages"].values():
                if st["status"] == "running":  # terminated between the stage's processes
                    st.update(status="cut", reason=f"check terminated by {exc.args[0]} during this stage")
                elif st["status"] == "pending":
                    st.update(status="skipped", reason=f"not reached: check terminated by {exc.args[0]}", seconds=0,
                              rerun=True)
            code = 143
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            stages = self.summary["stages"].values()
            bad = [st for st in stages if st["status"] in ("failed", "timeout")]
            self.summary["ok"] = not bad and not self.summary["terminated"]
            self.summary["finished"] = not self.summary["terminated"]
            self.write_summary()
            self.say(self.table())
            self.log.close()
            shutil.rmtree(self.work, ignore_errors=True)
        return code or (0 if self.summary["ok"] else 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help="STAGE[,STAGE]: run only these (env always runs)")
    parser.add_argument("--dry-run", action="store_true", help="rehearse every stage on CPU")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole check (default: GPU_CHECK_BUDGET_S, else {DEFAULT_BUDGET_S})")
    args = parser.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    try:
        parse_only(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
