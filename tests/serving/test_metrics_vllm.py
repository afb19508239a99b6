"""/metrics with vLLM's family names and meanings, behind `--metrics-prefix vllm:`, on a live
server: each family exists with vLLM's type and `model_name` label, and its values add up to
what the clients sent and received (docs/metrics.md)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from graphdecode.outputs import CompletionOutput, RequestMetrics, RequestOutput
from graphdecode.server import metrics as server_metrics
from graphdecode.server.metrics import ServerMetrics
from tests.helpers import engine_config_stub, live_server

MODEL = "test-model"
P = "vllm:"
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")
HISTOGRAMS = ("iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
              "request_params_max_tokens",
              "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds")
# long enough to fill whole 16-token pages: the second time it is sent, they are prefix-cache hits
REPEATED = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill. " * 3


@pytest.fixture(scope="module")
def server(text_model, tmp_path_factory):
    with live_server(text_model, tmp_path_factory.mktemp("metrics_server"), MODEL, "-k", "4", "--max-model-len",
                     "512", "--max-batch-size", "8", "--metrics-prefix", P) as url:
        yield url


def scrape(url: str) -> tuple[dict, dict]:
    """(family name -> (type, samples), "sample name{sorted labels without model_name}" -> value)."""
    families, values = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        families[family.name] = (family.type, family.samples)
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return families, values


def test_vllm_families_add_up_to_what_clients_saw(server, client):
    before_families, before = scrape(server)
    prompt_tokens = completion_tokens = 0
    for _ in range(2):  # the same prompt twice: the second hits the prefix cache
        r = client.completions.create(model=MODEL, prompt=REPEATED, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
    stream = client.completions.create(model=MODEL, prompt="Count with me: one, two,", max_tokens=11,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][-1]
    prompt_tokens += usage.prompt_tokens
    completion_tokens += usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    prompt_tokens += chat.usage.prompt_tokens
    completion_tokens += chat.usage.completion_tokens
    requests = 4
    assert completion_tokens == 2 * 6 + 11 + 5

    families, after = scrape(server)
    moved = {name: value - before.get(name, 0) for name, value in after.items()}

    # every family carries the prefix, vLLM's type and the model_name label
    assert all(name.startswith(P) for name in families), [n for n in families if not n.startswith(P)]
    for kind, names in (("gauge", GAUGES), ("counter", COUNTERS), ("histogram", HISTOGRAMS)):
        for name in names:
            assert families[P + name][0] == kind, (name, families[P + name][0])
            assert before_families[P + name][1], name  # samples from the start
    for kind, samples in families.values():
        assert all(s.labels.get("model_name") == MODEL for s in samples)
    assert set(before_families) == set(families)  # all present from the start

    # token counters: what the clients were told
    assert moved[f"{P}prompt_tokens_total"] == prompt_tokens
    assert moved[f"{P}generation_tokens_total"] == completion_tokens
    assert moved[f"{P}request_success_total{{finished_reason=length}}"] == requests
    # per-request histograms: one observation per request, summing to the same tokens
    assert moved[f"{P}request_prompt_tokens_count"] == requests
    assert moved[f"{P}request_prompt_tokens_sum"] == prompt_tokens
    assert moved[f"{P}request_generation_tokens_count"] == requests
    assert moved[f"{P}request_generation_tokens_sum"] == completion_tokens
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert moved[f"{P}{name}_count"] == requests, name
        assert moved[f"{P}{name}_sum"] >= 0, name
    # per token after each request's first output; the gaps fit inside the requests' lifetimes
    itl = moved[f"{P}inter_token_latency_seconds_count"]
    assert 0 < itl <= completion_tokens - requests
    e2e = moved[f"{P}e2e_request_latency_seconds_sum"]
    assert moved[f"{P}inter_token_latency_seconds_sum"] <= e2e
    assert moved[f"{P}time_to_first_token_seconds_sum"] <= e2e
    engine_side = sum(moved[f"{P}request_{part}_time_seconds_sum"] for part in ("queue", "prefill", "decode"))
    assert engine_side <= e2e  # arrival in the core to last token, inside HTTP arrival to last output

    # prefix cache, in tokens (vLLM V1): every prompt token looked up, the repeated prompt's pages found
    queries, hits = moved[f"{P}prefix_cache_queries_total"], moved[f"{P}prefix_cache_hits_total"]
    assert moved[f"{P}num_preemptions_total"] == 0
    assert queries == prompt_tokens
    assert 0 < hits <= queries and hits >= 16
    assert after[f"{P}prefix_cache_hits_total"] <= after[f"{P}prefix_cache_queries_total"]
    assert moved[f"{P}prefill_tokens_total"] == queries - hits  # the hits were not computed again

    # the requests' params, once per finished request
    assert moved[f"{P}request_params_n_count"] == requests and moved[f"{P}request_params_n_sum"] == requests
    assert moved[f"{P}request_params_max_tokens_count"] == requests
    assert moved[f"{P}request_params_max_tokens_sum"] == 2 * 6 + 11 + 5

    # tokens per engine step (vLLM's): each request's whole prompt, prefix-cache hits included, in the step of
    # its first token, plus every token generated
    assert moved[f"{P}iteration_tokens_total_count"] >= 1
    assert moved[f"{P}iteration_tokens_total_sum"] == prompt_tokens + moved[f"{P}engine_generated_tokens_total"]
    assert after[f"{P}iteration_tokens_total_bucket{{le=+Inf}}"] == after[f"{P}iteration_tokens_total_count"]
    assert after[f"{P}iteration_tokens_total_bucket{{le=1.0}}"] <= after[f"{P}iteration_tokens_total_count"]

    # the KV cache's configuration, as vLLM's cache_config_info labels
    (info,) = families[f"{P}cache_config_info"][1]
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"
    assert int(info.labels["num_gpu_blocks"]) > 0 and info.labels["cache_dtype"] == "auto"

    # idle now: nothing in the batch, no KV page held
    assert after[f"{P}num_requests_running"] == 0 and after[f"{P}num_requests_waiting"] == 0
    assert after[f"{P}kv_cache_usage_perc"] == 0.0
    assert after[f"{P}num_requests_unfinished"] == 0


def test_gauges_while_a_request_runs(server):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 80, "stream": True, "ignore_eos": True}
    seen = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server}/v1/completions", json=body) as response:
        chunks = 0
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += json.loads(line[6:])["choices"][0]["finish_reason"] is None
            if chunks == 3:  # mid-stream: the core's latest load has the request in its batch
                seen.append(scrape(server)[1])
    (mid,) = seen
    assert mid[f"{P}num_requests_running"] == 1 and mid[f"{P}num_requests_waiting"] == 0
    assert 0 < mid[f"{P}kv_cache_usage_perc"] <= 1
    assert mid[f"{P}num_requests_unfinished"] == 1


def test_inter_token_latency_is_per_token():
    """An output of k tokens after a gap g is k observations of g / k; the first output's tokens
    (time to first token) are none."""
    engine = SimpleNamespace(config=engine_config_stub(), load={}, dead=None)
    m = ServerMetrics(engine, MODEL, P)
    clock = iter([1.0, 1.4, 1.5])  # the first output, one 4 tokens later, one of 1 token

    def out(tokens, finished=False):
        c = CompletionOutput(0, "", list(range(tokens)), "length" if finished else None)
        return RequestOutput("r", None, [1, 2, 3], [c], finished, metrics=RequestMetrics(arrival_time=0.0))

    tracker = m.track("r", 3, 0.5)
    real = server_metrics.time.perf_counter
    server_metrics.time.perf_counter = lambda: next(clock)
    try:
        for o in (out(2), out(4), out(1, finished=True)):
            tracker.on_output(o)
    finally:
        server_metrics.time.perf_counter = real
    tracker.close()
    values = {s.name: s for f in text_string_to_metric_families(m.exposition()[0].decode()) for s in f.samples
              if not s.name.endswith("_bucket")}
    assert values[f"{P}inter_token_latency_seconds_count"].value == 5  # 4 + 1; not the first output's 2
    assert values[f"{P}inter_token_latency_seconds_sum"].value == pytest.approx(0.4 + 0.1)
    assert values[f"{P}time_to_first_token_seconds_sum"].value == pytest.approx(0.5)
    assert values[f"{P}generation_tokens_total"].value == 7
    assert values[f"{P}prompt_tokens_total"].value == 3
    assert values[f"{P}request_generation_tokens_sum"].value == 7


def test_speculation_counts_under_vllms_spec_decode_names(tiny_models):
    """The engine's speculative counters as vLLM's spec_decode family: rounds, drafts, accepted drafts, and
    accepted drafts per draft position."""
    from graphdecode import LLM, SamplingParams
    from tests.helpers import SMALL_ENGINE, random_prompts

    llm = LLM(tiny_models["llama_gqa_llama3"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **SMALL_ENGINE)
    llm.engine.spec_policy.speculate = lambda bucket, rows=(): True
    prompts = [{"prompt_token_ids": (b * 12)[:30]} for b in random_prompts(3, [3, 5], seed=2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stats = llm.stats()
    m = ServerMetrics(SimpleNamespace(config=llm.config, load=llm.engine.load(), dead=None), MODEL, P)
    values = {s.name: s.value for f in text_string_to_metric_families(m.exposition()[0].decode()) for s in f.samples}
    assert values[f"{P}spec_decode_num_drafts_total"] == stats["spec_verifies"] > 0
    assert values[f"{P}spec_decode_num_draft_tokens_total"] == stats["spec_draft_tokens"]
    assert values[f"{P}spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"] > 0
    # per draft position: they sum to the accepted drafts, and a later position never accepts more
    samples = {s.labels["position"]: s.value for f in text_string_to_metric_families(m.exposition()[0].decode())
               for s in f.samples if s.name == f"{P}spec_decode_num_accepted_tokens_per_pos_total"}
    per_position = [samples[str(j)] for j in range(3)]
    assert per_position == list(stats["spec_accepted_per_position"])
    assert sum(per_position) == stats["spec_accepted_tokens"] and per_position == sorted(per_position, reverse=True)
    # stats() is a snapshot: more accepted drafts later leave it as it was
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert stats["spec_accepted_per_position"] == per_position
    assert sum(llm.stats()["spec_accepted_per_position"]) > sum(per_position)


@pytest.mark.parametrize("prefix", ["9lives:", "vllm-", "my prefix"])
def test_a_bad_metrics_prefix_is_refused_by_name(prefix, capsys):
    from graphdecode.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--metrics-prefix", prefix])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --metrics-prefix" in err and repr(prefix) in err
    with pytest.raises(ValueError, match="--metrics-prefix"):
        ServerMetrics(SimpleNamespace(load={}), MODEL, prefix)
