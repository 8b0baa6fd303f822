"""What ``mrl bench probes`` writes from its result: ``PROBES.md`` and the figures, per workload.

``result`` is ``probes.json``'s content: ``{"command", "wall_s", "cpus", "load_1min", "settings",
"workloads": {name: {"title", "settings", "policies", "skills", "curve_label", "probes", "cells"}}, "bandit"}``
where ``probes`` is ``mrl_jax.bench.probes.aggregate``'s ``{probe: {"figures", "vs_none", "curves"}}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

PHASES = ("rollout", "decode", "rewards", "see", "views", "thl", "stage", "update")
STABILITY = (("kl", "KL"), ("grad_norm_spread", "grad-norm spread (std over rounds)"), ("prp_ess", "PRP ESS"),
             ("thl_residual_frac", "THL residual frac"), ("skipped_updates", "skipped updates"))


def _f(d: Optional[dict], digits: int = 3) -> str:
    if not d or d.get("mean") is None:
        return "–"
    se = d.get("se")
    return f"{d['mean']:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def _diff(d: Optional[dict]) -> str:
    if not d or d.get("mean") is None:
        return "–"
    s = f"{d['mean']:+.3f}" + (f" ± {d['se']:.3f}" if d.get("se") is not None else "")
    return s + (f" (p={d['p']:.2g})" if d.get("p") is not None else "")


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _head(cells) -> list[str]:
    return [_row(cells), "|---" * len(cells) + "|"]


def workload_markdown(name: str, w: dict, seeds: int) -> list[str]:
    """One workload's sections: reward@1 (final and gain over the warm start), skills, pass@k, stability, cost."""
    s, agg, names, skills = w["settings"], w["probes"], w["policies"], w["skills"]
    fig = lambda p, k: agg[p]["figures"].get(k)
    vs = lambda p, k: (agg[p].get("vs_none") or {}).get(k)
    warm = s["sft_steps"] if isinstance(s["sft_steps"], int) else " / ".join(map(str, s["sft_steps"]))
    label = w["curve_label"]
    lines = [f"## Task `{name}`: {w['title']}", "",
             f"Policies {', '.join(names)}; {seeds} seed(s), {s['rounds']} RL rounds of {s['prompts_per_round']} "
             f"prompts x {s['num_generations']} samples, warm start {warm} SFT steps; the same warm-started "
             f"policies, data and seeds for every probe; evaluated every {s['eval_every']} round(s). Figures: mean "
             "± s.e. over seeds; Δ = paired-by-seed difference from `none` (± s.e., two-sided p).", "",
             f"### {label} after the last round", ""]
    lines += _head(["probe"] + names + ["average", "average gain over the warm start", "Δ average vs none"])
    for p in agg:
        lines.append(_row([f"`{p}`"] + [_f(fig(p, f"{n}/reward_at_1_final")) for n in names]
                          + [_f(fig(p, "average/reward_at_1_final")), _f(fig(p, "average/reward_at_1_gain")),
                             _diff(vs(p, "average/reward_at_1_final"))]))
    lines += ["", f"![{label} per round]({name}_reward_at_1.png)", "", "### Final skills (held-out greedy success)", ""]
    lines += _head(["probe"] + [f"{n} {k}" for n in names for k in skills] + [f"Δ {skills[1]} vs none"])
    for p in agg:
        d = "; ".join(f"{n}: {_diff(vs(p, f'{n}/{skills[1]}'))}" for n in names)
        lines.append(_row([f"`{p}`"] + [_f(fig(p, f"{n}/{k}"), 2) for n in names for k in skills] + [d]))
    ks = sorted({k.split("/")[-1] for p in agg for k in agg[p]["figures"] if "/pass@" in k}, key=lambda k: int(k[5:]))
    lines += ["", f"![final skills]({name}_skills.png)", "", "### pass@k at the end (sampled, T = 1)", ""]
    lines += _head(["probe"] + [f"{n} {k}" for n in names + ["population"] for k in ks])
    for p in agg:
        lines.append(_row([f"`{p}`"] + [_f(fig(p, f"{n}/{k}"), 2) for n in names + ["population"] for k in ks]))
    lines += ["", "### Stability (per policy, over rounds)", ""]
    lines += _head(["probe"] + [f"{n} {label}" for n in names for _, label in STABILITY])
    for p in agg:
        lines.append(_row([f"`{p}`"] + [_f(fig(p, f"{n}/{k}")) for n in names for k, _ in STABILITY]))
    lines += ["", f"### Cost (seconds per round by phase: median over the rounds after the first; {names[0]}; see the "
              "load per cell in probes.json)", ""]
    lines += _head(["probe"] + list(PHASES) + ["rows computed"] + [f"{n} MiB/device" for n in names] + ["cell wall s"])
    for p in agg:
        walls = [c["wall_s"] for c in w["cells"][p] if c.get("wall_s") is not None]
        lines.append(_row([f"`{p}`"] + [_f(fig(p, f"{names[0]}/s_per_round/{ph}")) for ph in PHASES]
                          + [_f(fig(p, f"{names[0]}/rows_computed"), 0)]
                          + [_f(fig(p, f"{n}/memory_mib_per_device"), 2) for n in names]
                          + [f"{np.mean(walls):.1f}" if walls else "– (from an earlier run)"]))
    return lines + [""]


def markdown(result: dict) -> str:
    """PROBES.md: the command and its wall time, each workload's sections, then the bandit lab's plane."""
    lines = ["# Probe benchmark (`mrl bench probes`)", "",
             f"Command: `{result['command']}`  ", f"Wall time: {result['wall_s']:.0f} s on {result['cpus']} CPU(s) "
             f"with {result['jobs']} cell(s) at a time, 1-minute load average {result['load_1min'][0]:.2f} at the "
             f"start, {result['load_1min'][1]:.2f} at the end (timings are contended when the load exceeds the "
             "cores).", ""]
    for name, w in result["workloads"].items():
        lines += workload_markdown(name, w, result["settings"]["seeds"])
    lines += ["MiB/device: the policy's planned memory per device (`plan.json`, MWRA's estimate of params, "
              "optimizer state and the round's activations).", "",
              "## The bandit lab's plane for the same probes (G=4, THL residual σ=1)", ""]
    lines += _head(["probe", "support (OOS gain)", "support (exact)", "final reward", "update var", "KL/step",
                    "collapse frac"])
    for p, b in result["bandit"].items():
        exact = "–" if b.get("support_exact") is None else f"{b['support_exact']:.3f}"
        lines.append(_row([f"`{p}`", _f({"mean": b["support"], "se": b["support_se"]}), exact,
                           _f({"mean": b["final_reward"], "se": b["final_reward_se"]}), f"{b['update_var']:.3g}",
                           f"{b['kl_per_step']:.3g}", f"{b['collapse_frac']:.2f}"]))
    return "\n".join(lines + ["", "![stability-support plane](bandit/plane.png)", ""])


def _legend(fig, axes) -> None:
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 4), 1, 0.95))


def figures(result: dict, out: Path) -> None:
    """Per workload: ``<name>_reward_at_1.png`` (one panel per policy and their average, over rounds) and
    ``<name>_skills.png`` (final skills, bars ± s.e.)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    seeds = result["settings"]["seeds"]
    for name, w in result["workloads"].items():
        agg, names, skills = w["probes"], w["policies"], w["skills"]
        panels = names + ["average"]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.8), squeeze=False, sharey=True)
        for ax, n in zip(axes[0], panels):
            for p, e in agg.items():
                c = e["curves"][n]
                x, m, se = np.asarray(c["rounds"]), np.asarray(c["mean"]), np.asarray(c["se"])
                (line,) = ax.plot(x, m, marker=".", label=p)
                ax.fill_between(x, m - se, m + se, color=line.get_color(), alpha=0.15, linewidth=0)
            ax.set_title(n if n != "average" else "average over policies", fontsize=10)
            ax.set_xlabel("RL rounds done (0 = warm start)")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        axes[0, 0].set_ylabel(f"{w['curve_label']}\n(fraction of held-out prompts)")
        fig.suptitle(f"{name}: {w['curve_label']} per round, mean ± s.e. over {seeds} seed(s)")
        _legend(fig, axes)
        fig.savefig(out / f"{name}_reward_at_1.png", dpi=100)
        plt.close(fig)

        fig, axes = plt.subplots(1, len(names), figsize=(5.0 * len(names), 3.8), squeeze=False, sharey=True)
        width = 0.8 / max(len(agg), 1)
        for ax, n in zip(axes[0], names):
            for i, (p, e) in enumerate(agg.items()):
                vals = [e["figures"].get(f"{n}/{k}") or {"mean": 0.0, "se": None} for k in skills]
                ax.bar(np.arange(len(skills)) + i * width, [v["mean"] or 0.0 for v in vals], width,
                       yerr=[v["se"] or 0.0 for v in vals], label=p, capsize=2)
            ax.set_xticks(np.arange(len(skills)) + 0.4 - width / 2, [k.replace("_", " ") for k in skills])
            ax.set_title(n, fontsize=10)
            ax.set_ylim(0, 1.05)
        axes[0, 0].set_ylabel("held-out greedy success\n(fraction of prompts)")
        fig.suptitle(f"{name}: final skills after RL, mean ± s.e. over {seeds} seed(s)")
        _legend(fig, axes)
        fig.savefig(out / f"{name}_skills.png", dpi=100)
        plt.close(fig)
