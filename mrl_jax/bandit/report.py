"""Outputs of the bandit analysis: summary.md tables, the stability-support plane and learning curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional



def _f(x, nd: int = 3, se=None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if abs(x) != 0 and (abs(x) < 10 ** -nd or abs(x) >= 1e4):
        s = f"{x:.1e}"
    else:
        s = f"{x:.{nd}f}"
    if se is not None and se > 0:
        s += f" ± {se:.1e}" if se < 10 ** -nd else f" ± {se:.{nd}f}"
    return s


def setting_label(s: dict) -> str:
    return f"G={s['G']}, σ={s['sigma']:g}"


def markdown(summary: dict) -> str:
    """summary.md: the headline table per probe, then support / final reward / stability per setting."""
    st = summary["settings"]
    head = st["headline"]
    lines = [f"# Contextual-bandit analysis of the sharing probes ({'quick' if st['quick'] else 'full'} run)", ""]
    env = st["env"]
    lines += [f"Environment: {env['num_contexts']} contexts x {env['num_arms']} arms, {len(env['policies'])} policies "
              f"({', '.join(env['policies'])}), min-p sampler {env['min_p']}. Context kinds per policy: " +
              ", ".join(f"{k} {v['count_per_policy'][0]} (initial success {_f(v['initial_success'])}, raw mass "
                        f"{_f(v['initial_raw_mass'])})" for k, v in env["kinds"].items()) + ".",
              f"Training: SGD lr {st['train']['lr']}, {st['train']['steps']} steps, {st['train']['seeds']} seeds "
              f"(Monte Carlo), plus the exact expected-update flow. Headline setting: {setting_label(head)}.", ""]
    lines += ["## Headline (" + setting_label(head) + ")", "",
              "support = success gained on each policy's out-of-support contexts (sampler success, final - "
              "initial, mean over policies; ± standard error over seeds). exact = same under the exact expected-"
              "update flow. rate = first-order d log(raw correct mass)/d step on those contexts at the start "
              "(exact). update var = E‖u − E u‖² of the first update (over seeds); noise = var / ‖E u‖²; dir var = "
              "1 − ‖E[u/‖u‖]‖² (variance of the unit update direction, scale-free). "
              "collapse = fraction of seeds where a policy ends below half the success it started with on a "
              "context where it had ≥ 0.1. ESS / w var = importance weights of PRP at the start (exact population values; Kish ESS fraction); "
              "ESS (train) = the batch ESS metric of the PRP probe averaged over training (Monte Carlo). "
              "AUC = expected reward averaged over training (learning speed); hard AUC the same on hard contexts.", "",
              "| probe | support | support (exact) | rate | hard AUC | final reward | reward AUC | update var | "
              "noise | dir var | KL/step | collapse | ESS | w var | ESS (train) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in summary["probes"].items():
        s = p["stability"]
        lines.append(
            f"| {name} | {_f(p['support'], se=p['support_se'])} | {_f(p.get('support_exact'))} | "
            f"{_f(p.get('support_rate'), 4)} | {_f(p['hard_auc'])} | "
            f"{_f(p['final_reward'], se=p['final_reward_se'])} | {_f(p['reward_auc'])} | {_f(s['update_var'], 4)} | "
            f"{_f(s['noise_ratio'], 2)} | "
            f"{_f(s['direction_var'], 3)} | "
            f"{_f(s['kl_per_step'], 5)} | {_f(s['collapse_frac'], 2)} | {_f(s.get('weight_ess'), 3)} | "
            f"{_f(s.get('weight_var'), 3)} | {_f(s.get('mc_prp_ess'), 3)} |")
    rows = summary["results"]
    settings = st["grid"]
    names = list(summary["probes"])
    for title, key, nd in (("Support (out-of-support success gained, Monte Carlo)", "support", 3),
                           ("Final expected reward (all contexts, Monte Carlo)", "final_reward", 3),
                           ("Reward AUC (expected reward averaged over training)", "reward_auc", 3),
                           ("Hard-context AUC", "hard_auc", 3),
                           ("Update variance at the start", "update_var", 4),
                           ("Variance of the unit update direction at the start", "direction_var", 3),
                           ("Collapse fraction", "collapse_frac", 2)):
        lines += ["", f"## {title}", "", "| probe | " + " | ".join(setting_label(s) for s in settings) + " |",
                  "|---|" + "---|" * len(settings)]
        for name in names:
            cells = []
            for s in settings:
                r = next((r for r in rows if r["probe"] == name and r["G"] == s["G"] and r["sigma"] == s["sigma"]), None)
                v = None if r is None else (r[key] if key in r else r["stability"].get(key))
                cells.append(_f(v, nd))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if summary.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in summary["notes"]]
    return "\n".join(lines) + "\n"


def plane(summary: dict, path: Path) -> None:
    """plane.png: support (y) against instability (x: update variance; KL per step), one point per probe and
    setting, 95% error bars over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["results"]
    names = list(summary["probes"])
    settings = summary["settings"]["grid"]
    cmap = plt.get_cmap("tab10")
    markers = "osD^v<>pP*X"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (xkey, xse, xlabel) in zip(axes, (("update_var", "update_var_se", "update variance E‖u − Eu‖² (log)"),
                                              ("direction_var", None, "variance of the unit update direction"))):
        for pi, name in enumerate(names):
            for si, s in enumerate(settings):
                r = next((r for r in rows if r["probe"] == name and r["G"] == s["G"] and r["sigma"] == s["sigma"]), None)
                if r is None:
                    continue
                x = r["stability"][xkey]
                x = max(x, 1e-12) if xkey == "update_var" else x
                xe = 1.96 * r["stability"][xse] if xse else None
                ax.errorbar(x, r["support"], yerr=1.96 * r["support_se"], xerr=xe, color=cmap(pi % 10),
                            marker=markers[si % len(markers)], ms=6, alpha=0.85, capsize=2, lw=1,
                            label=name if si == 0 else None)
        if xkey == "update_var":
            from matplotlib.ticker import NullFormatter
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("support: out-of-support success gained")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    from matplotlib.lines import Line2D
    handles += [Line2D([], [], color="gray", marker=markers[si % len(markers)], ls="", label=setting_label(s))
                for si, s in enumerate(settings)]
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    fig.suptitle("Stability-support plane (upper left = favourable; error bars 95% over seeds)")
    fig.tight_layout(rect=(0, 0, 0.86, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(summary: dict, curves_data: dict, path: Path) -> None:
    """curves.png: expected reward (top) and out-of-support success (bottom) over steps, every probe, one
    column per setting; Monte Carlo mean with 95% band, exact expected-update flow dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = summary["settings"]["grid"]
    names = list(summary["probes"])
    cmap = plt.get_cmap("tab10")
    n = len(settings)
    fig, axes = plt.subplots(2, n, figsize=(3.6 * n + 1.5, 6.4), squeeze=False, sharey="row")
    for si, s in enumerate(settings):
        for pi, name in enumerate(names):
            d: Optional[dict] = curves_data.get((name, s["G"], s["sigma"]))
            if d is None:
                continue
            for row, key in enumerate(("all", "oos")):
                ax = axes[row, si]
                steps = d["steps"]
                m, se = d[f"mc_{key}"], d[f"mc_{key}_se"]
                ax.plot(steps, m, color=cmap(pi % 10), lw=1.4, label=name if si == 0 and row == 0 else None)
                ax.fill_between(steps, m - 1.96 * se, m + 1.96 * se, color=cmap(pi % 10), alpha=0.15, lw=0)
                if d.get(f"exact_{key}") is not None:
                    ax.plot(d["exact_steps"], d[f"exact_{key}"], color=cmap(pi % 10), lw=1.0, ls="--")
        axes[0, si].set_title(setting_label(s), fontsize=10)
        axes[1, si].set_xlabel("step")
    axes[0, 0].set_ylabel("expected reward (all contexts)")
    axes[1, 0].set_ylabel("success on out-of-support contexts")
    fig.legend(loc="center right", fontsize=8, frameon=False)
    fig.suptitle("Learning curves: Monte Carlo mean (solid, 95% band) and exact expected-update flow (dashed)")
    fig.tight_layout(rect=(0, 0, 1 - 1.3 / (3.6 * n + 1.5), 0.95))
    fig.savefig(path, dpi=100)
    plt.close(fig)
