"""The zero-bubble loop: window w+1 is launched before window w's tokens are pythonized, and the
pythonizer's wait is the only place the host waits on the device."""

from __future__ import annotations

import re

from graphdecode import LLM, SamplingParams
from tests.helpers import REPO

PACKAGE = REPO / "graphdecode"


def test_window_is_launched_before_the_previous_one_is_pythonized(tiny_models):
    llm = LLM(tiny_models["llama_head_dim"], num_decode_steps=4, max_model_len=256, max_batch_size=4)
    engine = llm.engine
    log = []
    execute, wait = engine.runner.execute, engine.runner.pythonizer.wait

    def logged_execute(plan):
        pending = execute(plan)
        if pending is not None:
            log.append(("launch", id(pending)))
        return pending

    def logged_wait(pending):
        log.append(("wait", id(pending)))
        return wait(pending)

    engine.runner.execute = logged_execute
    engine.runner.pythonizer.wait = logged_wait
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 30
    launches = [i for i, (kind, _) in enumerate(log) if kind == "launch"]
    waits = {key: i for i, (kind, key) in enumerate(log) if kind == "wait"}
    assert len(launches) >= 7
    for n, at in enumerate(launches[:-1]):
        # window n is waited for only after window n + 1 has been launched
        assert waits[log[at][1]] > launches[n + 1]
    stats = llm.stats()
    for key in ("host_seconds_schedule", "host_seconds_launch", "host_seconds_pythonize", "seconds_blocked"):
        assert stats[key] >= 0.0
    assert stats["host_seconds_launch"] > 0


def test_only_the_pythonizer_waits_on_the_device():
    sync = re.compile(r"\.synchronize\(|\.item\(\)|\.cpu\(\)|\.tolist\(\)|torch\.cuda\.synchronize")
    offenders = []
    device = [PACKAGE / "device" / name for name in ("runner.py", "row_staging.py", "pythonizer.py", "host_memory.py",
                                                     "window.py", "sampler.py")]
    for path in sorted((PACKAGE / "host").glob("*.py")) + device:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if sync.search(line) and not line.strip().startswith("#"):
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    allowed = {"pythonizer.py", "output_processor.py"}  # the wait itself; .tolist() of host numpy arrays
    staging = [o for o in offenders if o.startswith("row_staging.py")]
    assert [o for o in offenders if o.split(":")[0] not in allowed and o not in staging] == []
    assert any("pending.event.synchronize()" in o for o in offenders if o.startswith("pythonizer.py"))
    # the one other wait: a staging buffer's fence, for a copy two flushes old (see row_staging.py)
    assert len(staging) == 1 and staging[0].endswith("fence.synchronize()  # the copy two flushes ago has left this pinned buffer")


def test_no_idle_step_at_batch_turnover(tiny_models):
    """Rows and pages of sequences whose last tokens are already in flight go to waiting requests
    in the very next step: no step launches nothing while requests wait."""
    llm = LLM(tiny_models["llama_head_dim"], num_decode_steps=8, max_model_len=256, max_batch_size=4)
    engine = llm.engine
    idle_while_waiting = 0
    execute = engine.runner.execute

    def counting_execute(plan):
        nonlocal idle_while_waiting
        pending = execute(plan)
        if pending is None and engine.scheduler.waiting:
            idle_while_waiting += 1
        return pending

    engine.runner.execute = counting_execute
    prompts = [{"prompt_token_ids": [3 + i, 4, 5]} for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert idle_while_waiting == 0
    # 4 waves of 4: a prefill + 2 windows each, the turnover overlapped with the next wave's prefill
    assert llm.stats()["windows"] == 8
