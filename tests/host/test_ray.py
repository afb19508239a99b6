"""distributed_executor_backend="ray": on a local Ray cluster of CPU workers, TP=2 and PP=2 give the single-rank
tokens with ranks 1..N-1 as Ray actors, a killed actor is a TPWorkerError naming its rank, and shutdown leaves no
actor or placement group behind."""

from __future__ import annotations

import importlib.util
import time

import pytest

from graphdecode import LLM, SamplingParams
from tests.helpers import SMALL_ENGINE, assert_rank_loss_named, random_prompts, token_prompts

ray = pytest.importorskip("ray")  # a test dependency (pyproject's [test]); the refusal without it is tested below

MODEL = "llama_gqa_llama3"
PARAMS = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=10)]


def outputs(llm, prompts) -> list:
    return [[[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]
            for params in PARAMS]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_ray_actors_give_the_single_rank_tokens(cluster, tiny_models, tp, pp):
    prompts = token_prompts(random_prompts(5, [3, 20, 41]))
    want = outputs(LLM(tiny_models[MODEL], **SMALL_ENGINE), prompts)
    with LLM(tiny_models[MODEL], tensor_parallel_size=tp, pipeline_parallel_size=pp,
             distributed_executor_backend="ray", cpu_threads=1, **SMALL_ENGINE) as llm:
        assert outputs(llm, prompts) == want
        ranks = llm.engine.executor.ranks._local
        assert len(ranks.actors) == 1
    deadline = time.monotonic() + 30  # the actor and its placement group are gone
    while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 3


def test_a_killed_actor_is_named(cluster, tiny_models):
    llm = LLM(tiny_models[MODEL], tensor_parallel_size=2, distributed_executor_backend="ray", cpu_threads=1,
              **SMALL_ENGINE)
    assert_rank_loss_named(llm, lambda: ray.kill(llm.engine.executor.ranks._local.actors[0]), "rank 1")


def test_ray_is_refused_by_name_without_the_package(tiny_models, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match="'ray' needs the ray package"):
        LLM(tiny_models[MODEL], tensor_parallel_size=2, distributed_executor_backend="ray")
