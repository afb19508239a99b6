"""The server's periodic log line (vLLM's LoggingStatLogger), for operators who watch logs, not dashboards:

    graphdecode: engine 0: Avg prompt throughput: 412.0 tokens/s, Avg generation throughput: 95.3 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 62.5%

every --log-stats-interval seconds (vLLM's 10), one per engine (each data-parallel replica), from the load the
core sends with its outputs (AsyncLLM.load): prompt tokens prefilled and tokens generated over the interval,
sequences running and waiting now, KV pages held, and the share of prompt tokens looked up in the interval
that the prefix cache held. An idle engine logs one all-zero line when it becomes idle and is then quiet.
--disable-log-stats turns it off.
"""

from __future__ import annotations

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
_TOTALS = ("prefill_tokens", "generated_tokens", "prefix_cache_queries", "prefix_cache_hits")


class StatLogger:
    def __init__(self, engine, interval: float, now: float):
        self.engine = engine
        self.interval = interval
        self._since = now
        self._last = [self._totals(load) for load in self._loads()]
        self._idle = [True] * len(self._last)

    def _loads(self) -> list[dict]:
        replicas = getattr(self.engine, "replicas", None)
        return [r.load or {} for r in replicas] if replicas is not None else [self.engine.load or {}]

    @staticmethod
    def _totals(load: dict) -> tuple[int, ...]:
        return tuple(load.get(key, 0) for key in _TOTALS)

    def lines(self, now: float) -> list[str]:
        """The lines due at `now` (none before the interval has passed, none for an engine idle since its last)."""
        elapsed = now - self._since
        if elapsed < self.interval:
            return []
        out = []
        for i, load in enumerate(self._loads()):
            totals = self._totals(load)
            prefilled, generated, queries, hits = (a - b for a, b in zip(totals, self._last[i]))
            self._last[i] = totals
            running, waiting = load.get("num_running_seqs", 0), load.get("num_waiting_seqs", 0)
            idle = not (prefilled or generated or running or waiting)
            if idle and self._idle[i]:
                continue
            self._idle[i] = idle
            pages = load.get("kv_pages", 0)
            usage = 100 * load.get("kv_pages_in_use", 0) / pages if pages else 0.0
            hit_rate = 100 * hits / queries if queries else 0.0
            out.append(f"engine {i}: Avg prompt throughput: {prefilled / elapsed:.1f} tokens/s, Avg generation "
                       f"throughput: {generated / elapsed:.1f} tokens/s, Running: {running} reqs, Waiting: "
                       f"{waiting} reqs, KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")
        self._since = now
        return out
