"""PNG figures from one or more JSON reports (several runs share each plot)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from mooncake.bench.report import Report  # noqa: E402


def run_labels(paths: list[Path], reports: list[Report]) -> list[str]:
    """The ``--label`` given at run time, else the file name; duplicates get a suffix."""
    labels: list[str] = []
    for path, rep in zip(paths, reports):
        base = rep.label or path.stem
        label, n = base, 2
        while label in labels:
            label, n = f"{base} ({n})", n + 1
        labels.append(label)
    return labels


def _cdf(ax, values_ms: list[float], label: str, color: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reports(paths: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write ttft_cdf.png, tpot_cdf.png, latency_over_time.png, summary.png; return their paths."""
    files = [Path(p) for p in paths]
    reports = [Report.load(p) for p in files]
    labels = run_labels(files, reports)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    for metric, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        key = "ttft_s" if metric == "ttft" else "tpot_s"
        for i, (rep, label) in enumerate(zip(reports, labels)):
            _cdf(ax, [getattr(r, key) * 1000 for r in rep.records if r.ok and getattr(r, key) is not None],
                 label, f"C{i % 10}")
        ax.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction of requests", title=f"{title} CDF",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        written.append(_save(fig, out / f"{metric}_cdf.png"))

    fig, (ax_t, ax_e) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for i, (rep, label) in enumerate(zip(reports, labels)):
        color = f"C{i % 10}"  # one colour per run in both panels
        done = [r for r in rep.records if r.ok and r.ttft_s is not None and r.e2e_s is not None]
        starts = [r.start_s for r in done]
        ax_t.scatter(starts, [r.ttft_s * 1000 for r in done], s=8, alpha=0.6, color=color, label=label)
        ax_e.scatter(starts, [r.e2e_s * 1000 for r in done], s=8, alpha=0.6, color=color, label=label)
        failed = [r for r in rep.records if not r.ok]
        if failed:
            ax_t.scatter([r.start_s for r in failed], [0] * len(failed), marker="x", s=14, color=color,
                         label=f"{label}: failed/429 (at 0)")
    ax_t.set(ylabel="TTFT (ms)", title="Latency over time (by request send time)")
    ax_e.set(xlabel="time since start (s)", ylabel="end-to-end latency (ms)")
    for ax in (ax_t, ax_e):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    written.append(_save(fig, out / "latency_over_time.png"))

    panels = (("request_throughput", "requests/s"), ("output_token_throughput", "output tokens/s"),
              ("goodput", "goodput (req/s)"), ("prefix_hit_rate", "prefix hit rate"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels):
        raw = [rep.summary.get(key) for rep in reports]
        ax.bar(range(len(reports)), [v or 0.0 for v in raw], color=[f"C{i % 10}" for i in range(len(reports))])
        for i, v in enumerate(raw):
            if v is None:  # not measured (no SLOs given / no cache usage reported), not zero
                ax.annotate("n/a", (i, 0), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(reports)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    written.append(_save(fig, out / "summary.png"))
    return written
