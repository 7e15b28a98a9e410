"""Load generator and reports of ``mooncake bench``.

Programmatic use::

    from mooncake.bench import BenchConfig, run_benchmark
    report = await run_benchmark(BenchConfig(base_url=..., trace_path=...))
    report.save("run.json"); print(format_table(report))
"""

from mooncake.bench.arrivals import ArrivalSpec
from mooncake.bench.client import RequestRecord
from mooncake.bench.config import BenchConfig
from mooncake.bench.metrics import parse_goodput, summarize
from mooncake.bench.prompts import TokenRange
from mooncake.bench.report import Report, format_table
from mooncake.bench.runner import BenchError, run_benchmark
from mooncake.bench.trace import TraceError, TraceScaling, load_trace
from mooncake.bench.workloads import SharedPrefixSpec

__all__ = [
    "ArrivalSpec", "BenchConfig", "BenchError", "Report", "RequestRecord", "SharedPrefixSpec",
    "TokenRange", "TraceError", "TraceScaling", "format_table", "load_trace", "parse_goodput",
    "run_benchmark", "summarize",
]
