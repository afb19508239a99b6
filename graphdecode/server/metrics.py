"""Prometheus metrics of the OpenAI server, in their own CollectorRegistry (docs/metrics.md
lists every family: name, type, meaning, vLLM equivalent).

Every family name starts with the server's prefix (`--metrics-prefix`, default
`graphdecode:`; `vllm:` gives vLLM's own names, for dashboards and gateways built for vLLM),
and every sample carries vLLM's `model_name` label (the served model name). Families with
a vLLM equivalent take vLLM's name after the prefix, and its meaning; the others
(windows, prefill_tokens, requests_aborted, ...) are graphdecode's own.

Two sources:
* measured in the server process, per engine request as its outputs arrive from the core:
  prompt and generation tokens, time to first token, inter-token latency, end-to-end
  latency, tokens per request, completions finished by reason, aborted requests, rejected
  HTTP requests by status; and, once a request finished, its queue / prefill / decode /
  inference times from the timestamps the core put in its RequestOutput.metrics
  (arrival_time, first_scheduled_time, first_token_time, last_token_time, one clock);
* the engine core's gauges and counters (`AsyncLLM.load`, refreshed after every step
  that produced outputs), read at scrape time by a custom collector: sequences running
  and waiting, KV pages in use, prefix-cache lookups, preemptions, windows, prefill and
  generated tokens, the histogram of tokens per engine step. Once the core has died its gauges
  read 0 (the counters keep their last values); while it is alive, `engine_heartbeat_age_seconds`
  says how old they may be (the core beats every second, idle or busy).

Inter-token latency is per token, as vLLM's: one output of a request carries up to k
tokens per choice (a decode window), so the gap since that choice's previous output is
divided over its tokens and observed once per token. The tokens that arrive with a
choice's first token have no gap of their own and are not observed (vLLM: no inter-token
latency for the first output either).

Counters end in `_total` in the exposition.
"""

from __future__ import annotations

import re
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .engine_core import ITERATION_TOKEN_BUCKETS

DEFAULT_METRICS_PREFIX = "graphdecode:"
_PREFIX = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")  # a Prometheus metric name (':' allowed), or its start

# vLLM's buckets, with finer ones below theirs (a CPU or GPU window's tokens come in milliseconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0,
                           10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


def check_metrics_prefix(prefix) -> str:
    """The prefix, if every family name it starts is a valid Prometheus name; else ValueError."""
    if not isinstance(prefix, str) or (prefix and not _PREFIX.fullmatch(prefix)):
        raise ValueError(f"--metrics-prefix: {prefix!r} cannot start Prometheus metric names: use letters, digits, "
                         "'_' and ':', not a digit first (e.g. 'graphdecode:' or 'vllm:')")
    return prefix


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for tokens per request)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# engine.load key -> (name after the prefix, kind, help); see engine_core._load
_ENGINE_METRICS = (
    ("num_running_seqs", "num_requests_running", "gauge",
     "sequences in the engine's batch: decoding, or admitted and prefilling (a request with n > 1 counts n)"),
    ("num_waiting_seqs", "num_requests_waiting", "gauge", "sequences waiting for admission (pages and a row)"),
    ("prefix_cache_queries", "prefix_cache_queries", "counter",
     "prompt tokens looked up in the prefix cache at admission (recomputation after preemption included)"),
    ("prefix_cache_hits", "prefix_cache_hits", "counter", "... of which found there (not computed again)"),
    ("preemptions", "num_preemptions", "counter", "preemptions (a sequence or prefilling group recomputed later)"),
    ("windows", "windows", "counter", "decode windows run (k steps each)"),
    ("prefill_tokens", "prefill_tokens", "counter",
     "tokens prefilled by the engine (prefix-cache hits excluded, recomputation after preemption included)"),
    ("generated_tokens", "engine_generated_tokens", "counter", "tokens generated by the engine"),
    ("requests_finished", "engine_requests_finished", "counter",
     "requests the engine finished (aborted ones included)"),
)


class _EngineCollector:
    """Reads the engine core's latest load at scrape time."""

    def __init__(self, engine, server_metrics: ServerMetrics):
        self.engine = engine
        self.server = server_metrics

    def describe(self):
        return []  # no fixed description: collected afresh at every scrape

    def collect(self):
        engine = self.engine
        dead = bool(getattr(engine, "is_dead", False))
        load = getattr(engine, "load", None) or {}
        prefix, labels, values = self.server.prefix, ["model_name"], [self.server.model_name]

        def family(kind, name, doc, value):
            metric = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(prefix + name, doc, labels=labels)
            metric.add_metric(values, value)
            return metric

        for key, name, kind, doc in _ENGINE_METRICS:
            yield family(kind, name, doc, 0 if dead and kind == "gauge" else load.get(key, 0))
        pages = 0 if dead else load.get("kv_pages", 0)
        yield family("gauge", "kv_cache_usage_perc", "fraction of KV pages held by sequences (0 to 1; cached "
                     "pages nobody holds count as free)", load.get("kv_pages_in_use", 0) / pages if pages else 0.0)
        counts, total = load.get("iteration_tokens", ((0,) * (len(ITERATION_TOKEN_BUCKETS) + 1), 0))
        buckets, cumulative = [], 0
        for bound, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        histogram = HistogramMetricFamily(prefix + "iteration_tokens_total", "tokens per engine step: prompt tokens "
                                          "prefilled plus tokens generated in it (a step runs one window of k)",
                                          labels=labels)
        histogram.add_metric(values, buckets, sum_value=total)
        yield histogram
        yield family("gauge", "num_requests_unfinished", "engine requests the server is streaming or collecting now",
                     len(self.server.active))
        yield family("gauge", "engine_alive", "1 while the engine core process lives, 0 once it has died",
                     int(not dead and getattr(engine, "dead", None) is None))
        yield family("gauge", "engine_heartbeat_age_seconds", "seconds since the server last heard from the engine "
                     "core (it beats every second, idle or busy; /health answers 503 past --heartbeat-timeout)",
                     getattr(engine, "heartbeat_age", 0.0))
        yield family("gauge", "engine_step_seconds", "how long the engine core's step in progress had run at its "
                     "latest heartbeat (0 between steps): a step that does not return grows it",
                     0.0 if dead else getattr(engine, "step_seconds", 0.0))


class ServerMetrics:
    def __init__(self, engine, model_name: str = "graphdecode", prefix: str | None = None):
        self.prefix = p = DEFAULT_METRICS_PREFIX if prefix is None else check_metrics_prefix(prefix)
        self.model_name = model_name
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.active: dict[str, object] = {}  # engine request id -> its RequestTracker (for draining too)
        labels = ["model_name"]

        def counter(name, doc):
            return Counter(p + name, doc, labels, registry=registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(p + name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

        config = getattr(engine, "config", None)
        tokens = token_buckets(getattr(config, "max_model_len", None) or 1 << 20)
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of requests, counted at their first token")
        self.generation_tokens = counter("generation_tokens", "tokens sent to clients")
        self.request_prompt_tokens = histogram("request_prompt_tokens", "prompt tokens per finished engine request",
                                               tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "tokens generated per finished engine request (all its n choices)", tokens)
        self.ttft = histogram("time_to_first_token_seconds",
                              "request arrival to its first generated token, per engine request", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "gap between two successive tokens of a choice (a "
                             "gap between outputs of k tokens is divided over them, once per token)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "request arrival to its last output",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "arrival in the engine to first scheduled (admitted)", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "first scheduled to first token",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "first token to last token",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "first scheduled to last token",
                                        REQUEST_LATENCY_BUCKETS)
        self.finished = Counter(p + "request_success", "completions (choices) finished, by finished_reason",
                                [*labels, "finished_reason"], registry=registry)
        self.aborted = counter("requests_aborted",
                               "engine requests aborted before they finished (client gone, server draining)")
        self.rejected = _ModelBound(Counter(p + "requests_rejected", "HTTP requests refused, by status code",
                                            [*labels, "status"], registry=registry), model_name)
        registry.register(_EngineCollector(engine, self))
        # present (at 0) from the start
        self._finished_children = {reason: self.finished.labels(model_name, reason) for reason in FINISH_REASONS}

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def track(self, request_id: str, num_prompt_tokens: int, arrival: float) -> RequestTracker:
        tracker = RequestTracker(self, request_id, num_prompt_tokens, arrival)
        self.active[request_id] = tracker
        return tracker

    def count_finish(self, reason: str) -> None:
        child = self._finished_children.get(reason)
        if child is None:
            child = self._finished_children[reason] = self.finished.labels(self.model_name, reason)
        child.inc()


class _ModelBound:
    """A labelled metric whose model_name is given: `.labels(status)` is its child for that status."""

    def __init__(self, metric, model_name: str):
        self.metric = metric
        self.model_name = model_name

    def labels(self, *values):
        return self.metric.labels(self.model_name, *values)


def _observe_span(histogram, start: float | None, end: float | None) -> None:
    if start is not None and end is not None:
        histogram.observe(max(end - start, 0.0))


class RequestTracker:
    """Per engine request: TTFT / ITL / tokens as its outputs arrive; `close()` once at the end."""

    __slots__ = ("metrics", "request_id", "num_prompt_tokens", "arrival", "first", "last", "num_tokens",
                 "engine_metrics", "finished", "aborted", "closed")

    def __init__(self, metrics: ServerMetrics, request_id: str, num_prompt_tokens: int, arrival: float):
        self.metrics = metrics
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = arrival
        self.first: float | None = None  # when its first token arrived
        self.last: dict[int, float] = {}  # choice index -> when its latest tokens arrived
        self.num_tokens = 0
        self.engine_metrics = None  # the latest RequestOutput.metrics (the core's timestamps)
        self.finished = False
        self.aborted = False
        self.closed = False

    def on_output(self, out) -> None:
        m = self.metrics
        now = None
        num_tokens = 0
        for c in out.outputs:
            count = len(c.token_ids)
            if count:
                if now is None:
                    now = time.perf_counter()
                last = self.last.get(c.index)
                if last is not None:
                    per_token = (now - last) / count
                    for _ in range(count):
                        m.itl.observe(per_token)
                self.last[c.index] = now
                num_tokens += count
            if c.finish_reason is not None:
                m.count_finish(c.finish_reason)
                self.aborted = self.aborted or c.finish_reason == "abort"
        if num_tokens:
            if self.first is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
                m.prompt_tokens.inc(self.num_prompt_tokens)
            m.generation_tokens.inc(num_tokens)
            self.num_tokens += num_tokens
        if out.metrics is not None:
            self.engine_metrics = out.metrics
        if out.finished:
            self.finished = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        m = self.metrics
        m.active.pop(self.request_id, None)
        if self.finished:
            m.e2e.observe(time.perf_counter() - self.arrival)
            m.request_prompt_tokens.observe(self.num_prompt_tokens)
            m.request_generation_tokens.observe(self.num_tokens)
            t = self.engine_metrics
            if t is not None:
                _observe_span(m.queue_time, t.arrival_time, t.first_scheduled_time)
                _observe_span(m.prefill_time, t.first_scheduled_time, t.first_token_time)
                _observe_span(m.decode_time, t.first_token_time, t.last_token_time)
                _observe_span(m.inference_time, t.first_scheduled_time, t.last_token_time)
        if self.aborted or not self.finished:
            m.aborted.inc()
