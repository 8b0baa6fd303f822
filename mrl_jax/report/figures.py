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


# metric key -> (panel title, y-axis quantity and unit); keys not listed get a label from their name
LABELS = {
    "reward/mean": ("mean reward", "reward per sample"),
    "reward/success_rate": ("success rate", "fraction of samples"),
    "kl": ("KL to the reference", "KL (nats per token)"),
    "entropy": ("entropy of the sampled tokens", "entropy (nats per token)"),
    "sgt/rows_fired": ("SGT: rows fired", "rows per round"),
    "sgt/prompts_failed": ("SGT: prompts failed", "fraction of the round's prompts"),
    "sgt/prompts_rescued": ("SGT: prompts rescued", "prompts per round"),
    "sgt/nll": ("SGT: NLL of peer successes", "NLL (nats per token)"),
    "replay/rows": ("replay: rows", "rows per round"),
    "replay/nll": ("replay: NLL of own successes", "NLL (nats per token)"),
    "xgrpo/adv_on_peer_solved": ("x-GRPO: advantage on peer-solved prompts", "advantage (reward std units)"),
    "xgrpo/peer_solved_frac": ("x-GRPO: peer-solved prompts", "fraction of the round's prompts"),
    "prp/ess": ("PRP: effective sample size", "ESS (fraction of peer tokens)"),
    "prp/ess_sequence": ("PRP: effective sample size of sequences", "ESS (fraction of peer rows)"),
    "prp/weight_var": ("PRP: importance weight variance", "variance (weight^2)"),
    "prp/weight_mean": ("PRP: mean importance weight", "weight (ratio)"),
    "prp/rows": ("PRP: peer rows used", "rows per round"),
    "prp/tokens": ("PRP: peer tokens used", "tokens per round"),
    "prp/residual_frac": ("PRP: residual tokens", "fraction of peer tokens"),
}


def axis_labels(key: str) -> tuple[str, str]:
    """``(title, y label)`` of a metric: the ``LABELS`` entry, else from its name (``*_frac``, ``*_rate`` and
    ``clip_ratio/*`` are fractions; anything else is shown as the value per round)."""
    if key in LABELS:
        return LABELS[key]
    name = key.replace("/", ": ").replace("_", " ")
    if key.startswith("clip_ratio/"):
        return f"clipped ratio ({key.split('/', 1)[1].replace('_', ' ')})", "fraction of tokens"
    if key.endswith(("_frac", "_rate", "/frac")):
        return name, "fraction"
    return name, f"{name} per round"


def _round_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def metric_panels(run: RunRecords, keys: Sequence[str], path: Path, title: str, *, evals: bool = False) -> Path:
    """A grid of panels (one metric each, its own y scale and label) with a line per policy, rounds on the x
    axis (integer ticks), one legend below the panels; ``evals``: the held-out greedy success (a fraction)
    dashed on the success-rate panel, or on a panel of its own."""
    plt = _plt()
    evals = bool(evals and run.evals)
    eval_on = "reward/success_rate" if "reward/success_rate" in keys else None
    panels = list(keys) + (["__eval__"] if evals and eval_on is None else [])
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    height = 3.3 * rows + 0.45   # inches; the bottom 0.45 hold the legend
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, height), squeeze=False)
    colors = {p: f"C{i}" for i, p in enumerate(run.policies)}   # one colour per policy in every panel
    handles = {}
    for ax, key in zip(axes.flat, panels):
        if key == "__eval__":
            ax.set_title("held-out success", fontsize=10)
            ax.set_ylabel("fraction of held-out prompts")
        else:
            for policy in run.policies:
                x, y = run.series(policy, key)
                if len(x):   # a probe's counters exist only for the policies that run it
                    handles[policy], = ax.plot(x, y, marker="." if len(x) < 30 else None, label=policy,
                                               color=colors[policy])
            label, unit = axis_labels(key)
            ax.set_title(label, fontsize=10)
            ax.set_ylabel(unit)
        if evals and key in (eval_on, "__eval__"):
            for policy in run.policies:
                pts = sorted((e["round"], e["success"]) for e in run.evals if e["policy"] == policy)
                if pts:
                    handles[f"{policy} eval"], = ax.plot(*zip(*pts), linestyle="--", marker="o",
                                                         color=colors.get(policy),
                                                         label=f"{policy}: held-out greedy eval")
        _round_axis(ax)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.legend(list(handles.values()), [h.get_label() for h in handles.values()], loc="lower center",
               ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
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
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12.5, 4.2))
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
    fig.colorbar(im, ax=a0, fraction=0.046).set_label("fraction of the round's prompts")
    for i in range(n):
        for j in range(n):
            if i != j:
                a1.plot(comp["rounds"], mats[:, i, j], marker="." if len(comp["rounds"]) < 30 else None,
                        label=f"{names[i]} fails, {names[j]} solves")
    _round_axis(a1)
    a1.set_ylabel("fraction of the round's prompts")
    a1.set_ylim(bottom=0)
    a1.set_title("each ordered pair over rounds", fontsize=10)
    a1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.suptitle("complementarity: prompts one policy fails on and a peer solves")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["LABELS", "axis_labels", "complementarity_figure", "metric_panels"]
