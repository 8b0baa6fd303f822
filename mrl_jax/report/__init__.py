"""``mrl report RUN --out DIR``: plots and a markdown summary of a run directory.

Reads ``metrics.jsonl``, ``groups.jsonl``, ``samples.jsonl`` and (when the run finished) ``summary.json``;
works on a run still going and on a killed one (a torn last line is skipped, a round logged by only some
policies is left out of the complementarity matrix). Writes into DIR:

- ``reward.png`` (training reward and success rate, held-out eval success), ``kl.png``, ``entropy.png``,
  ``clip_ratio.png``, ``counters_<probe>.png`` for each probe's counters present (prp, sgt, xgrpo, replay);
- ``complementarity.png``: for each pair (i, j) the fraction of a round's prompts on which i fails every
  sample while j has a success (what SGT can act on), averaged and over rounds;
- ``summary.md`` (last round, last eval, complementarity, sample completions) and ``report.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mrl_jax.report.data import PROBE_PREFIXES, RunRecords, complementarity, load_run
from mrl_jax.report.figures import complementarity_figure, metric_panels, sampled_eval_figure

LAST_ROUND_KEYS = ("reward/mean", "reward/success_rate", "kl", "entropy", "frac_reward_zero_std",
                   "completion/mean_length")


def _figures(run: RunRecords, out: Path) -> dict[str, str]:
    """Every figure the run's records allow: ``{figure name: file name}``."""
    made, logged = {}, set(run.keys())
    plans = [("reward", [k for k in ("reward/mean", "reward/success_rate") if k in logged],
              "reward and success per round (training samples; dashed: held-out greedy eval)", True),
             ("kl", [k for k in ("kl",) if k in logged], "KL to the reference", False),
             ("entropy", [k for k in ("entropy",) if k in logged], "policy entropy of the sampled tokens", False),
             ("clip_ratio", run.keys("clip_ratio/"), "clipped fraction of the ratio", False)]
    plans += [(f"counters_{p}", run.keys(f"{p}/"), f"{p} mechanism counters", False) for p in PROBE_PREFIXES]
    for name, keys, title, evals in plans:
        if keys:
            made[name] = metric_panels(run, keys, out / f"{name}.png", title, evals=evals).name
    if any("pass@1" in e for e in run.evals):
        made["pass_at_k"] = sampled_eval_figure(run, out / "pass_at_k.png").name
    return made


def _population_table(summary: dict | None) -> list[str]:
    """Final sampled evaluation (summary.json): per-policy and population pass@k, and the transfer matrix."""
    pop = (summary or {}).get("population")
    if not pop:
        return []
    keys = [k for k in pop if "@" in k]
    lines = ["## Sampled evaluation (end of run)", "", "| policy | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for p, entry in (summary.get("policies") or {}).items():
        ev = entry.get("eval", {})
        lines.append(f"| {p} | " + " | ".join(_fmt(ev.get(k, "")) for k in keys) + " |")
    lines += ["| **population** | " + " | ".join(_fmt(pop[k]) for k in keys) + " |", "",
              "Transfer: fraction of held-out prompts the column policy solves (any sample) and the row policy "
              "does not:", "", "| row \\ column | " + " | ".join(pop["policies"]) + " |",
              "|---" * (len(pop["policies"]) + 1) + "|"]
    lines += [f"| {a} | " + " | ".join(_fmt(v) for v in row) + " |" for a, row in zip(pop["policies"], pop["transfer"])]
    return lines + [""]


def _fmt(value) -> str:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "nan" if math.isnan(v) else f"{v:.4g}"


def _cell(text: str, limit: int = 80) -> str:
    text = str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("`", "'")
    return (text[:limit] + "…") if len(text) > limit else text


def _last_round_table(run: RunRecords) -> list[str]:
    r = run.last_round
    rows = {rec["policy"]: rec for rec in run.train if int(rec["round"]) == r}
    lines = [f"## Last round ({r})", ""]
    counters = [k for k in run.keys() if k.split("/")[0] in PROBE_PREFIXES]
    for keys in ([k for k in LAST_ROUND_KEYS if k in run.keys()], counters):
        keys = [k for k in keys if any(k in rec for rec in rows.values())]
        if keys:
            lines += ["| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
            lines += [f"| {p} | " + " | ".join(_fmt(rows[p].get(k, "")) for k in keys) + " |" for p in rows] + [""]
    return lines[:-1]


def _eval_table(run: RunRecords) -> list[str]:
    lines = ["## Last evaluation (held-out, greedy)", ""]
    final = (run.summary or {}).get("policies") or {}
    if final:
        lines += ["| policy | when | success | n | by group |", "|---|---|---|---|---|"]
        for p, entry in final.items():
            ev = entry.get("eval", {})
            groups = ", ".join(f"{g} {_fmt(v)}" for g, v in (ev.get("by_group") or {}).items())
            lines.append(f"| {p} | end of run | {_fmt(ev.get('success'))} | {ev.get('n', '')} | {groups} |")
    elif run.evals:
        last = {}
        for e in sorted(run.evals, key=lambda e: e["round"]):
            last[e["policy"]] = e
        lines += ["| policy | round | success |", "|---|---|---|"]
        lines += [f"| {p} | {e['round']} | {_fmt(e['success'])} |" for p, e in last.items()]
    else:
        lines.append("No evaluation logged yet (set eval_every in the run config for evaluations during the run).")
    return lines


def _complementarity_table(comp: dict) -> list[str]:
    lines = ["## Complementarity", "", "Fraction of a round's prompts on which the row policy fails every sample "
             "while the column policy has a success (reward ≥ tau), mean over "
             f"{len(comp['rounds'])} round(s):", ""]
    names = comp["policies"]
    lines += ["| fails \\ solves | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {a} | " + " | ".join(_fmt(v) for v in row) + " |" for a, row in zip(names, comp["mean"])]
    return lines


def _samples(run: RunRecords, per_policy: int) -> list[str]:
    if not run.samples:
        return []
    r = max(int(s.get("round", -1)) for s in run.samples)
    lines = [f"## Sample completions (round {r})", ""]
    for p in dict.fromkeys(s.get("policy") for s in run.samples):
        rows = [s for s in run.samples if s.get("policy") == p and int(s.get("round", -1)) == r][:per_policy]
        if not rows:
            continue
        lines += [f"**{p}**", "", "| prompt | completion | answer | reward |", "|---|---|---|---|"]
        lines += [f"| `{_cell(s.get('prompt', ''))}` | `{_cell(s.get('completion', ''))}` | "
                  f"`{_cell(s.get('answer', ''))}` | {_fmt(s.get('reward'))} |" for s in rows]
        lines.append("")
    return lines


def write_report(run_dir: str | Path, out_dir: str | Path, *, samples_per_policy: int = 3) -> dict:
    """Write the figures, ``summary.md`` and ``report.json`` of ``run_dir`` into ``out_dir``; returns the
    report (figure files, status, last round, complementarity, last eval)."""
    run = load_run(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not run.train:
        raise FileNotFoundError(f"{run.run_dir / 'metrics.jsonl'} holds no complete round yet")
    figures = _figures(run, out)
    comp = complementarity(run.groups, run.policies)
    if comp["rounds"] and len(run.policies) > 1:
        figures["complementarity"] = complementarity_figure(comp, out / "complementarity.png").name
    finished = run.summary is not None
    status = "finished" if finished else "in progress or stopped (no summary.json yet)"
    md = [f"# Run report: `{run.run_dir}`", "",
          f"Status: {status}; {run.last_round + 1} round(s) logged; policies: {', '.join(run.policies)}.", ""]
    md += _last_round_table(run) + [""] + _eval_table(run) + [""] + _population_table(run.summary)
    if comp["rounds"] and len(run.policies) > 1:
        md += _complementarity_table(comp) + [""]
    else:
        md += ["## Complementarity", "", "Not available: needs two policies and groups.jsonl (per-prompt "
               "rewards, written by runs of this version).", ""]
    md += ["## Figures", ""] + [f"![{name}]({file})" for name, file in figures.items()] + [""]
    md += _samples(run, samples_per_policy)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    report = {"run": str(run.run_dir), "status": "finished" if finished else "partial", "last_round": run.last_round,
              "policies": run.policies, "figures": figures, "complementarity": comp,
              "last_eval": {e["policy"]: e for e in sorted(run.evals, key=lambda e: e["round"])}}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report


__all__ = ["complementarity", "load_run", "write_report"]
