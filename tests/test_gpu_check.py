"""profiling/gpu_check.sh rehearsed on CPU (--dry-run), so a broken script is caught here and not
in the one device slot: every stage runs with its CPU stand-in, summary.json says what happened,
a failing or timed-out stage does not stop the next, --only selects stages, and the summary is
written even when the script is terminated mid-stage. Stages the tests do not need to run for
real are replaced through the script's GPU_CHECK_FAIL / GPU_CHECK_SLEEP hooks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "profiling", "gpu_check.sh")
STAGES = ["env", "kit", "build", "pytest_advance_step", "pytest_flashinfer", "pytest_graphs", "pytest_hf_parity",
          "bench", "bench_spec", "bench_tp", "bench_serve", "bench_compiled"]
PYTEST_STAGES = {name: f"tests/test_gpu_{name[len('pytest_'):]}.py" for name in STAGES if name.startswith("pytest_")}
HOOKS = ("GPU_CHECK_FAIL", "GPU_CHECK_SLEEP", "GPU_CHECK_BUDGET_S", "GPU_CHECK_COMPILED_NEED_S",
         "GPU_CHECK_SERVE_NEED_S", "GPU_CHECK_KIT_DIR")


def _env(out, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOOKS) and not k.startswith("GPU_CHECK_LIMIT_")}
    env.update(OUT=str(out), PYTHON=sys.executable, **{k: str(v) for k, v in extra.items()})
    return env


def _check(out, *args, timeout=120, **extra) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(["bash", SCRIPT, *args], env=_env(out, **extra), capture_output=True, text=True,
                          timeout=timeout)
    path = os.path.join(out, "summary.json")
    summary = json.load(open(path)) if os.path.isfile(path) else None
    return proc, summary


def _flashinfer_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import flashinfer, nvtx, tvm_ffi"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_dry")
    proc, summary = _check(out, "--dry-run", timeout=240)
    return out, proc, summary


def test_dry_run_rehearses_every_stage(dry_run):
    out, proc, summary = dry_run
    assert summary is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = summary["stages"]
    assert list(stages) == STAGES
    assert all(st["status"] in ("ok", "skipped") for st in stages.values()), proc.stdout[-6000:]
    assert proc.returncode == 0 and summary["ok"] and summary["finished"] and summary["dry_run"]
    assert stages["env"]["status"] == "ok" and stages["env"]["env"]["torch"]
    assert stages["kit"]["status"] == ("ok" if _flashinfer_importable() else "skipped")
    assert stages["build"]["status"] == ("ok" if shutil.which("nvcc") else "skipped")
    for name, path in PYTEST_STAGES.items():
        if not os.path.isfile(os.path.join(REPO, path)):
            assert stages[name]["status"] == "skipped" and "missing" in stages[name]["reason"]
            continue
        assert stages[name]["status"] == "ok", name
        assert os.path.isfile(out / f"{name}.xml") and stages[name]["xml"] == f"{name}.xml"
        tests = stages[name]["tests"]
        assert tests["skipped"] > 0 and tests["failed"] == tests["errors"] == 0  # no CUDA: every gpu test skips
    bench = stages["bench"]
    assert bench["status"] == "ok" and bench["json"] == "bench_buckets.json"
    assert [(p["k"], p["batch"]) for p in bench["bench"]["points"]] == [(2, 1), (2, 2)]
    assert all(p["tokens_per_s"] > 0 and p["ms_per_decode_step"] > 0 for p in bench["bench"]["points"])
    spec = stages["bench_spec"]  # speculative vs plain, its numbers in summary.json only
    assert spec["status"] == "ok" and [p["set"] for p in spec["bench"]["points"]] == ["input-grounded", "open-ended"]
    assert all(p["same_tokens"] for p in spec["bench"]["points"])
    tp = stages["bench_tp"]  # rehearsed on CPU (gloo); on a one-GPU machine it is skipped
    assert tp["status"] == "ok" and [p["tp"] for p in tp["bench"]["points"]] == [1, 2] and tp["bench"]["same_tokens"]
    serve = stages["bench_serve"]  # the server beside in-process generate, its numbers in summary.json only
    assert serve["status"] == "ok" and [p["clients"] for p in serve["bench"]["points"]] == [1, 2]
    assert all(p["served_tokens_per_s"] > 0 and p["in_process_tokens_per_s"] > 0 and p["ratio"] > 0
               for p in serve["bench"]["points"])
    assert "2 clients: served" in proc.stdout
    # the dry run takes the bench_compiled skip path: not started when the budget cannot hold it
    compiled = stages["bench_compiled"]
    assert compiled["status"] == "skipped" and "GPU_CHECK_COMPILED_NEED_S" in compiled["reason"]
    assert len(os.listdir(out)) <= 8 and not any(f.endswith(".png") for f in os.listdir(out))  # the device returns 8
    assert "gpu_check summary (DRY RUN)" in proc.stdout and "result: OK" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("====")  # the table is printed last
    assert os.path.getsize(out / "gpu_check.log") > 0


def test_only_bench_reruns_env_and_bench(tmp_path):
    proc, summary = _check(tmp_path, "--dry-run", "--only", "bench", GPU_CHECK_SLEEP="bench:0")
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = [name for name, st in summary["stages"].items() if not st.get("reason", "").startswith("not selected")]
    assert ran == ["env", "bench"] and summary["only"] == ["env", "bench"]
    assert summary["stages"]["bench"]["status"] == "ok"
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".xml")]


def test_failed_and_timed_out_stages_do_not_stop_the_next(tmp_path):
    proc, summary = _check(
        tmp_path, "--dry-run", "--only", "kit,build,bench,bench_compiled",
        GPU_CHECK_FAIL="kit", GPU_CHECK_SLEEP="build:60,bench:0,bench_compiled:0", GPU_CHECK_LIMIT_BUILD=1,
        GPU_CHECK_COMPILED_NEED_S=1,
    )
    stages = summary["stages"]
    assert stages["kit"]["status"] == "failed" and stages["kit"]["rc"] == 3
    assert stages["build"]["status"] == "timeout" and stages["build"]["seconds"] < 15
    assert stages["bench"]["status"] == "ok"
    assert stages["bench_compiled"]["status"] == "ok"  # started: enough budget for its (tiny) need
    assert proc.returncode == 1 and summary["ok"] is False and summary["finished"]
    assert "FAILED: kit, build" in proc.stdout


def test_unknown_stage_is_a_clear_error(tmp_path):
    proc, summary = _check(tmp_path, "--dry-run", "--only", "bench,nonsense")
    assert proc.returncode == 2 and summary is None
    assert "unknown stage 'nonsense'" in proc.stderr and "pytest_graphs" in proc.stderr


def test_summary_is_written_when_terminated_mid_stage(tmp_path):
    proc = subprocess.Popen(["bash", SCRIPT, "--dry-run", "--only", "build,bench"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=_env(tmp_path, GPU_CHECK_SLEEP="build:120,bench:0"))
    summary_path, log_path = tmp_path / "summary.json", tmp_path / "gpu_check.log"
    deadline = time.monotonic() + 60
    try:
        while "sleeping (GPU_CHECK_SLEEP) pid" not in (log_path.read_text() if log_path.exists() else ""):
            assert time.monotonic() < deadline and proc.poll() is None, "the build stage never started"
            time.sleep(0.2)
        assert json.loads(summary_path.read_text())["stages"]["build"]["status"] == "running"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads(summary_path.read_text())
    assert proc.returncode == 143 and summary["terminated"] == "SIGTERM" and not summary["finished"]
    assert summary["stages"]["env"]["status"] == "ok"
    assert summary["stages"]["build"]["status"] == "killed"
    assert summary["stages"]["bench"]["status"] == "skipped" and "terminated" in summary["stages"]["bench"]["reason"]
    assert "TERMINATED by SIGTERM" in output
    sleeper = int(log_path.read_text().split("sleeping (GPU_CHECK_SLEEP) pid")[1].split()[0])
    with pytest.raises(ProcessLookupError):  # the stage's process group was stopped with it
        os.kill(sleeper, 0)
