"""The sizing frontier as a PNG: every simulated size with its attainment, the frontier, the answer."""

from __future__ import annotations

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from mooncake.sim.size import SizeAnswer  # noqa: E402


def plot_frontier(answer: SizeAnswer, path: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7.2, 5.4), dpi=110)
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
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("prefill instances (log scale)")
    ax.set_ylabel("decode instances (log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center", framealpha=0.9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
