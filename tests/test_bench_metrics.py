"""Benchmark maths on hand-made records, expected values computed by hand."""

from __future__ import annotations

import pytest

from mooncake.bench.client import RequestRecord
from mooncake.bench.metrics import latency_stats_ms, meets_slos, parse_goodput, summarize


def ok(rid, ttft, e2e, completion, prompt, cached, itl=()):
    return RequestRecord(request_id=rid, session_id=f"s{rid}", turn=0, start_s=0.0, ok=True, status=200,
                         ttft_s=ttft, e2e_s=e2e, itl_s=list(itl), prompt_tokens=prompt,
                         completion_tokens=completion, cached_tokens=cached,
                         usage_reported=cached is not None)


def failed(rid, status, error="x"):
    return RequestRecord(request_id=rid, session_id=f"s{rid}", turn=0, start_s=0.0, ok=False,
                         status=status, error=error)


@pytest.fixture
def records():
    return [
        ok(0, 0.125, 0.625, 5, 100, 50, itl=[0.125] * 4),  # TPOT (0.625-0.125)/4 = 0.125
        ok(1, 0.25, 1.25, 9, 200, 0, itl=[0.0625, 0.1875]),  # TPOT 1.0/8 = 0.125
        ok(2, 0.5, 0.5, 1, 50, None),  # one token: no TPOT; no usage: not in hit rate
        failed(3, 429, "overloaded"),
        failed(4, 500, "boom"),
        failed(5, None, "ConnectError"),
    ]


def test_tpot():
    assert ok(0, 0.125, 0.625, 5, 1, 0).tpot_s == 0.125
    assert ok(0, 0.5, 0.5, 1, 1, 0).tpot_s is None
    assert ok(0, 0.5, 0.5, 0, 1, 0).tpot_s is None
    assert failed(1, 500).tpot_s is None


def test_percentiles_linear_interpolation():
    st = latency_stats_ms([0.125, 0.25, 0.5])
    assert st["mean"] == pytest.approx(875 / 3)
    assert st["median"] == 250
    assert st["p90"] == pytest.approx(450)  # rank 1.8: 250 + 0.8 * 250
    assert st["p99"] == pytest.approx(495)  # rank 1.98: 250 + 0.98 * 250
    assert st["count"] == 3
    assert latency_stats_ms([])["median"] is None
    single = latency_stats_ms([0.01])
    assert single["p99"] == pytest.approx(10) and single["mean"] == pytest.approx(10)


def test_summary_counts_throughput_hit_rate(records):
    s = summarize(records, duration_s=2.0)
    assert (s["requests"], s["completed"], s["rejected_429"], s["errors"]) == (6, 3, 1, 2)
    assert s["error_statuses"] == {"500": 1, "transport": 1}
    assert s["request_throughput"] == 1.5
    assert s["input_token_throughput"] == 175.0  # (100 + 200 + 50) / 2
    assert s["output_token_throughput"] == 7.5  # (5 + 9 + 1) / 2
    assert s["total_token_throughput"] == 182.5
    assert s["prefix_hit_rate"] == pytest.approx(50 / 300)
    assert s["total_cached_tokens"] == 50
    assert s["ttft_ms"]["median"] == 250
    assert s["tpot_ms"] == {"mean": 125.0, "median": 125.0, "p90": 125.0, "p99": 125.0, "count": 2}
    assert s["itl_ms"]["count"] == 6
    assert s["itl_ms"]["mean"] == pytest.approx((4 * 125 + 62.5 + 187.5) / 6)
    e2e = s["e2el_ms"]
    assert (e2e["median"], e2e["p90"], e2e["p99"]) == pytest.approx((625, 1125, 1237.5))
    assert s["goodput"] is None and s["good_requests"] is None


def test_goodput(records):
    slos = parse_goodput(["ttft:250", "tpot:125"])
    assert slos == {"ttft": 250.0, "tpot": 125.0}
    s = summarize(records, 2.0, slos)
    assert s["good_requests"] == 2 and s["goodput"] == 1.0  # r0, r1 (limits inclusive); r2 TTFT 500
    s = summarize(records, 2.0, {"ttft": 500})
    assert s["good_requests"] == 3 and s["goodput"] == 1.5  # 1-token request: TPOT counts as 0
    s = summarize(records, 2.0, {"ttft": 500, "e2el": 1000})
    assert s["good_requests"] == 2  # r1's e2e 1250 ms is over
    s = summarize(records, 2.0, {"tpot": 100})
    assert s["good_requests"] == 1  # only the 1-token request
    assert not meets_slos(records[3], {"ttft": 1e9})


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "foo:10", "ttft:abc", "ttft:0", "tpot:-1"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_no_cache_reporting_gives_no_hit_rate():
    s = summarize([ok(0, 0.1, 0.2, 2, 10, None)], 1.0)
    assert s["prefix_hit_rate"] is None
    assert summarize([], 1.0)["request_throughput"] == 0
