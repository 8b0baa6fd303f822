"""``mrl bench probes``: every probe on the same work -- effect, stability, cost and its place on the bandit plane.

    mrl bench probes [--quick] --probes none,sgt,experiments.probes.hedge:hedge:lam=0.5 --out DIR
    python benchmarks/bench_probes.py [--quick] --probes ... --out DIR

Work: the demo's facts-transfer task (``mrl_jax.demo``: two policies of different families and tokenizers,
warm-started on the shared skill ``copy`` and on their own half of a fact table) under the same policies, data,
seeds and RL budget for every probe -- built-ins, chains, and researchers' probes by import path. One run
directory per (probe, seed) under ``DIR/cells/`` (``mrl train``'s layout: metrics.jsonl, summary.json, ...):
a cell with its summary.json is finished and skipped when the command runs again; an unfinished (killed) cell
is deleted and rerun from its start. The bandit lab places the same probes on its stability-support plane
(``DIR/bandit/``, Monte Carlo for probes without a closed form).

Writes ``DIR/PROBES.md``, ``DIR/probes.json`` and figures (``reward_at_1.png``: held-out greedy reward per round
per policy and their average; ``skills.png``: final own / foreign / shared skill). Every figure is a mean
+- standard error over seeds, and every probe's difference from ``none`` is paired by seed (mean, s.e., t and
a two-sided p-value). Timings are contended on a shared machine: each is reported with the 1-minute load
average measured beside it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

REPO = str(Path(__file__).resolve().parents[1])
if REPO not in sys.path:   # the checkout's mrl_jax (as a script) and experiments.probes (the worked example)
    sys.path.insert(0, REPO)

DEFAULT_PROBES = ("none", "xgrpo", "prp", "sgt", "xgrpo+sgt", "sgt+replay", "experiments.probes.hedge:hedge:lam=0.5")
QUICK_PROBES = ("none", "xgrpo+sgt")
SKILLS = ("own_facts", "foreign_facts", "copy")
PHASES = ("rollout", "decode", "rewards", "see", "views", "thl", "stage", "update")
LAB_NAMES = {"none": "none", "xgrpo": "xgrpo", "prp": "prp", "sgt": "sgt", "xgrpo+sgt": "xgrpo_sgt"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The budget every probe gets (``quick``: one seed, a few rounds, tiny warm start)."""

    seeds: int = 3
    rounds: int = 30
    prompts_per_round: int = 32
    num_generations: int = 8
    sft_steps: int = 200
    num_facts: int = 32
    eval_copy_prompts: int = 32
    eval_samples: int = 4          # pass@k (k = 1, 2, 4) at the warm start and at the end
    bandit_steps: int = 60
    bandit_seeds: int = 16

    @classmethod
    def make(cls, quick: bool) -> "Settings":
        if quick:
            return cls(seeds=1, rounds=3, prompts_per_round=8, num_generations=4, sft_steps=60, num_facts=8,
                       eval_copy_prompts=8, eval_samples=2, bandit_steps=10, bandit_seeds=2)
        return cls()


def bench_task(s: Settings):
    """The demo's task with a held-out copy set small enough that every held-out prompt is evaluated."""
    from mrl_jax.tasks import FactTableTask, MixtureTask, StringTask

    return MixtureTask([StringTask("copy", min_len=3, max_len=6, alphabet="abcdef", n_train=1000,
                                   n_eval=s.eval_copy_prompts),
                        FactTableTask(s.num_facts, parts=("A", "B"))], weights=[1, 1], name="demo")


def cell_config(probe: str, s: Settings, seed: int, num_eval: int):
    """The demo's two policies under ``probe``; held-out evaluation after every round (reward@1 curve), sampled
    pass@k at the warm start and the end; one checkpoint (the end): an unfinished cell restarts."""
    from mrl_jax.demo import DemoSettings, demo_config

    ds = DemoSettings(seeds=s.seeds, rounds=s.rounds, prompts_per_round=s.prompts_per_round,
                      num_generations=s.num_generations, sft_steps=s.sft_steps, num_facts=s.num_facts)
    cfg = demo_config(probe, ds, seed)
    return dataclasses.replace(cfg, eval_every=1, eval_prompts=num_eval, eval_samples=s.eval_samples,
                               checkpoint_every=s.rounds, keep_checkpoints=1)


def slug(probe: str) -> str:
    """A directory name for a probe spec."""
    return re.sub(r"[^A-Za-z0-9.+=_-]", "_", probe)


def run_cell(probe: str, s: Settings, seed: int, cell: Path, task, verbose: bool) -> dict:
    """Train one (probe, seed) into ``cell`` unless it finished before; returns its ``cell.json`` record."""
    from mrl_jax.trainer import train

    meta = {"probe": probe, "seed": seed, "settings": dataclasses.asdict(s)}
    done = cell / "summary.json"
    if done.is_file() and (cell / "cell.json").is_file():
        old = json.loads((cell / "cell.json").read_text())
        if {k: old.get(k) for k in meta} != meta:
            raise ValueError(f"{cell} holds a cell of another budget ({old.get('settings')}); use a new --out")
        return old
    if cell.exists():   # killed before its end: start it again from scratch
        shutil.rmtree(cell)
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps(meta))
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    train(cell_config(probe, s, seed, len(task.eval_prompts())), cell, task=task, progress=verbose)
    meta.update(wall_s=round(time.perf_counter() - t0, 2), load_1min=[round(load0, 2), round(os.getloadavg()[0], 2)])
    (cell / "cell.json").write_text(json.dumps(meta))
    return meta


def _records(cell: Path) -> list[dict]:
    return [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cell_figures(cell: Path, meta: dict) -> dict:
    """Per policy: reward@1 curve (warm start, then after each round), final skills, pass@k, stability, cost."""
    summary = json.loads((cell / "summary.json").read_text())
    recs = _records(cell)
    out = {"wall_s": meta.get("wall_s"), "load_1min": meta.get("load_1min"), "policies": {},
           "population": {k: v for k, v in (summary.get("population") or {}).items() if k.startswith("pass@")}}
    memory = cell / "memory_plan.json"
    parts = {p["name"]: p["warm_start"]["part"] for p in json.loads((cell / "config.json").read_text())["policies"]}
    plan = {p["name"]: p["memory_bytes_per_device"] / 2 ** 20
            for p in json.loads((cell / "plan.json").read_text())["policies"]} if (cell / "plan.json").is_file() else {}
    for name, pol in summary["policies"].items():
        train_recs = [r for r in recs if r["policy"] == name]
        evals = sorted((r["round"], r["success"]) for r in recs if r["policy"] == f"{name}/eval")
        curve = [summary["before"][name]["success"]] + [v for _, v in evals]
        groups = pol["eval"]["by_group"]
        own = parts[name]
        skills = {"own_facts": groups.get(f"fact:{own}"), "foreign_facts": groups.get(f"fact:{'B' if own == 'A' else 'A'}"),
                  "copy": groups.get("copy")}
        col = lambda k: [float(r[k]) for r in train_recs if k in r]
        gn = col("grad_norm")
        stab = {"kl": _mean(col("kl")), "grad_norm_mean": _mean(gn), "grad_norm_spread": float(np.std(gn)) if gn else None,
                "skipped_updates": float(sum(col("skipped"))), "prp_ess": _mean(col("prp/ess")),
                "thl_residual_frac": _mean(col("prp/residual_frac")),
                "thl_chunks_invalid": _mean(col("thl/frac_chunks_invalid"))}
        steady = train_recs[1:] or train_recs   # round 0 compiles; the median leaves later (re)compiles out
        cost = {f"s_per_round/{p}": _median([float(r[f"time/{p}"]) for r in steady if f"time/{p}" in r]) for p in PHASES}
        cost["rows_computed"] = _mean(col("rows_computed"))
        cost["memory_mib_per_device"] = plan.get(name)
        out["policies"][name] = {"reward_at_1": curve, "skills": skills, "stability": stab, "cost": cost,
                                 "pass_at_k": {k: v for k, v in pol["eval"].items() if k.startswith("pass@")},
                                 "pass_at_k_before": {k: v for k, v in summary["before"][name].items()
                                                      if k.startswith("pass@")}}
    if memory.is_file():
        out["memory_plan"] = json.loads(memory.read_text())
    return out


def _mean(xs: Sequence[float]) -> Optional[float]:
    return float(np.mean(xs)) if len(xs) else None


def _median(xs: Sequence[float]) -> Optional[float]:
    return float(np.median(xs)) if len(xs) else None


# ----------------------------------------------------------------------------- statistics over seeds

def mean_se(values: Sequence[float]) -> dict:
    """{"mean", "se", "n"} of per-seed values (se = sample std / sqrt(n); None for one seed)."""
    x = np.asarray([v for v in values if v is not None], np.float64)
    if not len(x):
        return {"mean": None, "se": None, "n": 0}
    se = float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None
    return {"mean": float(x.mean()), "se": se, "n": int(len(x))}


def paired(values: Sequence[float], base: Sequence[float]) -> dict:
    """The difference from ``none`` paired by seed: mean, s.e., t and a two-sided p-value (Student's t, n - 1
    degrees of freedom; None with fewer than two seeds or no spread)."""
    d = np.asarray(values, np.float64) - np.asarray(base, np.float64)
    out = mean_se(d)
    if out["se"]:
        from scipy import stats

        t = out["mean"] / out["se"]
        out.update(t=float(t), p=float(2 * stats.t.sf(abs(t), len(d) - 1)))
    else:
        out.update(t=None, p=None)
    return out


def _scalars(fig: dict) -> dict:
    """Flat per-cell scalars: 'policy/figure' (and 'average/...') -> value."""
    out = {}
    names = list(fig["policies"])
    for n, p in fig["policies"].items():
        out[f"{n}/reward_at_1_final"] = p["reward_at_1"][-1]
        for k, v in p["skills"].items():
            out[f"{n}/{k}"] = v
        for k, v in {**p["pass_at_k"], **p["stability"], **p["cost"]}.items():
            out[f"{n}/{k}"] = v
    out["average/reward_at_1_final"] = float(np.mean([fig["policies"][n]["reward_at_1"][-1] for n in names]))
    for k, v in fig["population"].items():
        out[f"population/{k}"] = v
    return out


def aggregate(cells: dict, probes: Sequence[str]) -> dict:
    """{probe: {"figures": {key: mean_se}, "vs_none": {key: paired}, "curves": {policy|average: {mean, se}}}}."""
    out = {}
    base = [_scalars(f) for f in cells.get("none", [])]
    for probe in probes:
        per_seed = [_scalars(f) for f in cells[probe]]
        keys = sorted({k for s in per_seed for k in s})
        entry = {"figures": {k: mean_se([s.get(k) for s in per_seed]) for k in keys}, "curves": {}}
        if base and probe != "none":
            entry["vs_none"] = {k: paired([s[k] for s in per_seed], [b[k] for b in base]) for k in keys
                                if all(s.get(k) is not None for s in per_seed + base)}
        names = list(cells[probe][0]["policies"])
        curves = {n: np.asarray([f["policies"][n]["reward_at_1"] for f in cells[probe]], np.float64) for n in names}
        curves["average"] = np.mean([curves[n] for n in names], axis=0)
        for n, c in curves.items():
            se = c.std(0, ddof=1) / math.sqrt(len(c)) if len(c) > 1 else np.zeros(c.shape[1])
            entry["curves"][n] = {"mean": c.mean(0).tolist(), "se": se.tolist()}
        out[probe] = entry
    return out


# ----------------------------------------------------------------------------- the bandit plane

def bandit_config(probes: Sequence[str], s: Settings, quick: bool):
    from mrl_jax.bandit import env as E
    from mrl_jax.bandit import lab

    names = tuple(dict.fromkeys(LAB_NAMES.get(p, p) for p in probes))
    env = E.EnvConfig(num_arms=4, policies=("tabular", "fourier")) if quick else E.EnvConfig()
    return lab.LabConfig(env=env, probes=names, group_sizes=(4,), sigmas=(1.0,), headline_G=4, headline_sigma=1.0,
                         steps=s.bandit_steps, seeds=s.bandit_seeds, record_every=5 if quick else 10,
                         compile_mode="fast")


def run_bandit(probes: Sequence[str], s: Settings, quick: bool, out: Path, verbose: bool) -> dict:
    """The lab's headline figures per bench probe (``DIR/bandit``; reused when it holds the same probes)."""
    from mrl_jax.bandit import lab
    from mrl_jax.configs import to_dict

    cfg = bandit_config(probes, s, quick)
    done = out / "summary.json"
    summary = json.loads(done.read_text()) if done.is_file() else None
    if summary is None or summary["settings"]["config"] != json.loads(json.dumps(to_dict(cfg))):
        summary = lab.run(str(out), config=cfg, verbose=verbose)
    keep = ("support", "support_se", "support_exact", "final_reward", "final_reward_se", "exact")
    res = {}
    for p in probes:
        row = summary["probes"][LAB_NAMES.get(p, p)]
        stab = row["stability"]
        res[p] = {**{k: row.get(k) for k in keep}, "update_var": stab.get("update_var"),
                  "noise_ratio": stab.get("noise_ratio"), "kl_per_step": stab.get("kl_per_step"),
                  "collapse_frac": stab.get("collapse_frac")}
    return res


# ----------------------------------------------------------------------------- report

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


def markdown(result: dict) -> str:
    """PROBES.md: the settings, then one table per section (effect, skills, pass@k, stability, cost, bandit)."""
    s, agg, names = result["settings"], result["probes"], result["policies"]
    fig = lambda p, k: agg[p]["figures"].get(k)
    vs = lambda p, k: (agg[p].get("vs_none") or {}).get(k)
    lines = ["# Probe benchmark (`mrl bench probes`)", "",
             f"Command: `{result['command']}`  ", f"Wall time: {result['wall_s']:.0f} s on {result['cpus']} CPU(s), "
             f"1-minute load average {result['load_1min'][0]:.2f} at the start, {result['load_1min'][1]:.2f} at the end "
             "(timings are contended when the load exceeds the cores).", "",
             f"Task: the demo's facts transfer; policies {', '.join(names)}; {s['seeds']} seed(s), {s['rounds']} RL "
             f"rounds of {s['prompts_per_round']} prompts x {s['num_generations']} samples, warm start "
             f"{s['sft_steps']} SFT steps; the same warm-started policies, data and seeds for every probe. "
             "Figures: mean ± s.e. over seeds; Δ = paired-by-seed difference from `none` (± s.e., two-sided p).", "",
             "## Held-out greedy reward@1 after the last round", "",
             "| probe | " + " | ".join(names) + " | average | Δ average vs none |", "|---" * (len(names) + 3) + "|"]
    for p in agg:
        lines.append(f"| `{p}` | " + " | ".join(_f(fig(p, f"{n}/reward_at_1_final")) for n in names)
                     + f" | {_f(fig(p, 'average/reward_at_1_final'))} | {_diff(vs(p, 'average/reward_at_1_final'))} |")
    lines += ["", "![held-out reward@1 per round](reward_at_1.png)", "", "## Final skills (held-out greedy success)", "",
              "| probe | " + " | ".join(f"{n} {k}" for n in names for k in ("own", "foreign", "copy"))
              + " | Δ foreign vs none |", "|---" * (3 * len(names) + 2) + "|"]
    for p in agg:
        cells = [_f(fig(p, f"{n}/{k}"), 2) for n in names for k in SKILLS]
        d = "; ".join(f"{n}: {_diff(vs(p, f'{n}/foreign_facts'))}" for n in names)
        lines.append(f"| `{p}` | " + " | ".join(cells) + f" | {d} |")
    ks = sorted({k.split("/")[-1] for p in agg for k in agg[p]["figures"] if "/pass@" in k}, key=lambda k: int(k[5:]))
    lines += ["", "![final skills](skills.png)", "", "## pass@k at the end (sampled)", "",
              "| probe | " + " | ".join(f"{n} {k}" for n in names + ["population"] for k in ks) + " |",
              "|---" * (len(ks) * (len(names) + 1) + 1) + "|"]
    for p in agg:
        lines.append(f"| `{p}` | " + " | ".join(_f(fig(p, f"{n}/{k}"), 2) for n in names + ["population"] for k in ks) + " |")
    stab = (("kl", "KL"), ("grad_norm_spread", "grad-norm spread (std over rounds)"), ("prp_ess", "PRP ESS"),
            ("thl_residual_frac", "THL residual frac"), ("skipped_updates", "skipped updates"))
    lines += ["", "## Stability (per policy, over rounds)", "",
              "| probe | " + " | ".join(f"{n} {label}" for n in names for _, label in stab) + " |",
              "|---" * (len(stab) * len(names) + 1) + "|"]
    for p in agg:
        lines.append(f"| `{p}` | " + " | ".join(_f(fig(p, f"{n}/{k}")) for n in names for k, _ in stab) + " |")
    lines += ["", f"## Cost (seconds per round by phase: median over the rounds after the first; {names[0]}; contended, "
              "see the load per cell in probes.json)", "",
              "| probe | " + " | ".join(PHASES) + " | rows computed | " + " | ".join(f"{n} MiB/device" for n in names)
              + " | cell wall s |", "|---" * (len(PHASES) + 3 + len(names)) + "|"]
    for p in agg:
        walls = [c["wall_s"] for c in result["cells"][p] if c.get("wall_s") is not None]
        lines.append(f"| `{p}` | " + " | ".join(_f(fig(p, f"{names[0]}/s_per_round/{ph}")) for ph in PHASES)
                     + f" | {_f(fig(p, f'{names[0]}/rows_computed'), 0)} | "
                     + " | ".join(_f(fig(p, f"{n}/memory_mib_per_device"), 2) for n in names) + " | "
                     + (f"{np.mean(walls):.1f}" if walls else "– (from an earlier run)") + " |")
    lines += ["", "MiB/device: the policy's planned memory per device (`plan.json`, MWRA's estimate of params, "
              "optimizer state and the round's activations; the compiled figure is in each cell's memory_plan.json "
              "where the device reports a limit).", "", "## The bandit lab's plane for the same probes (G=4, THL residual σ=1)", "",
              "| probe | support (OOS gain) | support (exact) | final reward | update var | KL/step | collapse frac |",
              "|---|---|---|---|---|---|---|"]
    for p, b in result["bandit"].items():
        sup = {"mean": b["support"], "se": b["support_se"]}
        exact = "–" if b.get("support_exact") is None else f"{b['support_exact']:.3f}"
        lines.append(f"| `{p}` | {_f(sup)} | {exact} | "
                     f"{_f({'mean': b['final_reward'], 'se': b['final_reward_se']})} | {b['update_var']:.3g} | "
                     f"{b['kl_per_step']:.3g} | {b['collapse_frac']:.2f} |")
    lines += ["", "![stability-support plane](bandit/plane.png)", ""]
    return "\n".join(lines)


def figures(result: dict, out: Path) -> None:
    """reward_at_1.png (one panel per policy and their average) and skills.png (final skills, bars ± s.e.)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    agg, names = result["probes"], result["policies"]
    panels = names + ["average"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], panels):
        for p, e in agg.items():
            m, se = np.asarray(e["curves"][n]["mean"]), np.asarray(e["curves"][n]["se"])
            x = np.arange(len(m))
            (line,) = ax.plot(x, m, marker=".", label=p)
            ax.fill_between(x, m - se, m + se, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set_title(n if n != "average" else "average over policies", fontsize=10)
        ax.set_xlabel("RL round (0 = warm start)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].set_ylabel("held-out greedy reward@1\n(fraction of prompts)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.suptitle(f"held-out reward@1 per round, mean ± s.e. over {result['settings']['seeds']} seed(s)")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 4), 1, 1))
    fig.savefig(out / "reward_at_1.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 3.8), squeeze=False, sharey=True)
    width = 0.8 / max(len(agg), 1)
    for ax, n in zip(axes[0], names):
        for i, (p, e) in enumerate(agg.items()):
            vals = [e["figures"].get(f"{n}/{k}") or {"mean": 0.0, "se": None} for k in SKILLS]
            ax.bar(np.arange(len(SKILLS)) + i * width, [v["mean"] or 0.0 for v in vals], width,
                   yerr=[v["se"] or 0.0 for v in vals], label=p, capsize=2)
        ax.set_xticks(np.arange(len(SKILLS)) + 0.4 - width / 2, ["own facts", "foreign facts", "copy (shared)"])
        ax.set_title(n, fontsize=10)
        ax.set_ylim(0, 1.05)
    axes[0, 0].set_ylabel("held-out greedy success\n(fraction of prompts)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.suptitle("final skills after RL, mean ± s.e. over seeds")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 4), 1, 1))
    fig.savefig(out / "skills.png", dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- entry points

def compare(out_dir, probes: Optional[Sequence[str]] = None, quick: bool = False, settings: Optional[Settings] = None,
            verbose: bool = True, command: Optional[str] = None) -> dict:
    """Run (or finish) the comparison into ``out_dir``; returns probes.json's content."""
    from mrl_jax.configs import ConfigError
    from mrl_jax.probes import make_probe

    probes = list(dict.fromkeys(probes or (QUICK_PROBES if quick else DEFAULT_PROBES)))
    if "none" not in probes:
        probes.insert(0, "none")   # the baseline every difference is paired against
    for p in probes:              # a bad spec stops here, before any training (one line, naming it)
        try:
            make_probe(p)
        except ValueError as e:
            raise ConfigError(f"--probes: {e}") from None
    s = settings or Settings.make(quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    task = bench_task(s)
    cells, metas = {p: [] for p in probes}, {p: [] for p in probes}
    for seed in range(s.seeds):
        for p in probes:
            cell = out / "cells" / slug(p) / f"seed{seed}"
            if verbose:
                print(f"[bench probes] {p} seed {seed} -> {cell}", file=sys.stderr, flush=True)
            meta = run_cell(p, s, seed, cell, task, verbose)
            metas[p].append(meta)
            cells[p].append(cell_figures(cell, meta))
    bandit = run_bandit(probes, s, quick, out / "bandit", verbose)
    result = {"command": command or f"mrl bench probes{' --quick' if quick else ''} --probes {','.join(probes)} "
                                    f"--out {out_dir}",
              "settings": dataclasses.asdict(s), "quick": quick, "probes_run": probes,
              "policies": list(cells["none"][0]["policies"]), "cpus": os.cpu_count(),
              "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
              "wall_s": round(time.perf_counter() - t0, 1), "probes": aggregate(cells, probes),
              "cells": {p: [{**m, **{k: f[k] for k in ("population",)}} for m, f in zip(metas[p], cells[p])]
                        for p in probes},
              "per_cell": cells, "bandit": bandit}
    (out / "probes.json").write_text(json.dumps(result, indent=2))
    (out / "PROBES.md").write_text(markdown(result))
    figures(result, out)
    if verbose:
        print(f"[bench probes] wrote {out}/PROBES.md, probes.json, reward_at_1.png, skills.png, bandit/", file=sys.stderr)
    return result


def run(quick: bool = False, probes: Optional[Sequence[str]] = None, out: Optional[str] = None) -> dict:
    """The ``mrl bench`` harness entry: the comparison into ``out`` (default: a new temporary directory);
    returns the headline figures (average reward@1 and its difference from none, per probe)."""
    out = out or tempfile.mkdtemp(prefix="mrl_bench_probes_")
    res = compare(out, probes, quick=quick, verbose=False)
    head = {p: {"average_reward_at_1": e["figures"]["average/reward_at_1_final"],
                "vs_none": (e.get("vs_none") or {}).get("average/reward_at_1_final"),
                "bandit_support": res["bandit"][p]["support"]} for p, e in res["probes"].items()}
    return {"out": str(out), "wall_s": res["wall_s"], "probes": head}


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"probes {','.join(QUICK_PROBES)}, one seed, 3 rounds")
    ap.add_argument("--probes", default=None, help="comma-separated probe specs (built-ins, chains, pkg.mod:factory"
                                                   f"[:k=v]); default {','.join(DEFAULT_PROBES)}")
    ap.add_argument("--out", required=True, help="output directory (cells are reused when it exists)")
    args = ap.parse_args(argv)
    compare(args.out, args.probes.split(",") if args.probes else None, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
