"""profiling/gpu_check.sh rehearsed on CPU (--dry-run), so a broken script is caught here and not
in the one device slot: every stage runs with its CPU stand-in, with and without a prepared kit,
the must-pass core first; summary.json says what happened (each stage's status and need, which
must-pass stages passed, the kernels' register counts from ptxas, per-test durations, failures'
first lines); a failing or timed-out stage does not stop the next; a stage the budget cannot
hold is skipped and one the budget cuts short is `cut`, not failed; the table ends with the
command that reruns them; --only selects stages; a stage's missing Python packages come from
carried wheels or skip it by name, and a missing optional one (outlines_core for pytest_graphs)
skips only the tests that use it; and the summary is written even when the script is
terminated mid-stage. Stages the tests do not need to run for real are replaced through the
script's GPU_CHECK_FAIL / GPU_CHECK_SLEEP hooks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import GPU_CHECK_DRY_RUN_TEST, REPO

SCRIPT = os.path.join(REPO, "profiling", "gpu_check.sh")
CORE = ["env", "kit", "build", "pytest_advance_step", "pytest_flashinfer", "pytest_hf_parity", "pytest_graphs"]
STAGES = CORE + ["pytest_extended", "pytest_hybrid", "pytest_families", "bench", "bench_spec", "pytest_compile",
                 "bench_tp", "bench_serve", "bench_structured", "bench_moe", "bench_quant", "bench_compiled"]
PYTEST_STAGES = ["pytest_advance_step", "pytest_flashinfer", "pytest_hf_parity", "pytest_graphs", "pytest_extended",
                 "pytest_compile", "pytest_hybrid", "pytest_families"]
HOOKS = ("GPU_CHECK_", "GDKIT_")


def _env(out, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(HOOKS)}
    # no kit unless a test prepares one (the checkout's own .gpu/ may or may not hold one)
    env.update(OUT=str(out), PYTHON=sys.executable, GPU_CHECK_KIT_DIR=os.path.join(str(out), "no-kit"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _check(out, *args, timeout=120, **extra) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run(["bash", SCRIPT, *args], env=_env(out, **extra), capture_output=True, text=True,
                          timeout=timeout)
    path = os.path.join(out, "summary.json")
    summary = json.load(open(path)) if os.path.isfile(path) else None
    return proc, summary


@pytest.fixture(scope="session", autouse=True)
def dry_run_started(request, tmp_path_factory):
    """The full dry run takes minutes, one stage's process at a time, so it starts with the
    module, in the background: the rest of the suite runs beside it, and test_dry_run_rehearses_every_stage,
    which tests/conftest.py moves to the session's end, waits for it. Not started when that test is not
    selected."""
    if not any(item.name == GPU_CHECK_DRY_RUN_TEST for item in request.session.items):
        yield None
        return
    out, logs = tmp_path_factory.mktemp("gpu_check_dry"), tmp_path_factory.mktemp("gpu_check_dry_output")
    with open(logs / "stdout", "w") as stdout, open(logs / "stderr", "w") as stderr:  # files: no pipe to fill
        proc = subprocess.Popen(["bash", SCRIPT, "--dry-run"], env=_env(out), stdout=stdout, stderr=stderr,
                                text=True)
    # alone it takes about 170 s; beside two busy workers on two cores it came within seconds of 240 s, once past it
    started = {"out": out, "logs": logs, "proc": proc, "deadline": time.monotonic() + 480}
    try:
        yield started
    finally:
        if proc.poll() is None:  # the test did not wait for it (deselected, interrupted): stop it
            proc.send_signal(signal.SIGTERM)  # the driver stops its stage's process group and writes the summary
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def dry_run(dry_run_started):
    """(OUT, the finished process with its stdout and stderr, summary.json) of the full dry run."""
    out, logs, proc = dry_run_started["out"], dry_run_started["logs"], dry_run_started["proc"]
    try:
        proc.wait(max(dry_run_started["deadline"] - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, (logs / "stdout").read_text(),
                                       (logs / "stderr").read_text())
    path = os.path.join(out, "summary.json")
    return out, done, json.load(open(path)) if os.path.isfile(path) else None


def test_only_bench_reruns_env_and_bench(tmp_path):
    proc, summary = _check(tmp_path, "--dry-run", "--only", "bench", GPU_CHECK_SLEEP="bench:0")
    assert proc.returncode == 0, proc.stdout[-3000:]
    ran = [name for name, st in summary["stages"].items() if not st.get("reason", "").startswith("not selected")]
    assert ran == ["env", "bench"] and summary["only"] == ["env", "bench"]
    assert summary["stages"]["bench"]["status"] == "ok"
    assert "rerun (" not in proc.stdout


def test_failed_and_timed_out_stages_do_not_stop_the_next(tmp_path):
    proc, summary = _check(
        tmp_path, "--dry-run", "--only", "kit,build,bench,bench_compiled",
        GPU_CHECK_FAIL="kit", GPU_CHECK_SLEEP="build:60,bench:0,bench_compiled:0", GPU_CHECK_LIMIT_BUILD=1,
        GPU_CHECK_NEED_BENCH_COMPILED=1,
    )
    stages = summary["stages"]
    assert stages["kit"]["status"] == "failed" and stages["kit"]["rc"] == 3
    assert stages["build"]["status"] == "timeout" and stages["build"]["seconds"] < 15  # its own limit: a failure
    assert stages["bench"]["status"] == "ok"
    assert stages["bench_compiled"]["status"] == "ok"  # started: enough budget for its (tiny) need
    assert proc.returncode == 1 and summary["ok"] is False and summary["finished"]
    assert "FAILED: kit, build" in proc.stdout
    core = summary["must_pass"]
    assert core["passed"] == ["env"] and core["not_passed"]["kit"] == "failed rc=3: test hook"
    assert core["not_passed"]["build"].startswith("timeout")
    assert core["not_passed"]["pytest_graphs"] == "skipped: not selected (--only)"
    assert "must-pass core (*, need ~65s): 1/7 passed (env)" in proc.stdout
    rerun = [line for line in proc.stdout.splitlines() if line.startswith("rerun (")]
    assert len(rerun) == 1 and rerun[0].endswith("bash profiling/gpu_check.sh --dry-run --only kit,build --budget 35")


def test_only_core_selects_the_must_pass_stages_and_hooked_pytest_stages_do_not_pass(tmp_path):
    """`--only core` runs the seven must-pass stages; a pytest stage passes only with tests that
    ran (a hooked one writes no junit XML), the other stages by their status."""
    proc, summary = _check(tmp_path, "--dry-run", "--only", "core",
                           GPU_CHECK_SLEEP=",".join(f"{name}:0" for name in CORE))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert summary["only"] == CORE
    assert [name for name in STAGES if summary["stages"][name]["status"] == "ok"] == CORE
    core = summary["must_pass"]
    assert core["passed"] == ["env", "kit", "build"]
    assert core["not_passed"] == {name: "ok but no junit XML" for name in CORE[3:]}


def test_must_pass_reads_each_core_stage(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "profiling"))
    from gpu_check_report import must_pass

    def tests(passed, failed=0, skipped=0):
        return {"passed": passed, "failed": failed, "errors": 0, "skipped": skipped}

    stages = {"env": {"status": "ok"}, "build": {"status": "failed", "rc": 43, "reason": "registers"},
              "pytest_a": {"status": "ok", "tests": tests(3, skipped=1)},
              "pytest_b": {"status": "ok", "tests": tests(0, skipped=4)},
              "pytest_c": {"status": "cut", "reason": "the budget ran out"}}
    needs = {"env": 10, "build": 20, "pytest_a": 30, "pytest_b": 40, "pytest_c": 50, "bench": 60}
    result = must_pass({"stages": {**stages, "bench": {"status": "failed"}}}, tuple(stages), needs)
    assert result == {"stages": list(stages), "need_s": 150, "passed": ["env", "pytest_a"],
                      "not_passed": {"build": "failed rc=43: registers", "pytest_b": "no test ran (4 skipped)",
                                     "pytest_c": "cut: the budget ran out"}, "ok": False}
    assert must_pass({"stages": stages}, ("env", "pytest_a"), needs)["ok"] is True


def test_budget_skips_what_it_cannot_hold_and_cuts_without_failing(tmp_path):
    """A stage whose need exceeds the budget left is not started; one started with less budget
    than its own limit and stopped by the budget is `cut`: not a failure, but in the rerun. (env is
    hooked too: the budget is then all bench's, and a few seconds show the cut.)"""
    proc, summary = _check(
        tmp_path, "--dry-run", "--only", "build,bench,bench_spec", "--budget", "6",
        GPU_CHECK_SLEEP="env:0,build:0,bench:120,bench_spec:0", GPU_CHECK_NEED_BUILD=1, GPU_CHECK_NEED_BENCH=1,
        GPU_CHECK_NEED_BENCH_SPEC=500,
    )
    stages = summary["stages"]
    assert summary["budget_s"] == 6 and stages["build"]["status"] == "ok", proc.stdout[-3000:]
    assert stages["bench"]["status"] == "cut" and stages["bench"]["seconds"] < 10
    assert "budget ran out" in stages["bench"]["reason"] and "--only bench" in stages["bench"]["reason"]
    spec = stages["bench_spec"]
    assert spec["status"] == "skipped" and spec["rerun"] and spec["need_s"] == 500 and "needs ~500s" in spec["reason"]
    assert proc.returncode == 0 and summary["ok"] and summary["finished"]  # nothing failed
    assert "cut by the budget: bench" in proc.stdout
    assert "--only bench,bench_spec --budget 516" in proc.stdout.rstrip().splitlines()[-2]
    bad = subprocess.run(["bash", SCRIPT, "--dry-run", "--budget", "0"], env=_env(tmp_path), capture_output=True,
                         text=True, check=False)
    assert bad.returncode == 2 and "--budget must be a positive number" in bad.stderr


def _fake_wheel(folder, module: str) -> None:
    """A pure-Python wheel holding one module (what --prepare downloads for bench_serve, in small)."""
    import zipfile

    dist = f"{module}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{module}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{module}.py", "VALUE = 42\n")
        whl.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        whl.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}/RECORD", "")


def test_missing_stage_packages_come_from_carried_wheels_or_skip_by_name(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    common = dict(GPU_CHECK_SLEEP="env:0,bench_serve:0", GPU_CHECK_WHEELS_DIR=wheels,
                  GPU_CHECK_REQUIRE="bench_serve:gdcheck_carried_mod")
    proc, summary = _check(tmp_path / "none", "--dry-run", "--only", "bench_serve", **common)
    serve = summary["stages"]["bench_serve"]
    assert serve["status"] == "skipped" and "gdcheck_carried_mod" in serve["reason"] and "--prepare" in serve["reason"]
    assert "fastapi" not in serve["reason"]  # the server's own packages are installed here
    assert proc.returncode == 0
    _fake_wheel(wheels, "gdcheck_carried_mod")
    proc, summary = _check(tmp_path / "carried", "--dry-run", "--only", "bench_serve", **common)
    serve = summary["stages"]["bench_serve"]
    assert serve["status"] == "ok" and serve["wheels_installed"] == 1, proc.stdout[-2000:]


def test_a_missing_optional_module_does_not_gate_the_stage(tmp_path):
    """pytest_graphs runs without outlines_core (only its structured test would skip): the stage
    records what is missing; an optional module in the carried wheels is installed for it."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "outlines_core.py").write_text("raise ImportError('no outlines_core on this machine')\n")
    proc, summary = _check(tmp_path / "without", "--dry-run", "--only", "pytest_graphs", PYTHONPATH=shadow,
                           GPU_CHECK_WHEELS_DIR=tmp_path / "no-wheels", GPU_CHECK_SLEEP="env:0")
    graphs = summary["stages"]["pytest_graphs"]
    assert graphs["status"] == "ok" and graphs["optional_missing"] == ["outlines_core"], proc.stdout[-3000:]
    assert graphs["tests"]["skipped"] > 0 and graphs["tests"]["failed"] == graphs["tests"]["errors"] == 0
    assert "without outlines_core" in proc.stdout and proc.returncode == 0
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "gdcheck_optional_mod")
    proc, summary = _check(tmp_path / "carried", "--dry-run", "--only", "pytest_graphs", GPU_CHECK_WHEELS_DIR=wheels,
                           GPU_CHECK_OPTIONAL="pytest_graphs:gdcheck_optional_mod", GPU_CHECK_SLEEP="env:0")
    graphs = summary["stages"]["pytest_graphs"]
    assert graphs["status"] == "ok" and graphs["wheels_installed"] == 1, proc.stdout[-3000:]
    assert "optional_missing" not in graphs


def test_bench_tp_on_one_gpu_is_skipped_whatever_the_budget_and_not_rerun(tmp_path):
    """Outside a dry run, bench_tp needs two GPUs: with fewer it is skipped before the budget is
    asked, and stays out of the rerun command (here: no GPU, so env fails for want of CUDA)."""
    proc, summary = _check(tmp_path, "--only", "bench_tp", "--budget", "30")
    tp = summary["stages"]["bench_tp"]
    assert tp["status"] == "skipped" and tp["reason"] == "0 GPU(s) here: tensor parallelism needs 2"
    assert "rerun" not in tp and summary["stages"]["env"]["status"] == "failed" and proc.returncode == 1
    assert proc.stdout.rstrip().splitlines()[-2].endswith("--only env --budget 30")


def test_a_prepared_kit_is_rehearsed_not_applied(tmp_path):
    """--prepare copies the kit (from GDKIT_SRC, else ../shared/gpu-kit beside the checkout); a dry
    run of a prepared checkout runs its setup.sh but reports the stage skipped, saying why, even
    where flashinfer does not import locally (kit_check.py finds none)."""
    src = tmp_path / "kit-src"
    src.mkdir()
    (src / "setup.sh").write_text('echo "unpacking (fake kit)" >&2\necho "export GDKIT_FAKE=1"\n')
    kit = tmp_path / "gpu" / "gpu-kit"
    prep = subprocess.run(["bash", SCRIPT, "--prepare"], capture_output=True, text=True, check=False,
                          env=_env(tmp_path, GDKIT_SRC=src, GPU_CHECK_KIT_DIR=kit, GPU_CHECK_NO_WHEELS=1))
    assert prep.returncode == 0 and (kit / "setup.sh").is_file(), prep.stdout + prep.stderr
    no_flashinfer = tmp_path / "shadow"
    no_flashinfer.mkdir()
    (no_flashinfer / "flashinfer.py").write_text("raise ImportError('no flashinfer on this machine')\n")
    proc, summary = _check(tmp_path / "out", "--dry-run", "--only", "kit", GPU_CHECK_KIT_DIR=kit,
                           PYTHONPATH=no_flashinfer)
    stage = summary["stages"]["kit"]
    assert stage["status"] == "skipped" and "setup.sh unpacked it" in stage["reason"], stage
    assert "no local flashinfer" in stage["reason"]
    assert proc.returncode == 0 and summary["ok"]
    default = subprocess.run(["bash", SCRIPT, "--prepare"], capture_output=True, text=True, check=False,
                             env=_env(tmp_path, GPU_CHECK_KIT_DIR=tmp_path / "default" / "gpu-kit",
                                      GPU_CHECK_NO_WHEELS=1))
    if os.path.isfile(os.path.join(REPO, "..", "shared", "gpu-kit", "setup.sh")):
        assert default.returncode == 0 and (tmp_path / "default" / "gpu-kit" / "setup.sh").is_file()
    else:
        assert default.returncode == 1 and "no gpu-kit at ../shared/gpu-kit" in default.stdout


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
    assert summary["stages"]["build"]["status"] == "cut"  # the check itself was stopped: not a failure
    assert summary["stages"]["bench"]["status"] == "skipped" and "terminated" in summary["stages"]["bench"]["reason"]
    assert "TERMINATED by SIGTERM" in output
    sleeper = int(log_path.read_text().split("sleeping (GPU_CHECK_SLEEP) pid")[1].split()[0])
    with pytest.raises(ProcessLookupError):  # the stage's process group was stopped with it
        os.kill(sleeper, 0)


def test_junit_report_gives_durations_failure_lines_and_skip_reasons(tmp_path, monkeypatch):
    """What summary.json and the table say of a pytest stage, read from a real junit XML."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "profiling"))
    from gpu_check_report import junit_report

    (tmp_path / "test_sample.py").write_text(
        "import time, pytest\n"
        "def test_slow():\n    time.sleep(0.3)\n"
        "def test_wrong():\n    assert [1, 2] == [1, 3], 'tokens differ'\n"
        "def test_broken():\n    raise ValueError(\"attention_backend 'flashinfer' cannot run here\")\n"
        "def test_absent():\n    pytest.skip('FlashInfer cannot run head_dim 64 torch.float16 here')\n")
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "test_sample.py", f"--junitxml={xml}", "-q", "-p",
                    "no:cacheprovider"], cwd=tmp_path, capture_output=True, check=False)
    report = junit_report(str(xml))
    assert (report["passed"], report["failed"], report["skipped"]) == (1, 2, 1)
    assert report["failed_tests"] == ["test_sample::test_wrong", "test_sample::test_broken"]
    wrong, broken = (report["failures"][name] for name in report["failed_tests"])
    assert wrong.startswith("AssertionError: tokens differ") and "test_sample.py:5" in wrong
    assert broken.startswith("ValueError: attention_backend 'flashinfer' cannot run here")
    assert "test_sample.py:7: ValueError" in broken
    assert report["skip_reasons"] == {"test_sample::test_absent": "FlashInfer cannot run head_dim 64 torch.float16 here"}
    names = [name for name, _ in report["durations"]]  # the tests that ran, slowest first
    assert names[0] == "test_sample::test_slow" and len(names) == 3 and report["durations"][0][1] >= 0.3
    assert junit_report(str(tmp_path / "missing.xml")) is None


def test_dry_run_rehearses_every_stage(dry_run):
    out, proc, summary = dry_run
    assert summary is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = summary["stages"]
    assert list(stages) == STAGES
    assert all(st["status"] in ("ok", "skipped") for st in stages.values()), proc.stdout[-6000:]
    assert proc.returncode == 0 and summary["ok"] and summary["finished"] and summary["dry_run"]
    assert all(st["need_s"] > 0 for st in stages.values())
    assert stages["env"]["status"] == "ok" and stages["env"]["env"]["torch"]
    kit = stages["kit"]  # a dry run never applies the kit: skipped, saying why (here: none prepared)
    assert kit["status"] == "skipped" and "a dry run does not apply the kit" in kit["reason"]
    assert "no-kit" in kit["reason"] and "--prepare" in kit["reason"]
    assert stages["build"]["status"] == ("ok" if shutil.which("nvcc") else "skipped")
    for name in PYTEST_STAGES:
        assert stages[name]["status"] == "ok", name
        tests = stages[name]["tests"]
        assert tests["skipped"] > 0 and tests["failed"] == tests["errors"] == 0  # no CUDA: every gpu test skips
        assert set(tests["skip_reasons"].values()) == {"needs CUDA"} and tests["durations"] == []
    selected = {name: set(stages[name]["tests"]["skip_reasons"]) for name in PYTEST_STAGES}
    graphs, compiled, extended = selected["pytest_graphs"], selected["pytest_compile"], selected["pytest_extended"]
    assert compiled and not graphs & compiled  # the compile cases run in their own stage only
    assert all(name.endswith("-True]") for name in compiled)
    # the extended cases of the three files run after the core, and in no core stage
    assert {name.split("::")[0] for name in extended} == {"test_gpu_hf_parity", "test_gpu_graphs", "test_gpu_quantized",
                                                              "test_gpu_lora", "test_gpu_weight_updates"}
    assert not extended & (graphs | selected["pytest_hf_parity"] | compiled)
    assert any("speculative" in name for name in extended) and any("moe" in name for name in extended)
    assert any("teacher_forced" in name for name in selected["pytest_hf_parity"])
    # the must-pass core runs first: every core stage started before any other
    started = [stages[name]["started_s"] for name in STAGES if "started_s" in stages[name]]
    assert started == sorted(started) and stages["pytest_graphs"]["started_s"] < stages["pytest_extended"]["started_s"]
    core = summary["must_pass"]  # a dry run proves no core stage on a GPU: its gpu tests all skip
    assert core["stages"] == CORE and core["need_s"] == sum(stages[name]["need_s"] for name in CORE)
    assert core["ok"] is False and core["passed"] == ["env"] + (["build"] if shutil.which("nvcc") else [])
    assert core["not_passed"]["kit"].startswith("skipped: a dry run does not apply the kit")
    assert core["not_passed"]["pytest_graphs"] == f"no test ran ({stages['pytest_graphs']['tests']['skipped']} skipped)"
    assert f"must-pass core (*, need ~{core['need_s']}s): {len(core['passed'])}/7 passed (env" in proc.stdout
    assert "pytest_graphs*" in proc.stdout and "pytest_extended*" not in proc.stdout
    if shutil.which("nvcc"):  # the build stage's ptxas report: a real nvcc compile for sm_90
        kernels = {k["kernel"]: k for k in stages["build"]["kernels"]}
        assert set(kernels) == {"advance_rows_kernel", "fill_indices_kernel"}
        assert all(k["arch"] == "sm_90" and k["registers"] > 0 for k in kernels.values())
        assert kernels["advance_rows_kernel"]["registers"] <= 64  # __launch_bounds__(1024)
        assert f"advance_rows_kernel {kernels['advance_rows_kernel']['registers']} regs" in proc.stdout
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
    structured = stages["bench_structured"]  # constrained vs unconstrained decode, numbers in summary.json only
    assert structured["status"] == "ok" and [p["batch"] for p in structured["bench"]["points"]] == [1, 2]
    assert all(p["constrained_tokens_per_s"] > 0 and p["ratio"] > 0 for p in structured["bench"]["points"])
    moe = stages["bench_moe"]  # MoE decode beside transformers, grouped and dense experts
    assert moe["status"] == "ok" and [p["batch"] for p in moe["bench"]["points"]] == [1, 2]
    assert all(p["grouped_tokens_per_s"] > 0 and p["dense_tokens_per_s"] > 0 and 0 < p["grouped_moe_share"] < 1
               and p["transformers_tokens_per_s"] > 0 for p in moe["bench"]["points"])
    quant = stages["bench_quant"]  # int4 / FP8 weights and an FP8 KV cache beside bf16, numbers in summary.json
    assert quant["status"] == "ok", quant
    assert {p["format"] for p in quant["bench"]["points"]} == {"bf16", "int4", "fp8", "kv-fp8"}
    assert all(p["tokens_per_s"] > 0 and p["vs_bf16"] > 0 for p in quant["bench"]["points"])
    # the dry run takes the bench_compiled skip path: not started when the budget cannot hold it
    compiled = stages["bench_compiled"]
    assert compiled["status"] == "skipped" and compiled["rerun"] and "--only bench_compiled" in compiled["reason"]
    assert sorted(os.listdir(out)) == ["bench_buckets.json", "gpu_check.log", "summary.json"]  # the device returns 8
    assert "gpu_check summary (DRY RUN)" in proc.stdout and "result: OK" in proc.stdout
    last = proc.stdout.rstrip().splitlines()
    assert last[-1].startswith("====")  # the table is printed last, the rerun command at its end
    assert last[-2].startswith("rerun (") and last[-2].endswith("--only bench_compiled --budget 436")
    assert os.path.getsize(out / "gpu_check.log") > 0
