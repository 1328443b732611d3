"""/metrics: a Prometheus registry of the server's own, read from the engine's numbers at each scrape."""
from __future__ import annotations

from .engine import Engine


def registry(engine: Engine):
    """A Prometheus registry of its own (several apps may live in one process) reading the engine's numbers."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self):
            s = engine.snapshot()
            c = CounterMetricFamily("infinigen_requests", "Requests by outcome", labels=["outcome"])
            for outcome in ("stop", "length", "cancelled", "error"):
                c.add_metric([outcome], s.get("requests_" + outcome, 0))
            c.add_metric(["rejected"], s.get("rejected", 0))
            yield c
            yield CounterMetricFamily("infinigen_prompt_tokens", "Prompt tokens prefilled",
                                      value=s.get("prompt_tokens", 0))
            yield CounterMetricFamily("infinigen_generation_tokens", "Tokens generated",
                                      value=s.get("completion_tokens", 0))
            yield CounterMetricFamily("infinigen_decode_tokens", "Tokens sampled by decoding steps (a request's "
                                      "first comes from its prefill)", value=s.get("decode_tokens", 0))
            yield CounterMetricFamily("infinigen_decode_seconds", "Seconds spent in decoding steps (prefills "
                                      "between them not counted)", value=s.get("decode_seconds", 0.0))
            yield GaugeMetricFamily("infinigen_tokens_per_second", "Tokens generated per second over the last 10 s",
                                    value=s["tokens_per_s"])
            yield GaugeMetricFamily("infinigen_requests_running", "Requests in the decoding batch", value=s["running"])
            yield GaugeMetricFamily("infinigen_requests_waiting", "Requests waiting for KV memory", value=s["waiting"])
            sizes = dict(engine.batch_sizes)  # a copy: the engine thread may add a size meanwhile
            bounds = sorted({1 << i for i in range(engine.max_batch.bit_length())} | {engine.max_batch})
            yield HistogramMetricFamily("infinigen_decode_batch_size", "Requests decoded together per step",
                                        buckets=[(str(b), sum(c for n, c in sizes.items() if n <= b)) for b in bounds]
                                        + [("+Inf", sum(sizes.values()))],
                                        sum_value=sum(n * c for n, c in sizes.items()))
            if "prefix_cache_hits" in s:  # the prefix cache (serve/prefix.py), when the engine has one
                yield CounterMetricFamily("infinigen_prefix_cache_hits", "Requests that reused a cached prefix",
                                          value=s["prefix_cache_hits"])
                yield CounterMetricFamily("infinigen_prefix_cache_hit_tokens", "Prompt tokens not prefilled again",
                                          value=s["prefix_cache_hit_tokens"])
                yield CounterMetricFamily("infinigen_prefix_cache_evictions", "Cached blocks evicted (LRU)",
                                          value=s["prefix_cache_evictions"])
                yield GaugeMetricFamily("infinigen_prefix_cache_bytes", "Bytes of cached prefix blocks",
                                        value=s["prefix_cache_bytes"])
            if "prefix_cache_disk_hits" in s:  # its folder (--prefix-cache-dir)
                yield CounterMetricFamily("infinigen_prefix_cache_disk_hits", "Requests that reused blocks read "
                                          "from the prefix cache's folder", value=s["prefix_cache_disk_hits"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_hit_tokens", "Prompt tokens read from the "
                                          "prefix cache's folder", value=s["prefix_cache_disk_hit_tokens"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_skipped", "Files of the prefix cache's "
                                          "folder not trusted (corrupt, another model's)",
                                          value=s["prefix_cache_disk_skipped"])
                yield CounterMetricFamily("infinigen_prefix_cache_disk_evictions", "Files of the prefix cache's "
                                          "folder deleted (least recently used)",
                                          value=s["prefix_cache_disk_evictions"])
                yield GaugeMetricFamily("infinigen_prefix_cache_disk_bytes", "Bytes of the prefix cache's folder",
                                        value=s["prefix_cache_disk_bytes"])
            for name, what, key in (
                    ("infinigen_kv_bytes", "KV bytes held by running requests", "kv_{}_bytes"),
                    ("infinigen_kv_reserved_bytes", "KV bytes reserved by running requests", "reserved_{}_bytes"),
                    ("infinigen_kv_budget_bytes", "KV bytes the server admits requests up to", "{}_budget_bytes")):
                g = GaugeMetricFamily(name, what, labels=["tier"])
                for tier in ("fast", "slow"):
                    g.add_metric([tier], s[key.format(tier)])
                yield g

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return registry
