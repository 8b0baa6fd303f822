"""The report's PNG figures: one panel per metric, one line per policy, rounds on the x axis."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from mrl_jax.report.data import RunRecords


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def metric_panels(run: RunRecords, keys: Sequence[str], path: Path, title: str, *, evals: bool = False) -> Path:
    """A row of panels (one per key) with a line per policy; ``evals``: held-out success on the last panel."""
    plt = _plt()
    cols = min(len(keys), 4)
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = {p: f"C{i}" for i, p in enumerate(run.policies)}   # one colour per policy in every panel
    for ax, key in zip(axes.flat, keys):
        for policy in run.policies:
            x, y = run.series(policy, key)
            if len(x):   # a probe's counters exist only for the policies that run it
                ax.plot(x, y, marker="." if len(x) < 30 else None, label=policy, color=colors[policy])
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("round")
    if evals and run.evals:
        ax = axes.flat[len(keys) - 1]
        for policy in run.policies:
            pts = sorted((e["round"], e["success"]) for e in run.evals if e["policy"] == policy)
            if pts:
                ax.plot(*zip(*pts), linestyle="--", marker="o", color=colors.get(policy),
                        label=f"{policy} eval (held-out greedy)")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if not (evals and run.evals):
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def sampled_eval_figure(run: RunRecords, path: Path) -> Path:
    """One panel per sampled-eval metric (pass@k, avg@K, maj@K): a line per policy, the population dashed."""
    plt = _plt()
    keys = sorted({k for e in run.evals for k in e if "@" in k}, key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
    cols = min(len(keys), 4)
    fig, axes = plt.subplots(math.ceil(len(keys) / cols), cols, figsize=(4.2 * cols, 3.2 * math.ceil(len(keys) / cols)),
                             squeeze=False)
    names = list(dict.fromkeys(e["policy"] for e in run.evals))
    for ax, key in zip(axes.flat, keys):
        for i, name in enumerate(names):
            pts = sorted((e["round"], e[key]) for e in run.evals if e["policy"] == name and key in e)
            if pts:
                pop = name == "population"
                ax.plot(*zip(*pts), marker="o", linestyle="--" if pop else "-", color="k" if pop else f"C{i}",
                        label=name)
        ax.set_title(f"held-out {key}", fontsize=10)
        ax.set_xlabel("round")
    axes.flat[0].legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("sampled held-out evaluation (population: solved by any policy)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def complementarity_figure(comp: dict, path: Path) -> Path:
    """Left: the matrix averaged over rounds; right: each ordered pair (i fails all, j succeeds) over rounds."""
    plt = _plt()
    names = comp["policies"]
    n = len(names)
    mean = np.asarray(comp["mean"], np.float64)
    mats = np.asarray(comp["matrix"], np.float64)
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 4))
    vmax = max(float(mean.max()), 0.05)
    im = a0.imshow(mean, vmin=0.0, vmax=vmax, cmap="viridis")
    for i in range(n):
        for j in range(n):
            a0.text(j, i, f"{mean[i, j]:.3f}", ha="center", va="center", color="w" if mean[i, j] < vmax / 2
                    else "k", fontsize=9)
    a0.set_xticks(range(n), names, rotation=30, ha="right")
    a0.set_yticks(range(n), names)
    a0.set_xlabel("j: has a success")
    a0.set_ylabel("i: fails every sample")
    a0.set_title(f"mean over {len(comp['rounds'])} round(s)")
    fig.colorbar(im, ax=a0, fraction=0.046)
    for i in range(n):
        for j in range(n):
            if i != j:
                a1.plot(comp["rounds"], mats[:, i, j], marker="." if len(comp["rounds"]) < 30 else None,
                        label=f"{names[i]} fails, {names[j]} solves")
    a1.set_xlabel("round")
    a1.set_ylabel("fraction of the round's prompts")
    a1.set_ylim(bottom=0)
    a1.legend(fontsize=8)
    fig.suptitle("complementarity: prompts one policy fails on and a peer solves")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["complementarity_figure", "metric_panels"]
