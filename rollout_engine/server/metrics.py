"""/metrics in Prometheus' text format: the engine's counters and gauges,
read from `engine.metrics()` at each scrape (prometheus-client)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rollout_engine.server.state import state_of

router = APIRouter()
PREFIX = "rollout_engine_"


class EngineCollector:
    def __init__(self, state):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.state.engine.metrics()
        cache = m["cache"]

        def gauge(name, doc, value, labels=None):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
            if labels:
                g.add_metric(list(labels.values()), value)
            else:
                g.add_metric([], value)
            return g

        yield gauge("running_requests", "requests in the running batch", m["running_requests"])
        yield gauge("waiting_requests", "requests queued for admission", m["waiting_requests"])
        capacity, free = m["kv_capacity_tokens"], m["kv_free_tokens"]
        yield gauge("kv_capacity_tokens", "KV cache capacity in tokens", capacity)
        yield gauge("kv_usage_ratio", "share of the KV cache in use", 1 - free / capacity if capacity else 0.0)
        yield gauge("prefix_cache_hit_rate", "prompt tokens served from the prefix cache, share",
                    cache["hit_rate"] or 0.0)
        yield gauge("weight_version", "version of the weights in use", m["weight_version"])
        yield gauge("paused", "1 while generation is paused", int(bool(m["paused"])))
        yield gauge("admitted_samples", "samples admitted by the server now", self.state.admission.admitted)
        mem = GaugeMetricFamily(PREFIX + "memory_resident", "1 when the tag's memory is resident", labels=["tag"])
        for tag, where in m["memory"].items():
            mem.add_metric([tag], int(where == "resident"))
        yield mem
        for name, doc, value in (
            ("prompt_tokens", "prompt tokens computed (prefill)", cache["prompt_tokens_computed"]),
            ("generation_tokens", "output tokens produced", m["output_tokens"]),
            ("steps", "scheduler steps", cache["steps"]),
            ("retractions", "requests retracted under KV pressure", cache["retractions"]),
            ("step_seconds", "time spent in timed steps", m["step_seconds_total"]),
        ):
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], value)
            yield c
        for name, doc, key in (("step_duration_seconds", "host time of a scheduler step", "step_seconds_histogram"),
                                ("time_to_first_token_seconds", "arrival to first sampled token",
                                 "ttft_seconds_histogram")):
            yield _histogram(PREFIX + name, doc, m[key])
        fin = CounterMetricFamily(PREFIX + "finished_requests", "requests finished, by reason", labels=["reason"])
        for reason, count in m["finished"].items():
            fin.add_metric([reason], count)
        yield fin


def _histogram(name: str, doc: str, h: dict):
    from prometheus_client.core import HistogramMetricFamily

    buckets, running = [], 0
    for bound, count in zip(h["bounds"] + [float("inf")], h["counts"]):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h["sum"])


def registry_for(state):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(EngineCollector(state))
    return registry


@router.get("/metrics")
async def metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    st = state_of(request)
    if st.metrics is None:
        st.metrics = registry_for(st)
    return Response(generate_latest(st.metrics), media_type=CONTENT_TYPE_LATEST)
