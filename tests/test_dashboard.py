"""The Grafana dashboard queries only metrics the server exports; vLLM's serving metrics exist
from start-up with a model_name label; cumulative ones are Counters; a node's series go with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mooncake.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "mooncake.json"
VLLM_NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
              "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
              "request_queue_time_seconds", "e2e_request_latency_seconds", "time_to_first_token_seconds",
              "inter_token_latency_seconds"]
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names(m: Metrics) -> set[str]:
    """Every sample name the registry can export (whether or not a labelled child exists yet)."""
    names = set()
    for family in m.registry.collect():
        names.update(family.name + s for s in _SUFFIXES[family.type])
    return names


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def test_every_dashboard_query_names_an_exported_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names(Metrics("m"))
    exprs = queries(dashboard)
    assert exprs
    for expr in exprs:
        used = re.findall(r"mooncake:[A-Za-z0-9_:]+", expr)
        assert used, f"query names no mooncake metric: {expr}"
        assert set(used) <= exported, f"{set(used) - exported} in {expr!r} are not exported"


def test_vllm_serving_metrics_are_exported_at_zero_from_start_up():
    text = Metrics("SmolLM2").render().decode()
    samples = {(s.name, s.labels.get("model_name")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    for name in VLLM_NAMES:
        full = "mooncake:" + name
        key = (full + "_count", "SmolLM2") if name.endswith("_seconds") else (full, "SmolLM2")
        assert samples.get(key) == 0, f"{full} is not exported at 0"


def test_node_totals_are_counters_and_leave_with_the_node():
    m = Metrics("x")
    m.report(m.tier_hits, "store-1", ("dram",), 5)
    m.report(m.tier_hits, "store-1", ("dram",), 8)
    m.report(m.kv_rejected, "decode-1", ("token",), 2)
    m.of_node(m.tier_used, "store-1", "dram").set(100)
    text = m.render().decode()
    assert 'mooncake:tier_hits_total{node="store-1",tier="dram"} 8.0' in text
    assert "# TYPE mooncake:kv_blocks_rejected_total counter" in text
    m.report(m.tier_hits, "store-1", ("dram",), 3)  # the node restarted: its total starts over
    assert 'mooncake:tier_hits_total{node="store-1",tier="dram"} 11.0' in m.render().decode()
    m.forget_node("store-1")
    text = m.render().decode()
    assert 'node="store-1"' not in text and 'node="decode-1"' in text
