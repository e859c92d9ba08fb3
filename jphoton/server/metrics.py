"""Prometheus metrics for the gRPC server: per-request latencies observed by the servicer, engine state read at scrape.

Each server gets its own CollectorRegistry (not prometheus_client's global one), so several servers in one process
(tests, benchmarks) do not collide on metric names. With several frontend processes (`jphoton serve --frontends`),
prometheus_client's multiprocess mode sums their request metrics: each process writes its values to files under
PROMETHEUS_MULTIPROC_DIR (set before prometheus_client is imported), and the first frontend's /metrics reads them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess, start_http_server, values
from prometheus_client.core import GaugeMetricFamily

# Decode steps take ~1 ms (GPU) to ~100 ms (CPU); time to first token includes queueing, so it reaches further out.
_TOKEN_BUCKETS = (.001, .0025, .005, .0075, .01, .015, .02, .03, .05, .075, .1, .15, .25, .5, 1.0, 2.5)
_TTFT_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .25, .5, .75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jphoton_time_to_first_token_seconds", "Request arrival to its first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jphoton_inter_token_latency_seconds", "Gap between consecutive tokens of one request",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("jphoton_request_duration_seconds", "Request arrival to its last message",
                             buckets=_TTFT_BUCKETS, registry=r)
        self.requests = Counter("jphoton_requests", "Finished Generate calls by gRPC status code and finish reason",
                                ["code", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("jphoton_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("jphoton_generation_tokens", "Tokens streamed to clients", registry=r)
        self._server = None
        self._engine: _EngineCollector | None = None

    @staticmethod
    def multiprocess() -> bool:
        """prometheus_client writes values to PROMETHEUS_MULTIPROC_DIR (it was set when prometheus_client was
        imported)."""
        return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")) and values.ValueClass is not values.MutexValue

    def watch(self, stats: Callable[[], dict | None]) -> None:
        """Export the engine's gauges, read from `stats()` at each scrape (None while the model is still loading)."""
        self._engine = _EngineCollector(stats)
        self.registry.register(self._engine)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port in a daemon thread; returns the bound port (port 0 picks a free one). In
        multiprocess mode the request metrics are every process's sum."""
        registry = self.registry
        if self.multiprocess():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            if self._engine is not None:
                registry.register(self._engine)
        self._server, _ = start_http_server(port, addr=host, registry=registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _EngineCollector:
    """Gauges computed when Prometheus scrapes, so they are never stale and cost nothing between scrapes."""

    def __init__(self, stats: Callable[[], dict | None]):
        self._stats = stats

    def describe(self):
        return []  # unknown until the first collect: keeps registration from calling stats() early

    def collect(self):
        s = self._stats()
        if s is None:
            return
        gauges = {
            "jphoton_queue_requests": ("Requests admitted by the server and not finished (bounded by --max-queue)",
                                       s["queued"]),
            "jphoton_running_requests": ("Requests in the engine's running batch", s["running"]),
            "jphoton_waiting_requests": ("Requests waiting in the engine for a batch slot or KV pages", s["waiting"]),
            "jphoton_kv_pages_total": ("KV cache pages in the pool", s["kv_pages_total"]),
            "jphoton_kv_pages_free": ("Free KV cache pages", s["kv_pages_free"]),
            "jphoton_kv_pages_evictable": ("KV pages holding a cached prefix no request uses (reused when needed)",
                                           s.get("kv_pages_evictable", 0)),
            "jphoton_kv_usage_ratio": ("Fraction of KV cache pages in use by requests",
                                       1 - (s["kv_pages_free"] + s.get("kv_pages_evictable", 0))
                                       / max(1, s["kv_pages_total"])),
            "jphoton_prefix_hit_tokens": ("Prompt tokens served from the prefix cache since start",
                                          s.get("prefix_hit_tokens", 0)),
            "jphoton_prefix_query_tokens": ("Prompt tokens looked up in the prefix cache since start",
                                            s.get("prefix_query_tokens", 0)),
            "jphoton_num_compiles": ("XLA compilations in this process (stays flat after warm-up)", s["num_compiles"]),
            "jphoton_preemptions": ("Requests preempted for KV pages since start", s.get("preemptions", 0)),
            "jphoton_engine_steps": ("Engine steps launched since start", s.get("steps", 0)),
            "jphoton_step_shapes_compiled": ("Step shapes compiled (the rest compile in the background while serving)",
                                             s["shapes_compiled"]),
            "jphoton_step_shapes_total": ("Step shapes the engine uses once all are compiled", s["shapes_total"]),
            "jphoton_lora_slots_total": ("LoRA adapter slots (0: LoRA off)", s.get("lora_slots_total", 0)),
            "jphoton_lora_slots_loaded": ("LoRA slots serving a loaded adapter", s.get("lora_slots_loaded", 0)),
            "jphoton_lora_slots_draining": ("LoRA slots of unloaded or replaced adapters still used by running requests",
                                            s.get("lora_slots_draining", 0)),
            "jphoton_lora_slots_free": ("LoRA slots a load may use now", s.get("lora_slots_free", 0)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
