"""Prometheus metrics of one server: request histograms and counters recorded per request, engine gauges read
at scrape time (cache and scheduler counters from `cache_stats()` / `serving_stats()`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SHARE = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0)


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvfuse_requests", "Finished generation requests", ["endpoint", "finish_reason"],
                                registry=r)
        self.errors = Counter("kvfuse_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.ttft = Histogram("kvfuse_ttft_seconds", "Time to first token (queue included)", ["endpoint"],
                              buckets=_LATENCY, registry=r)
        self.queue = Histogram("kvfuse_queue_seconds", "Time spent waiting for the engine", ["endpoint"],
                               buckets=_LATENCY, registry=r)
        self.latency = Histogram("kvfuse_request_seconds", "Request duration, received to last token",
                                 ["endpoint"], buckets=_LATENCY, registry=r)
        self.recompute = Histogram("kvfuse_recompute_fraction", "Share of document tokens recomputed per request "
                                   "(requests with documents)", buckets=_SHARE, registry=r)
        self.prompt_tokens = Counter("kvfuse_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("kvfuse_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("kvfuse_cached_tokens", "Prompt tokens served from document caches",
                                     registry=r)
        self.doc_tokens = Counter("kvfuse_document_tokens", "Document tokens in prompts", registry=r)
        self.recomputed_tokens = Counter("kvfuse_recomputed_document_tokens", "Document tokens recomputed",
                                         registry=r)
        self.doc_hits = Counter("kvfuse_request_cache_hits", "Documents of requests served from cache", registry=r)
        self.doc_misses = Counter("kvfuse_request_cache_misses", "Documents of requests computed (cache misses)",
                                  registry=r)
        self.in_flight = Gauge("kvfuse_requests_in_flight", "Generation requests admitted and not finished",
                               registry=r)
        self.draining = Gauge("kvfuse_draining", "1 while the server is shutting down", registry=r)
        r.register(_EngineCollector(engine))

    def observe(self, endpoint: str, result, seconds: float) -> None:
        """Records one finished request from its GenerationResult."""
        self.requests.labels(endpoint, result.finish_reason).inc()
        self.ttft.labels(endpoint).observe(result.ttft_s)
        self.queue.labels(endpoint).observe(result.queue_s)
        self.latency.labels(endpoint).observe(seconds)
        usage = result.usage()
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        self.cached_tokens.inc(usage["cached_tokens"])
        self.doc_tokens.inc(result.doc_tokens)
        self.recomputed_tokens.inc(result.recomputed_tokens)
        self.doc_hits.inc(result.cache_hits)
        self.doc_misses.inc(result.cache_misses)
        if result.doc_tokens:
            self.recompute.observe(result.recompute_fraction)

    def cancelled(self, endpoint: str) -> None:
        """A request that ended before its result (client gone, shutdown) is counted as cancelled."""
        self.requests.labels(endpoint, "cancelled").inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine counters and gauges, read when scraped."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        cache = self.engine.cache_stats()
        hits, misses = cache.get("hits", 0), cache.get("misses", 0)
        for name in ("hits", "misses", "evictions", "disk_hits", "stale"):
            if name in cache:
                yield CounterMetricFamily(f"kvfuse_cache_{name}", f"Document cache {name} (engine store)",
                                          value=cache[name])
        yield GaugeMetricFamily("kvfuse_cache_hit_rate", "Cache hits over lookups (engine store)",
                                value=hits / (hits + misses) if hits + misses else 0.0)
        for name in ("memory_bytes", "memory_entries"):
            if name in cache:
                yield GaugeMetricFamily(f"kvfuse_cache_{name}", f"Document cache {name.replace('_', ' ')}",
                                        value=cache[name])
        serving = self.engine.serving_stats()
        for name, help_ in (("running", "Requests decoding"), ("queued", "Requests waiting for a slot"),
                            ("batch_size", "Requests in the last decode step"),
                            ("pool_rows_used", "KV pool rows in use"), ("pool_rows_total", "KV pool rows")):
            if name in serving:
                yield GaugeMetricFamily(f"kvfuse_engine_{name}", help_, value=serving[name])
        total = serving.get("pool_rows_total", 0)
        yield GaugeMetricFamily("kvfuse_engine_pool_occupancy", "Share of KV pool rows in use",
                                value=serving.get("pool_rows_used", 0) / total if total else 0.0)
        for name, help_ in (("prefill_graph_replays", "Prefills that replayed a captured CUDA graph"),
                            ("prefill_graph_captures", "Shape-bucket CUDA graphs captured (on a request's path or "
                             "in idle time)"),
                            ("prefill_eager_runs", "Prefills run eagerly (their shape bucket not captured yet)")):
            if name in serving:
                yield CounterMetricFamily(f"kvfuse_engine_{name}", help_, value=serving[name])
        if "prefill_graphs_deferred" in serving:
            yield GaugeMetricFamily("kvfuse_engine_prefill_graphs_deferred",
                                    "Shape buckets waiting for idle time to be captured",
                                    value=serving["prefill_graphs_deferred"])
        if "requests_done" in serving:
            yield CounterMetricFamily("kvfuse_engine_requests_done", "Requests finished by the engine",
                                      value=serving["requests_done"])
