"""Prometheus metrics of the HTTP process, in a registry owned by the server (never the global one).

Request-level metrics (counts, token totals, latencies) are recorded by the tokenizer manager as outputs
arrive. Scheduler-level values (queue lengths, KV usage, cache hit rate, forward-path counts) live in the
scheduler process: `/metrics` asks it for a stats snapshot at scrape time and `_SchedulerStatsCollector`
turns that snapshot into gauges and counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

FORWARD_PATHS = ("decode_graph", "decode_eager", "extend_graph", "extend_eager")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                          0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _SchedulerStatsCollector:
    """Exposes the last stats snapshot from the scheduler (see GetStatsReq); nothing before the first."""

    def __init__(self) -> None:
        self.stats: dict | None = None
        self.scheduler_up = True

    def collect(self):
        up = GaugeMetricFamily("duet_scheduler_up", "1 while the scheduler process is alive")
        up.add_metric([], 1.0 if self.scheduler_up else 0.0)
        yield up
        s = self.stats
        if not s:
            return

        def gauge(name: str, doc: str, value) -> GaugeMetricFamily | None:
            if value is None:
                return None
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            return g

        kv_total = s.get("kv_total") or 0
        usage = (s.get("kv_used", 0) / kv_total) if kv_total else 0.0
        families = [
            gauge("duet_num_running_reqs", "requests in the running (decoding) batch", s.get("num_running")),
            gauge("duet_num_waiting_reqs", "requests waiting to be admitted", s.get("num_waiting")),
            gauge("duet_kv_cache_usage", "fraction of KV slots held by running requests", usage),
            gauge("duet_kv_cache_total_tokens", "KV cache size in tokens", s.get("kv_total")),
            gauge("duet_kv_cache_used_tokens", "KV slots held by running requests", s.get("kv_used")),
            gauge("duet_kv_cache_free_tokens", "free KV slots", s.get("kv_free")),
            gauge("duet_kv_cache_cached_tokens", "KV slots held only by the prefix cache", s.get("kv_cached")),
            gauge("duet_cache_hit_rate", "prefix-cache hit rate (cached prompt tokens / prompt tokens)",
                  s.get("cache_hit_rate")),
        ]
        yield from (f for f in families if f is not None)
        if s.get("num_finished") is not None:
            c = CounterMetricFamily("duet_scheduler_finished_requests", "requests finished by the scheduler")
            c.add_metric([], float(s["num_finished"]))
            yield c
        if s.get("spec_verify_steps") is not None:  # speculative decoding is on
            yield gauge("duet_spec_accept_length", "speculative decoding: mean tokens a request emits per verify "
                        "step (accepted drafts + 1)", s.get("spec_accept_length"))
            for key, doc in (("spec_verify_steps", "request-steps that verified drafts"),
                             ("spec_draft_tokens", "draft tokens verified"),
                             ("spec_accepted_tokens", "draft tokens accepted")):
                c = CounterMetricFamily(f"duet_{key}", f"speculative decoding: {doc}")
                c.add_metric([], float(s[key]))
                yield c
        paths = s.get("path_counts") or {}
        c = CounterMetricFamily("duet_forward_passes", "forward passes by path (CUDA graph or eager)",
                                labels=["path"])
        for path in sorted(set(FORWARD_PATHS) | set(paths)):
            c.add_metric([path], float(paths.get(path, 0)))
        yield c


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("duet_requests", "finished generation requests (one per choice)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("duet_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("duet_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("duet_time_to_first_token_seconds", "time to the first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("duet_inter_token_latency_seconds", "time between output tokens",
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("duet_time_per_output_token_seconds",
                              "per request: (e2e - ttft) / (output tokens - 1)",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("duet_e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.dp_routed = Counter("duet_dp_routed_requests", "requests routed to each data-parallel replica",
                                 ["replica"], registry=r)
        self._stats = _SchedulerStatsCollector()
        r.register(self._stats)

    def set_scheduler_stats(self, stats: dict | None, scheduler_up: bool = True) -> None:
        self._stats.stats = stats
        self._stats.scheduler_up = scheduler_up

    def observe_finished(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                         e2e_s: float, ttft_s: float | None) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None and completion_tokens > 1:
            self.tpot.observe(max(0.0, e2e_s - ttft_s) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
