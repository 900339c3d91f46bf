"""Prometheus metrics of the server (GET /metrics), in a registry of its own: requests running and waiting, slots in
use, prompt tokens still to prefill, prompt and generation tokens, time to first token, inter-token latency and
end-to-end latency, and the prefix snapshots' hits, misses, tokens reused, bytes held, evictions and hit rate."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAPS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, slots: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("k3dist_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("k3dist_requests_waiting", "Requests queued for a slot", registry=r)
        self.slots_used = Gauge("k3dist_slots_used", "Slots holding a request", registry=r)
        self.slots_total = Gauge("k3dist_slots_total", "Slots (generate.batch)", registry=r)
        self.slots_total.set(slots)
        self.prefill_pending = Gauge(
            "k3dist_prefill_tokens_pending",
            "Prompt tokens waiting to be prefilled (queued and partly prefilled)",
            registry=r,
        )
        self.prompt_tokens = Counter("k3dist_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("k3dist_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("k3dist_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "k3dist_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY, registry=r
        )
        self.itl = Histogram("k3dist_inter_token_latency_seconds", "Between tokens", buckets=TOKEN_GAPS, registry=r)
        self.e2e = Histogram("k3dist_e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY, registry=r)

        prefix = ("hits", "misses", "tokens_reused", "bytes_held", "snapshots", "branches", "evictions", "demotions")
        prefix += ("hit_rate",)
        self.prefix = {k: Gauge(f"k3dist_prefix_{k}", f"Prefix snapshots: {k}", registry=r) for k in prefix}

    def prefix_report(self, report: dict | None) -> None:
        for key, gauge in self.prefix.items():
            gauge.set(report[key] if report else 0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
