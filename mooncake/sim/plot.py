"""The sizing answer as a PNG: the disaggregated frontier (every simulated size with its
attainment, the frontier, the answer) and, where the colocated design was sized too, both
designs' attainment against the instances they use."""

from __future__ import annotations

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from mooncake.sim.size import SizeAnswer  # noqa: E402

_LOG2 = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")


def plot_frontier(answer: SizeAnswer, path: str, title: str) -> None:
    both = bool(answer.colocated_evaluated)
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(13.2 if both else 7.2, 5.4), dpi=110, squeeze=False)
    _frontier(axes[0][0], answer)
    if both:
        _designs(axes[0][1], answer)
        title += "\n" + answer.verdict()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _frontier(ax, answer: SizeAnswer) -> None:
    pts = sorted(answer.evaluated.items())
    for meets, marker, color, label in ((True, "o", "tab:green", f"attainment >= {answer.target:g}"),
                                        (False, "X", "tab:red", f"attainment < {answer.target:g}")):
        sel = [(p, d) for (p, d), r in pts if (r.slo_attainment >= answer.target) == meets]
        if sel:
            ax.scatter(*zip(*sel), marker=marker, color=color, s=40, edgecolors="k", linewidths=0.4, label=label)
    for (p, d), r in pts:
        ax.annotate(f"{r.slo_attainment:.2f}", (p, d), textcoords="offset points", xytext=(4, 3), fontsize=6)
    if answer.frontier:
        fx, fy = zip(*answer.frontier)
        ax.step(fx, fy, where="post", color="tab:blue", label="frontier: fewest decode per prefill count")
    if answer.best is not None:
        p, d = answer.best
        ax.scatter([p], [d], marker="*", s=260, color="gold", edgecolors="k", zorder=5,
                   label=f"smallest: {p} prefill + {d} decode")
    ax.set_xscale("log", base=2)  # the search probes up to its bounds; the answer sits near the corner
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(_LOG2)
    ax.yaxis.set_major_formatter(_LOG2)
    ax.set_xlabel("prefill instances (log scale)")
    ax.set_ylabel("decode instances (log scale)")
    ax.set_title("disaggregated", fontsize=9)
    ax.legend(fontsize=8, loc="center", framealpha=0.9)
    ax.grid(alpha=0.3)


def _designs(ax, answer: SizeAnswer) -> None:
    """Attainment by instances in all: the best step budget simulated for each colocated count,
    and the best disaggregated split simulated for each total."""
    best_split: dict[int, float] = {}
    for (p, d), r in answer.evaluated.items():
        best_split[p + d] = max(best_split.get(p + d, 0.0), r.slo_attainment)
    best_budget: dict[int, float] = {}
    for (n, _), r in answer.colocated_evaluated.items():
        best_budget[n] = max(best_budget.get(n, 0.0), r.slo_attainment)
    for label, points, marker, color in (
            ("colocated (best step budget simulated)", sorted(best_budget.items()), "s", "tab:purple"),
            ("disaggregated (best split simulated)", sorted(best_split.items()), "o", "tab:blue")):
        if points:
            ax.plot(*zip(*points), marker=marker, color=color, markersize=5, linewidth=1, label=label)
    designs = answer.designs()
    for key, color in (("colocated", "tab:purple"), ("disaggregated", "tab:blue")):
        if designs[key] is not None:
            ax.axvline(designs[key], color=color, linestyle=":", linewidth=1.2,
                       label=f"{key}: {designs[key]} instances")
    ax.axhline(answer.target, color="k", linestyle="--", linewidth=0.8, label=f"target {answer.target:g}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_LOG2)
    ax.set_xlabel("instances in all (log scale)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.set_title("both designs", fontsize=9)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    ax.grid(alpha=0.3)

