"""`GET /metrics`: the live numbers in the Prometheus text format, vLLM-shaped, `hetero:` namespace.

One registry per server (no process-global state): two real histograms the engine thread
observes into, and a collector that turns `LiveStats.snapshot()` into gauges and counters at
scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from hetero.app.live import LiveStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REASON = {"cancelled": "abort"}  # vLLM's word for a request that ended early


def make_registry(live: LiveStats) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    ttft = Histogram("hetero:time_to_first_token_seconds", "Time from a request's arrival to its first token.",
                     buckets=TTFT_BUCKETS, registry=reg)
    itl = Histogram("hetero:inter_token_latency_seconds", "Time between two tokens of one request.",
                    buckets=ITL_BUCKETS, registry=reg)
    live.observers.append(lambda kind, seconds: (ttft if kind == "ttft" else itl).observe(seconds))
    reg.register(_LiveCollector(live))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)


class _LiveCollector:
    def __init__(self, live: LiveStats):
        self.live = live

    def collect(self):
        s = self.live.snapshot()
        tot, rates = s["totals"], s["rates"]
        yield _gauge("hetero:num_requests_running", "Requests in the decode batch.", s["running"])
        yield _gauge("hetero:num_requests_waiting", "Requests queued or waiting for their prefill.", s["waiting"])
        yield _counter("hetero:prompt_tokens", "Prompt tokens prefilled.", tot["prompt_tokens"])
        yield _counter("hetero:generation_tokens", "Tokens generated.", tot["generation_tokens"])
        yield _counter("hetero:spec_decode_num_draft_tokens", "Tokens drafted (speculative decoding).",
                       tot["draft_tokens"])
        yield _counter("hetero:spec_decode_num_accepted_tokens", "Drafted tokens the model kept.",
                       tot["accepted_tokens"])
        yield _gauge("hetero:spec_decode_draft_acceptance_rate", "Drafted tokens kept over tokens drafted.",
                     rates["draft_acceptance"])
        done = CounterMetricFamily("hetero:request_success", "Requests finished, by reason.", labels=["finished_reason"])
        for reason, n in sorted(tot["requests"].items()):
            done.add_metric([_REASON.get(reason, reason)], n)
        yield done
        tiers = [("gpu", s["kv"]["gpu"]), ("cpu", s["kv"]["cpu"])]
        yield _by("hetero:kv_cache_tokens", "KV tokens held, per tier.", "tier", [(t, v["tokens"]) for t, v in tiers])
        yield _by("hetero:kv_cache_capacity_tokens", "KV tokens each tier can hold.", "tier",
                  [(t, v["capacity"]) for t, v in tiers])
        yield _by("hetero:kv_cache_usage_perc", "KV cache usage per tier (1 = full).", "tier",
                  [(t, v["usage"]) for t, v in tiers])
        moved = CounterMetricFamily("hetero:transfer_bytes", "Bytes moved between host and device.",
                                    labels=["direction"])
        moved.add_metric(["host_to_device"], tot["h2d_bytes"])
        moved.add_metric(["device_to_host"], tot["d2h_bytes"])
        yield moved
        yield _gauge("hetero:cpu_attention_busy_ratio", "Fraction of the last 10 s the CPU attention kernels ran.",
                     rates["cpu_attention_busy"])
        yield _gauge("hetero:cpu_experts_busy_ratio", "Fraction of the last 10 s the CPU's MoE expert kernels ran "
                     "(0 without experts on the CPU).", rates["cpu_experts_busy"])
        yield _gauge("hetero:gpu_busy_ratio", "Fraction of the last 10 s the GPU was busy (0 without a GPU).",
                     rates["gpu_busy"])
        yield _gauge("hetero:engine_busy_ratio", "Fraction of the last 10 s the engine spent in steps.",
                     rates["engine_busy"])
        mem = s["memory"]
        yield _by("hetero:memory_used_bytes", "Memory in use, per device.", "device",
                  [(d, m["used"]) for d, m in mem.items() if m.get("used") is not None])
        yield _by("hetero:memory_budget_bytes", "The plan's memory budget, per device.", "device",
                  [(d, m["budget"]) for d, m in mem.items() if m.get("budget") is not None])
        split = s["info"].get("split", {})
        yield _by("hetero:plan_kv_tokens_per_seq", "The plan's KV tokens per sequence, per tier.", "tier",
                  [(t, split.get(t, 0)) for t in ("gpu", "cpu")])
        info = InfoMetricFamily("hetero:plan", "The plan being carried out.")
        info.add_metric([], {k: str(v) for k, v in s["info"].items() if k != "split"})
        yield info


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _by(name: str, doc: str, label: str, rows: list[tuple[str, float]]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in rows:
        g.add_metric([key], value)
    return g
