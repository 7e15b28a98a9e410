"""The sizing frontier as a PNG: every simulated size by attainment, the frontier, the answer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from mooncake.sim.size import SizeAnswer  # noqa: E402


def plot_frontier(answer: SizeAnswer, path: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=110)
    pts = sorted(answer.evaluated.items())
    xs = [p for (p, _), _ in pts]
    ys = [d for (_, d), _ in pts]
    cs = [r.slo_attainment for _, r in pts]
    sc = ax.scatter(xs, ys, c=cs, cmap="RdYlGn", vmin=0, vmax=1, s=36, edgecolors="k", linewidths=0.4,
                    label="simulated sizes")
    fig.colorbar(sc, ax=ax, label="SLO attainment")
    if answer.frontier:
        fx, fy = zip(*answer.frontier)
        ax.step(fx, fy, where="post", color="tab:blue", label=f"frontier (attainment >= {answer.target:g})")
    if answer.best is not None:
        p, d = answer.best
        ax.scatter([p], [d], marker="*", s=260, color="gold", edgecolors="k", zorder=5,
                   label=f"smallest: {p} prefill + {d} decode")
    ax.set_xlabel("prefill instances")
    ax.set_ylabel("decode instances")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
