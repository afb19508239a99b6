"""A script that builds a tensor-parallel LLM at its top level, without the
`if __name__ == "__main__":` guard: every spawned worker imports it again and would build the
LLM again. The driver must fail within seconds with an error naming the guard (not wait for a
rendezvous that never completes), and leave no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO

GUARD = 'if __name__ == "__main__"'


def session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session `sid`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            members.append(int(entry))
    return members


def run_script(tmp_path, source: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float, int]:
    script = tmp_path / "script.py"
    script.write_text(source)
    root = str(REPO)  # graphdecode importable from tmp_path
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the script still ran after {timeout:.0f} s:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - start, proc.pid


def test_an_unguarded_tp_script_fails_fast_naming_the_guard(tiny_models, tmp_path):
    model = tiny_models["llama_head_dim"]
    done, elapsed, sid = run_script(tmp_path, (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from graphdecode import LLM\n"
        f"llm = LLM({model!r}, tensor_parallel_size=2, device='cpu', max_model_len=64)\n"
        "print('built', flush=True)\n"
    ))
    assert done.returncode != 0, done.stderr[-3000:]
    assert elapsed < 60
    assert "built" not in done.stdout
    # the driver's error (the traceback's last line) names the guard, the worker and its exit status
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("graphdecode.device.tp_rank.TPWorkerError: tensor-parallel worker 1 "), last
    assert "exited with code 64 before it started" in last and GUARD in last, last
    # the worker said why on its own stderr (inherited), once, and started no process of its own
    assert done.stderr.count("this process (a tensor-parallel worker) is importing the main module") == 1
    assert "bootstrapping phase" not in done.stderr
    deadline = time.monotonic() + 10
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(sid) == []  # no orphan: the script's session is empty


def test_a_worker_dying_in_its_bootstrap_for_another_reason_is_reported_at_once(tiny_models, tmp_path):
    """Not our check this time: the worker's import of the main module fails on its own
    (multiprocessing refuses a process started during bootstrap). The driver still sees the
    worker exit before it started, with its status, and points at the guard as the usual cause."""
    model = tiny_models["llama_head_dim"]
    done, elapsed, sid = run_script(tmp_path, (
        "import multiprocessing\n"
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from graphdecode import LLM\n"
        "if __name__ == '__mp_main__':  # the worker's import of this script\n"
        "    multiprocessing.get_context('spawn').Process(target=print).start()\n"
        f"{GUARD}:\n"
        f"    LLM({model!r}, tensor_parallel_size=2, device='cpu', max_model_len=64)\n"
        "    print('built', flush=True)\n"
    ))
    assert done.returncode != 0 and elapsed < 60 and "built" not in done.stdout
    assert "bootstrapping phase" in done.stderr  # the worker's own error, on the inherited stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "TPWorkerError: tensor-parallel worker 1 " in last and "exited with code 1 before it started" in last, last
    assert "usual cause" in last and GUARD in last, last
    deadline = time.monotonic() + 10
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(sid) == []


def test_a_guarded_tp_script_still_runs(tiny_models, tmp_path):
    model = tiny_models["llama_head_dim"]
    done, _, sid = run_script(tmp_path, (
        "import torch\n"
        "torch.set_num_threads(1)\n"
        "from graphdecode import LLM, SamplingParams\n"
        f"{GUARD}:\n"
        f"    with LLM({model!r}, tensor_parallel_size=2, device='cpu', max_model_len=64) as llm:\n"
        "        out = llm.generate({'prompt_token_ids': [3, 4, 5]}, SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "        print(len(out[0].outputs[0].token_ids), flush=True)\n"
    ), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["3"]
    deadline = time.monotonic() + 10
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(sid) == []
