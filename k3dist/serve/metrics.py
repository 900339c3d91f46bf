"""Prometheus metrics of the server (GET /metrics), in a registry of its own: requests running and waiting, slots in
use, prompt tokens still to prefill, prompt and generation tokens, time to first token, inter-token latency and
end-to-end latency, the seconds spent in prefill and in decode, the prefix snapshots' hits, misses, tokens reused,
bytes held, evictions and hit rate, and each rank's memory against its plan (engine/watch.py: alert when
`resident - base` nears `admitted`)."""

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

        # rank 0's time in prefill forwards (prompt scoring included) and in decode steps: where the time goes
        self.prefill_seconds = Gauge("k3dist_prefill_seconds", "Seconds in prefill (rank 0)", registry=r)
        self.decode_seconds = Gauge("k3dist_decode_seconds", "Seconds in decode steps (rank 0)", registry=r)

        prefix = ("hits", "misses", "tokens_reused", "bytes_held", "snapshots", "branches", "evictions", "demotions")
        prefix += ("hit_rate",)
        self.prefix = {k: Gauge(f"k3dist_prefix_{k}", f"Prefix snapshots: {k}", registry=r) for k in prefix}

        memory = {
            "resident": "What the rank holds: its resident set (CPU) or its allocator's reserved bytes (CUDA)",
            "base": "The rank's bare process (interpreter and libraries), which admitted does not count",
            "admitted": "What the memory plan admitted for the rank; resident - base stays below it",
        }
        self.memory = {k: Gauge(f"k3dist_rank_{k}_bytes", h, ["rank"], registry=r) for k, h in memory.items()}

    def memory_report(self, watch) -> None:
        """Every rank's last reported memory (engine/watch.py), when the engine watches it."""
        for rank, m in enumerate(watch.ranks if watch else ()):
            for key, value in (("resident", m.resident), ("base", m.base), ("admitted", m.admitted)):
                self.memory[key].labels(str(rank)).set(value)

    def prefix_report(self, report: dict | None) -> None:
        for key, gauge in self.prefix.items():
            gauge.set(report[key] if report else 0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
