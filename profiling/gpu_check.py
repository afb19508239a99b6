#!/usr/bin/env python3
"""The GPU check's driver (entry point: `bash profiling/gpu_check.sh`, which also does --prepare).

Runs the stages below in order, each in its own process group under its own time limit,
cut to what is left of the budget (GPU_CHECK_BUDGET_S, default 300 s); a failed or timed-out
stage does not stop the next. $OUT/summary.json is rewritten when each stage starts and
ends, and on SIGTERM/SIGINT (the running stage's processes are stopped first), so whatever
happens it says how far the check got. A compact table is printed last.

  env                  versions, nvidia-smi, nvcc (CUDA must be available, except in a dry run)
  kit                  unpack and apply .gpu/gpu-kit, import flashinfer; then profiling/kit_check.py
                       (informational: its failure does not fail the stage)
  build                csrc/ with nvcc into graphdecode/_kernels (dry run: into a scratch folder)
  pytest_advance_step  pytest -m gpu, one process and one junit XML (pytest_<name>.xml) per file,
  pytest_flashinfer      cheapest first, so a sticky CUDA error or a timeout loses one file
  pytest_graphs
  pytest_hf_parity     (skipped when the file does not exist)
  bench                bucket sweep, llama-3.2-1b shape, bf16, buckets 1,8,64, k=8, compile off
  bench_spec           speculative decoding vs plain (profiling/bench_spec.py), micro preset, batch 1 and 8
  bench_tp             TP=1 vs TP=2 (profiling/bench_tp.py); skipped with fewer than two GPUs
                       (both write their numbers into summary.json only: $OUT holds 8 files at most)
  bench_serve          the OpenAI server beside in-process generate (profiling/bench_serve.py),
                       llama-3.2-1b shape, 1/64/256 streaming clients over 4 client processes;
                       numbers in summary.json only; not started with less budget left than its
                       estimated need (GPU_CHECK_SERVE_NEED_S, 150 s): run it with --only bench_serve
  bench_compiled       the same with torch.compile, buckets 1,16; skipped (not started) when less
                       budget is left than its estimated need (GPU_CHECK_COMPILED_NEED_S, 90 s)

Options: --only STAGE[,STAGE] (env always runs; `pytest` = every pytest_* stage), --dry-run
(every stage rehearsed on CPU with CPU stand-ins; see docs/gpu.md).

Knobs (environment): OUT, PYTHON, GPU_CHECK_BUDGET_S, GPU_CHECK_LIMIT_<STAGE> (a stage's own
limit, seconds), GPU_CHECK_TEST_TIMEOUT_S (pytest-timeout per test, 90), GPU_CHECK_COMPILED_NEED_S,
GPU_CHECK_SERVE_NEED_S, GPU_CHECK_KIT_DIR (.gpu/gpu-kit). Test hooks: GPU_CHECK_FAIL=STAGE[,STAGE] replaces those stages
by a command that fails; GPU_CHECK_SLEEP=STAGE:SECONDS[,...] by one that sleeps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PYTEST_FILES = {
    "pytest_advance_step": "tests/test_gpu_advance_step.py",
    "pytest_flashinfer": "tests/test_gpu_flashinfer.py",
    "pytest_graphs": "tests/test_gpu_graphs.py",
    "pytest_hf_parity": "tests/test_gpu_hf_parity.py",
}
STAGES = ("env", "kit", "build", *PYTEST_FILES, "bench", "bench_spec", "bench_tp", "bench_serve", "bench_compiled")
ALIASES = {"pytest": tuple(PYTEST_FILES)}
# Each stage's own limit (seconds), before it is cut to what is left of the budget.
LIMITS = {
    "env": 30,
    "kit": 60,
    "build": 90,
    "pytest_advance_step": 60,
    "pytest_flashinfer": 60,
    "pytest_graphs": 120,
    "pytest_hf_parity": 90,
    "bench": 120,
    "bench_compiled": 150,
    "bench_spec": 60,
    "bench_tp": 90,
    "bench_serve": 240,
}
DEFAULT_BUDGET_S = 300
# Estimated needs (seconds): these stages are not started with less budget left. The last field
# says what a dry run does: True rehearses the skip (a need above the budget), False runs the stage.
NEEDS = {"bench_compiled": ("GPU_CHECK_COMPILED_NEED_S", 90, True),
         "bench_serve": ("GPU_CHECK_SERVE_NEED_S", 150, False)}
MIN_STAGE_S = 5  # a stage is not started with less budget left
TEST_TIMEOUT_S = 90
GRACE_S = (5, 3)  # after the limit: SIGINT (pytest writes its XML), then SIGTERM, then SIGKILL

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
import os, sys, time
from graphdecode.compiled import kernel_build
if kernel_build.find_nvcc() is None:
    print("nvcc not found (PATH, CUDA_HOME)")
    sys.exit(42)
import torch
from graphdecode.compiled import cuda_kernels
packaged = os.path.join(kernel_build.package_dir(), "_kernels", kernel_build.LIB_NAME)
out = packaged if sys.argv[1] == "package" else os.path.join(sys.argv[1], kernel_build.LIB_NAME)
cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
t0 = time.perf_counter()
kernel_build.build(out, kernel_build.source_dir(), kernel_build.arch_flags_for(cap))
lib = cuda_kernels.open_library(out)
print(f"built {out} for {cap} in {time.perf_counter() - t0:.1f}s, ABI {lib.graphdecode_kernels_abi_version()}")
if out == packaged:
    assert cuda_kernels.library_path() == out, "the loader does not pick the packaged library"
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


def junit_counts(path: str) -> dict | None:
    """passed/failed/errors/skipped and the failed tests' names from a junit XML (None if unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed = []
    for case in root.iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        name = f"{cls}::{case.get('name')}" if cls else str(case.get("name"))
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed}


def _read_json(path: str) -> dict | None:
    """A bench's JSON, or None when it is missing or unreadable (a stage that did not get that far)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def bench_points(path: str) -> dict | None:
    """tokens/s and ms/step per point of a bench JSON (written after every point, so partial runs count)."""
    data = _read_json(path)
    if data is None:
        return None
    points = [
        {"k": p.get("k"), "batch": p.get("batch"), "bucket": p.get("bucket"),
         "tokens_per_s": round(p["tokens_per_s"], 1), "ms_per_decode_step": round(p["ms_per_decode_step"], 3)}
        for p in data.get("points", []) if "tokens_per_s" in p and "ms_per_decode_step" in p
    ]
    config = data.get("engine_config", {})
    return {"points": points, "attention_backend": config.get("attention_backend"),
            "capture_seconds": config.get("capture_seconds"), "model": data.get("model_name")}


def side_bench_points(path: str) -> dict | None:
    """The key numbers of bench_spec / bench_tp JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None
    keep = ("set", "batch", "tp", "plain_tokens_per_s", "spec_tokens_per_s", "speedup", "accepted_per_verify",
            "same_tokens", "decode_tokens_per_s", "collective_share")
    points = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items() if k in keep}
              for p in data.get("points", [])]
    return {"points": points, "speedup": data.get("speedup"), "same_tokens": data.get("same_tokens")}


def serve_points(path: str) -> dict | None:
    """The key numbers of a bench_serve JSON, for summary.json."""
    data = _read_json(path)
    if data is None:
        return None

    def r(value):
        return round(value, 3) if isinstance(value, float) else value

    points = [{"clients": p["clients"], "served_tokens_per_s": r(p["served"]["tokens_per_s"]),
               "in_process_tokens_per_s": r((p.get("in_process") or {}).get("tokens_per_s")),
               "ratio": r(p.get("served_over_in_process")), "ttft_p50_s": r(p["served"]["ttft_p50_s"]),
               "itl_p99_s": r(p["served"]["itl_p99_s"]),
               "itl_p99_over_window_mean": r(p.get("itl_p99_over_window_mean"))}
              for p in data.get("points", [])]
    return {"points": points, "goals": {k: r(v) for k, v in data.get("goals", {}).items()}, "model": data.get("model")}


class Check:
    def __init__(self, args):
        self.dry = args.dry_run
        self.only = parse_only(args.only)
        self.out = os.path.abspath(os.environ.get("OUT") or os.path.join(ROOT, "profiling", "out", "gpu_check"))
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu_check_")
        self.python = os.environ.get("PYTHON") or sys.executable
        self.budget = _env_seconds("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)
        self.kit_dir = os.environ.get("GPU_CHECK_KIT_DIR") or os.path.join(ROOT, ".gpu", "gpu-kit")
        self.fail_hooks = _hooks("GPU_CHECK_FAIL")
        self.sleep_hooks = _hooks("GPU_CHECK_SLEEP")
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
            "stages": {name: {"status": "pending"} for name in STAGES},
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
        self.summary["out_files"] = sorted(f for f in os.listdir(self.out) if not f.startswith("."))
        path = os.path.join(self.out, "summary.json")
        tmp = os.path.join(self.out, ".summary.json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.summary, f, indent=1)
        os.replace(tmp, path)

    def table(self) -> str:
        s = self.summary
        lines = ["=" * 78,
                 f"gpu_check summary{' (DRY RUN)' if s['dry_run'] else ''}: {s['elapsed_s']:.0f}s of a "
                 f"{s['budget_s']:.0f}s budget{', TERMINATED by ' + s['terminated'] if s['terminated'] else ''}",
                 f"{'stage':<20} {'status':<12} {'secs':>5}  notes"]
        for name, st in s["stages"].items():
            status = st["status"] + (f" rc={st['rc']}" if st["status"] == "failed" and st.get("rc") else "")
            lines.append(f"{name:<20} {status:<12} {st.get('seconds', 0):>5.0f}  {self._notes(name, st)}"[:160])
            for test in (st.get("tests") or {}).get("failed_tests", [])[:8]:
                lines.append(f"{'':<22}FAILED {test}"[:160])
            for p in (st.get("bench") or {}).get("points", []):
                if "k" in p:  # the bucket sweeps
                    lines.append(f"{'':<22}k={p['k']} batch={p['batch']}: {p['tokens_per_s']:.0f} tok/s, "
                                 f"{p['ms_per_decode_step']:.3f} ms/step")
                elif "set" in p:  # speculative vs plain
                    lines.append(f"{'':<22}{p['set']} batch={p['batch']}: {p['plain_tokens_per_s']:.0f} -> "
                                 f"{p['spec_tokens_per_s']:.0f} tok/s ({p['speedup']:.2f}x), "
                                 f"{p['accepted_per_verify']:.2f} accepted/verify, same tokens {p['same_tokens']}")
                elif "tp" in p:
                    lines.append(f"{'':<22}TP={p['tp']} batch={p['batch']}: {p['decode_tokens_per_s']:.0f} tok/s, "
                                 f"collectives {100 * p['collective_share']:.0f}%")
                elif "clients" in p:  # served vs in-process
                    lines.append(f"{'':<22}{p['clients']} clients: served {p['served_tokens_per_s']:.0f} / in-process "
                                 f"{p['in_process_tokens_per_s']:.0f} tok/s = {p['ratio']}, "
                                 f"p99 ITL / window {p['itl_p99_over_window_mean']}")
        bad = [n for n, st in s["stages"].items() if st["status"] in ("failed", "timeout", "killed")]
        lines.append(f"result: {'OK' if not bad else 'FAILED: ' + ', '.join(bad)}; OUT={self.out}")
        lines.append("files: " + ", ".join(s.get("out_files", [])))
        lines.append("=" * 78)
        return "\n".join(lines)

    @staticmethod
    def _notes(name: str, st: dict) -> str:
        notes = []
        if st.get("reason"):
            notes.append(st["reason"])
        env = st.get("env")
        if env:
            notes.append(f"python {env.get('python')} torch {env.get('torch')} cuda {env.get('cuda')} "
                         f"{env.get('gpu', 'no GPU')}")
        if st.get("flashinfer"):
            notes.append(f"flashinfer {st['flashinfer']}")
        check = st.get("check")
        if check:
            notes.append(f"kit check (info): {check['status']}, {check['passed']} PASS {len(check['failed'])} FAIL")
        tests = st.get("tests")
        if tests:
            notes.append(f"{tests['passed']} passed {tests['failed']} failed {tests['errors']} errors "
                         f"{tests['skipped']} skipped")
        elif name.startswith("pytest_") and st["status"] not in ("pending", "skipped"):
            notes.append("no junit XML")
        bench = st.get("bench")
        if bench is not None:
            notes.append(f"{len(bench['points'])} points"
                         + (f", attention {bench['attention_backend']}" if bench.get("attention_backend") else ""))
        elif name.startswith("bench") and st["status"] not in ("pending", "skipped"):
            notes.append("no bench JSON")
        return "; ".join(notes)

    # ------------------------------------------------------------------ stages
    def stage_limit(self, name: str) -> float:
        own = _env_seconds(f"GPU_CHECK_LIMIT_{name.upper()}", _env_seconds(f"GPU_CHECK_LIMIT_{name}", LIMITS[name]))
        return own if name == "env" else min(own, self.left())

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
        limit = self.stage_limit(name)
        if name != "env" and self.left() < MIN_STAGE_S:
            record.update(status="skipped", reason=f"budget spent ({max(self.left(), 0):.0f}s left)", seconds=0)
            self.say(f"=== [{name}] skipped: budget spent")
            self.write_summary()
            return
        if name in NEEDS:
            var, need, dry_skips = NEEDS[name]
            if self.dry:
                need = self.budget + 1 if dry_skips else 0
            need = _env_seconds(var, need)
            if self.left() < need:
                reason = f"needs ~{need:.0f}s ({var}), {max(self.left(), 0):.0f}s left; run it with --only {name}"
                if self.dry and var not in os.environ:
                    reason += " (a dry run rehearses this skip)"
                record.update(status="skipped", seconds=0, reason=reason)
                self.say(f"=== [{name}] skipped: {record['reason']}")
                self.write_summary()
                return
        record.update(status="running", limit_s=round(limit), started_s=round(time.monotonic() - self.t0, 1))
        self.write_summary()
        self.say(f"=== [{name}] start {time.strftime('%H:%M:%S')}, limit {limit:.0f}s, "
                 f"{self.left():.0f}s left of the budget")
        t0 = time.monotonic()
        try:
            if name in self.fail_hooks or name in self.sleep_hooks:
                result = self.hooked(name, limit)
            else:
                fn = self.pytest_stage if name in PYTEST_FILES else getattr(self, "stage_" + name)
                result = fn(name, limit) if name in PYTEST_FILES else fn(limit)
        except Terminated as exc:
            record.update(status="killed", reason=f"check terminated by {exc.args[0]} during this stage",
                          seconds=round(time.monotonic() - t0, 1))
            self.after_stage(name, record)
            raise
        except Exception as exc:  # noqa: BLE001 - a driver bug in one stage must not stop the others
            result = {"status": "failed", "rc": None, "reason": f"driver error: {type(exc).__name__}: {exc}"}
        record.update(result)
        record["seconds"] = round(time.monotonic() - t0, 1)
        self.after_stage(name, record)
        self.say(f"=== [{name}] {record['status']}"
                 + (f" rc={record['rc']}" if record["status"] == "failed" and record.get("rc") else "")
                 + (f" ({record['reason']})" if record.get("reason") else "") + f" in {record['seconds']:.0f}s")
        self.write_summary()

    def after_stage(self, name: str, record: dict) -> None:
        """Key numbers from the stage's files (also after a timeout or a kill)."""
        if name in PYTEST_FILES:
            xml = os.path.join(self.out, f"{name}.xml")
            if os.path.isfile(xml):
                record["xml"] = os.path.basename(xml)
                record["tests"] = junit_counts(xml)
        elif name in ("bench_spec", "bench_tp", "bench_serve"):  # their JSON stays in the work dir ($OUT: 8 files)
            path = os.path.join(self.work, name + ".json")
            if os.path.isfile(path):
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
        stage's status); its kernel checks are informational."""
        deadline = time.monotonic() + limit
        kit = os.path.relpath(self.kit_dir, ROOT)
        have_kit = os.path.isfile(os.path.join(self.kit_dir, "setup.sh"))
        result = {}
        if not have_kit and not self.dry:
            return {"status": "failed", "rc": None, "reason": f"{kit} missing: run --prepare, carry .gpu"}
        if have_kit:
            kit_env = self._kit_env(deadline)
            if kit_env is None:
                return {"status": "failed", "rc": None, "reason": "the kit's setup.sh failed"}
            if self.dry:  # the kit's tvm_ffi/nvtx are cp312: a dry run imports the local flashinfer
                result["setup"] = "ok (not applied in a dry run)"
            else:
                self.env = kit_env
        check = self.run([self.python, os.path.join(ROOT, "profiling", "kit_check.py"), "--kit-dir", self.kit_dir],
                         deadline - time.monotonic(), capture=True)
        lines = check["lines"]
        version = [line.split()[2] for line in lines if line.startswith("INFO  flashinfer ")]
        if not version:
            if self.dry and not have_kit:
                return {"status": "skipped", "rc": check["rc"], "reason": f"no {kit} and no local flashinfer"}
            return {**result, **self.verdict(check), "status": "failed" if not check["timed_out"] else "timeout",
                    "reason": "flashinfer does not import" + (" (local)" if self.dry else " with the kit")}
        self.kit_ok = not self.dry
        result.update(status="ok", rc=0, flashinfer=version[0], source="local" if self.dry else "gpu-kit")
        result["check"] = {
            "status": self.verdict(check)["status"],
            "rc": check["rc"],
            "passed": sum(line.startswith("PASS") for line in lines),
            "failed": [line[6:] for line in lines if line.startswith("FAIL")],
        }
        if result["check"]["status"] != "ok":
            result["reason"] = "the kit check failed (informational, see the log)"
        return result

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
        target = os.path.join(self.work, "kernels") if self.dry else "package"
        result = self.verdict(self.run([self.python, "-c", BUILD_SCRIPT, target], limit))
        if result["rc"] == 42:
            if self.dry:
                return {"status": "skipped", "rc": 42, "reason": "nvcc not found"}
            result["reason"] = "nvcc not found"
        return result

    def pytest_stage(self, name: str, limit: float) -> dict:
        path = PYTEST_FILES[name]
        xml = os.path.join(self.out, f"{name}.xml")
        if os.path.exists(xml):
            os.remove(xml)
        if not os.path.isfile(os.path.join(ROOT, path)):
            return {"status": "skipped", "rc": None, "reason": f"{path} missing"}
        argv = [self.python, "-m", "pytest", path, "-m", "gpu", "-v", "-rfEs", "-p", "no:cacheprovider",
                f"--junitxml={xml}"]
        if self.has_pytest_timeout is None:
            probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pytest_timeout') is None)"
            self.has_pytest_timeout = self.run([self.python, "-c", probe], min(20, limit))["rc"] == 0
        if self.has_pytest_timeout:
            per_test = min(_env_seconds("GPU_CHECK_TEST_TIMEOUT_S", TEST_TIMEOUT_S), limit - GRACE_S[0])
            argv.append(f"--timeout={max(5, int(per_test))}")
        env = dict(self.env, CUBLAS_WORKSPACE_CONFIG=":4096:8",
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
                "--repeats", "1", "--out", os.path.join(self.work, "bench_spec")]
        return self.verdict(self.run(argv, limit))

    def stage_bench_tp(self, limit: float) -> dict:
        """TP=1 vs TP=2 (profiling/bench_tp.py): only where more than one GPU is present."""
        gpus = (self.summary["stages"]["env"].get("env") or {}).get("device_count", 0)
        if not self.dry and gpus < 2:
            return {"status": "skipped", "rc": None, "reason": f"{gpus} GPU(s) here: tensor parallelism needs 2"}
        sizes = (["--device", "cpu", "--preset", "micro", "--batches", "2", "--gen-len", "4", "-k", "2"] if self.dry
                 else ["--device", "cuda", "--batches", "1,16"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_tp.py"), *sizes,
                "--out", os.path.join(self.work, "bench_tp")]
        return self.verdict(self.run(argv, limit))

    def stage_bench_serve(self, limit: float) -> dict:
        """The OpenAI server beside in-process generate (profiling/bench_serve.py): issue 10's goals on a GPU."""
        sizes = (["--clients", "1,2", "--max-tokens", "8", "-k", "2"] if self.dry
                 else ["--preset", "llama-3.2-1b", "--device", "cuda", "--client-procs", "4", "--clients", "1,64,256"])
        argv = [self.python, os.path.join(ROOT, "profiling", "bench_serve.py"), *sizes,
                "--repeats", "1" if self.dry else "2", "--out", os.path.join(self.work, "bench_serve")]
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
                    st.update(status="killed", reason=f"check terminated by {exc.args[0]} during this stage")
                elif st["status"] == "pending":
                    st.update(status="skipped", reason=f"not reached: check terminated by {exc.args[0]}", seconds=0)
            code = 143
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            stages = self.summary["stages"].values()
            bad = [st for st in stages if st["status"] in ("failed", "timeout", "killed")]
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
    args = parser.parse_args(argv)
    try:
        parse_only(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
