"""Tensor-parallel ranks beyond one process tree, on loopback: two "nodes" (node 0's engine and a headless
node started as `graphdecode serve --headless`), a torchrun job of two nodes (distributed_executor_backend
"external_launcher"), each giving the single-process tokens; a lost node is an error naming it on the other
side, never a hang; an engine idle longer than the driver's collective timeout keeps its ranks; and the
fields that place the ranks are checked by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from graphdecode import LLM, SamplingParams
from graphdecode.device.tp_rank import COLLECTIVE_TIMEOUT_ENV, free_port
from tests.helpers import REPO, SMALL_ENGINE, assert_rank_loss_named, random_prompts, token_prompts

MODEL = "llama_gqa_llama3"  # 4 query heads, 2 KV heads: an even split over two ranks
PARAMS = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10)]


def env() -> dict:
    root = str(REPO)
    return dict(os.environ, OMP_NUM_THREADS="1", GRAPHDECODE_CPU_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def outputs(llm, prompts) -> list:
    return [[[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
            for params in PARAMS]


@pytest.fixture(scope="module")
def prompts():
    return token_prompts(random_prompts(5, [3, 20, 41]))


@pytest.fixture(scope="module")
def single(tiny_models, prompts):
    return outputs(LLM(tiny_models[MODEL], **SMALL_ENGINE), prompts)


def start_headless(model: str, port: int, log, tp: int = 2, pp: int = 1) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "graphdecode.server.openai_api", "--model", model, "--headless", "-tp", str(tp),
         "-pp", str(pp), "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env(), start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"pid {proc.pid} still ran after {timeout:.0f} s") from None


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_two_nodes_on_loopback_give_the_single_process_tokens(tiny_models, prompts, single, tmp_path, tp, pp):
    """Tensor ranks or pipeline stages on two nodes."""
    port = free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = start_headless(tiny_models[MODEL], port, log, tp, pp)
    try:
        with LLM(tiny_models[MODEL], tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=2, node_rank=0,
                 master_port=port, **SMALL_ENGINE) as llm:
            assert llm.engine.executor.worker_pids == []  # rank 1 is the other node's
            assert outputs(llm, prompts) == single
            # the headless node runs the driver's config (its KV pool), not its own defaults; one layer a stage
            _, sizes = llm.engine.executor.gather_from_workers("sizes")
            assert sizes["kv_cache_bytes"] == llm.engine.runner.memory_sizes()["kv_cache_bytes"]
        assert wait(node1, 60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
    assert "ranks [1] joining tcp://127.0.0.1" in (tmp_path / "node1.log").read_text()


def test_a_lost_node_is_named_by_the_engine(tiny_models, tmp_path):
    port = free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = start_headless(tiny_models[MODEL], port, log)
    llm = LLM(tiny_models[MODEL], tensor_parallel_size=2, nnodes=2, master_port=port, **SMALL_ENGINE)

    def kill():
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()

    assert_rank_loss_named(llm, kill, "rank 1 on node 1")


def test_a_headless_node_leaves_when_the_engine_is_gone(tiny_models, tmp_path):
    """The driver dies without closing: the headless node exits non-zero within seconds, naming its rank."""
    port = free_port()
    script = tmp_path / "driver.py"
    script.write_text(
        "import os\n"
        "from graphdecode import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({tiny_models[MODEL]!r}, tensor_parallel_size=2, nnodes=2, master_port={port}, "
        "max_model_len=64)\n"
        "    llm.generate({'prompt_token_ids': [3, 4]})\n"
        "    os._exit(9)\n"  # no close(): the rank on the other node must notice by itself
    )
    with open(tmp_path / "node1.log", "w") as log:
        node1 = start_headless(tiny_models[MODEL], port, log)
        driver = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                                env=env())
    assert driver.returncode == 9, driver.stderr[-2000:]
    assert wait(node1, 30) != 0
    text = (tmp_path / "node1.log").read_text()
    assert "tensor-parallel rank 1" in text and "rank 1 exited with code 1" in text, text[-2000:]


TORCHRUN_SCRIPT = """
import json, sys
from graphdecode import LLM, SamplingParams
if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend="external_launcher", {engine})
    # from here on this is rank 0 alone: rank 1's LLM() served it, then exited with status 0
    prompts = {prompts!r}
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(n=2, temperature=0.8, seed=3,
                                                                            max_tokens=10)]
    got = [[[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, p)] for p in params]
    json.dump({{"outputs": got, "workers": llm.engine.executor.worker_pids}}, open(out, "w"))
    llm.close()
"""


def test_torchrun_two_nodes_give_the_single_process_tokens(tiny_models, prompts, single, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1` on loopback, one launcher per "node", both running the script."""
    script = tmp_path / "job.py"
    engine = ", ".join(f"{k}={v!r}" for k, v in SMALL_ENGINE.items())
    script.write_text(TORCHRUN_SCRIPT.format(engine=engine, prompts=prompts))
    port, out = free_port(), tmp_path / "out.json"
    nodes = []
    for node in (0, 1):
        log = open(tmp_path / f"torchrun{node}.log", "w")
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(script), tiny_models[MODEL], str(out)],
            stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=tmp_path, start_new_session=True))
        log.close()
    try:
        codes = [wait(p, 180) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = [(tmp_path / f"torchrun{n}.log").read_text()[-3000:] for n in (0, 1)]
    assert codes == [0, 0], logs
    got = json.loads(out.read_text())
    assert got["workers"] == []  # torchrun started rank 1, not the engine
    expected = [[[[list(ids), reason] for ids, reason in row] for row in case] for case in single]
    assert got["outputs"] == expected


def test_an_idle_engine_keeps_its_ranks_past_the_collective_timeout(tiny_models, prompts, single, monkeypatch):
    """The driver bounds each collective by GRAPHDECODE_COLLECTIVE_TIMEOUT_S; its workers wait for the next plan
    however long the engine idles (they once timed out after the driver's 300 s and took the engine down)."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "2")
    with LLM(tiny_models[MODEL], tensor_parallel_size=2, **SMALL_ENGINE) as llm:
        assert outputs(llm, prompts) == single
        time.sleep(4)
        assert outputs(llm, prompts) == single


def test_placement_fields_are_checked_by_name(tiny_models, monkeypatch):
    path = tiny_models[MODEL]
    cases = [
        (dict(distributed_executor_backend="threads"), "distributed_executor_backend"),
        (dict(tensor_parallel_size=2, nnodes=0), "nnodes"),
        (dict(tensor_parallel_size=2, nnodes=4), r"nnodes \(4\) must divide the ranks"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=-1), "node_rank"),
        (dict(tensor_parallel_size=2, nnodes=2, master_port=70000), "master_port"),
        (dict(tensor_parallel_size=2, nnodes=2, master_addr=""), "master_addr"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=1), "--headless"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM(path, **kwargs)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun.*RANK, WORLD_SIZE"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(2\) must equal the launcher.s WORLD_SIZE \(4\)"):
        LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher")


@pytest.mark.parametrize("flags, message", [
    (["--headless", "-tp", "2"], "--nnodes > 1"),
    (["--headless", "-pp", "2", "--nnodes", "2", "--node-rank", "1", "--pp-layer-partition", "2,1"],
     "pp_layer_partition"),
    (["--headless", "-tp", "2", "--nnodes", "2"], "node_rank: node 0 runs the engine"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "--node-rank 1: the server runs on node 0"),
])
def test_serve_refuses_a_misplaced_node(tiny_models, flags, message):
    done = subprocess.run([sys.executable, "-m", "graphdecode.server.openai_api", "--model", tiny_models[MODEL],
                           *flags], capture_output=True, text=True, timeout=120, env=env())
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_a_server_on_node_0_with_a_headless_node(text_model, tmp_path):
    """`graphdecode serve --nnodes 2 --node-rank 0` (its engine core is rank 0) beside `serve --headless` on "node
    1": the server's completions are the single-process engine's."""
    from graphdecode.server.launch import start_server, stop_server

    prompts = ["The capital of France is", "Once upon a time"]
    want = [o.outputs[0].text for o in LLM(text_model, **SMALL_ENGINE).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8))]
    port = free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = start_headless(text_model, port, log, tp=1, pp=2)
    try:
        server, url = start_server(["--model", text_model, "--served-model-name", "m", "-k", "4", "--max-model-len",
                                    "256", "--max-batch-size", "8", "-pp", "2", "--nnodes", "2", "--master-port",
                                    str(port), "--log-level", "warning"], str(tmp_path / "server.log"), env=env(),
                                   timeout_s=180)
        try:
            import httpx

            got = [httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": p, "max_tokens": 8, "temperature": 0}).json()["choices"][0]["text"]
                for p in prompts]
        finally:
            assert stop_server(server) == 0
        assert got == want
        assert wait(node1, 60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
