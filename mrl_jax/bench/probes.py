"""``mrl bench probes``: every probe on the same work -- effect, stability, cost and its place on the bandit plane.

    mrl bench probes [--quick] [--probes none,sgt,my_pkg.probes:hedge:lam=0.5] [--tasks facts,reasoning] [--jobs 2] --out DIR

Default probes: the built-ins and two chains (``DEFAULT_PROBES``; ``--quick``: ``QUICK_PROBES``); a researcher's
probe is named by import path, its package on ``PYTHONPATH`` (the worked example ``experiments.probes.hedge``
from a checkout's root).

Work (:mod:`mrl_jax.bench.probe_workloads`): two tasks, each under the same policies, data, seeds and RL budget for every probe
-- built-ins, chains, and researchers' probes by import path: ``facts``, the demo's facts transfer, and
``reasoning``, algorithmic string reasoning on which GRPO alone learns. One run directory per (task, probe,
seed) under ``DIR/<task>/cells/`` (``mrl train``'s layout: metrics.jsonl, summary.json, ...): a cell with its
summary.json is finished and skipped when the command runs again; an unfinished (killed) cell is deleted and
rerun from its start; ``--jobs N`` trains N cells at once, one process each. The bandit lab places the same
probes on its stability-support plane (``DIR/bandit/``, Monte Carlo for probes without a closed form).

Writes ``DIR/PROBES.md``, ``DIR/probes.json`` and per task the figures (:mod:`mrl_jax.bench.probe_report`:
``<task>_reward_at_1.png``, held-out reward@1 per round per policy and their average; ``<task>_skills.png``,
the final skills). Every figure is a mean +- standard error over seeds, and every probe's difference from
``none`` is paired by seed (mean, s.e., t and a two-sided p-value). Timings are reported with the 1-minute load
average measured beside them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mrl_jax.bench import probe_report
from mrl_jax.bench.probe_workloads import WORKLOADS

DEFAULT_PROBES = ("none", "xgrpo", "prp", "sgt", "xgrpo+sgt", "sgt+replay")
QUICK_PROBES = ("none", "xgrpo+sgt")
PHASES = probe_report.PHASES
LAB_NAMES = {"none": "none", "xgrpo": "xgrpo", "prp": "prp", "sgt": "sgt", "xgrpo+sgt": "xgrpo_sgt"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every workload shares: the seeds each probe runs and the bandit lab's budget."""

    seeds: int = 3
    bandit_steps: int = 60
    bandit_seeds: int = 16

    @classmethod
    def make(cls, quick: bool) -> "Settings":
        return cls(seeds=1, bandit_steps=10, bandit_seeds=2) if quick else cls()


def slug(probe: str) -> str:
    """A directory name for a probe spec."""
    return re.sub(r"[^A-Za-z0-9.+=_-]", "_", probe)


def run_cell(work: str, probe: str, budget, seed: int, cell: Path, verbose: bool) -> dict:
    """Train one (workload, probe, seed) into ``cell`` unless it finished before; returns its ``cell.json``."""
    from mrl_jax.trainer import train

    w = WORKLOADS[work]
    meta = {"workload": work, "probe": probe, "seed": seed, "settings": json.loads(json.dumps(dataclasses.asdict(budget)))}
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
    task = w.task(budget)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    train(w.config(probe, budget, seed, len(task.eval_prompts())), cell, task=task, progress=verbose)
    meta.update(wall_s=round(time.perf_counter() - t0, 2), load_1min=[round(load0, 2), round(os.getloadavg()[0], 2)])
    (cell / "cell.json").write_text(json.dumps(meta))
    return meta


def _compile_cache_dir() -> Optional[str]:
    """This process's persistent XLA compilation cache directory (None: off)."""
    import jax

    return jax.config.jax_compilation_cache_dir


def _share_compile_cache(directory: Optional[str]) -> None:
    """A ``--jobs`` worker's initializer: the parent's compilation cache (a cell's programs compile once per
    comparison, not once per cell: the cells of a task share every shape)."""
    from mrl_jax import compile_cache

    compile_cache.enable(directory, disabled=directory is None)


def _run_cell_job(args: tuple) -> dict:
    """``run_cell`` in a worker process (``--jobs``): the budget travels as its workload's name and fields."""
    work, probe, fields, seed, cell = args
    budget = WORKLOADS[work].settings(False)
    budget = dataclasses.replace(budget, **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    return run_cell(work, probe, budget, seed, Path(cell), verbose=False)


def _records(cell: Path) -> list[dict]:
    return [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]


def cell_figures(cell: Path, meta: dict) -> dict:
    """Per policy: the reward@1 curve (``rounds`` done: 0 = warm start, then each evaluation), final skills,
    pass@k, stability, cost."""
    w = WORKLOADS[meta["workload"]]
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
        evals = sorted((r["round"] + 1, r[w.curve_key]) for r in recs if r["policy"] == f"{name}/eval")
        curve = {"rounds": [0] + [r for r, _ in evals], "values": [summary["before"][name][w.curve_key]]
                 + [v for _, v in evals]}
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
        out["policies"][name] = {"reward_at_1": curve, "skills": w.read_skills(pol["eval"]["by_group"], parts[name]),
                                 "stability": stab, "cost": cost,
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
        out[f"{n}/reward_at_1_final"] = p["reward_at_1"]["values"][-1]
        out[f"{n}/reward_at_1_gain"] = p["reward_at_1"]["values"][-1] - p["reward_at_1"]["values"][0]
        for k, v in {**p["skills"], **p["pass_at_k"], **p["stability"], **p["cost"]}.items():
            out[f"{n}/{k}"] = v
    for k in ("reward_at_1_final", "reward_at_1_gain"):
        out[f"average/{k}"] = float(np.mean([out[f"{n}/{k}"] for n in names]))
    for k, v in fig["population"].items():
        out[f"population/{k}"] = v
    return out


def aggregate(cells: dict, probes: Sequence[str]) -> dict:
    """{probe: {"figures": {key: mean_se}, "vs_none": {key: paired}, "curves": {policy|average: {rounds, mean,
    se}}}} over the seeds of one workload."""
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
        rounds = cells[probe][0]["policies"][names[0]]["reward_at_1"]["rounds"]
        curves = {n: np.asarray([f["policies"][n]["reward_at_1"]["values"] for f in cells[probe]], np.float64)
                  for n in names}
        curves["average"] = np.mean([curves[n] for n in names], axis=0)
        for n, c in curves.items():
            se = c.std(0, ddof=1) / math.sqrt(len(c)) if len(c) > 1 else np.zeros(c.shape[1])
            entry["curves"][n] = {"rounds": rounds, "mean": c.mean(0).tolist(), "se": se.tolist()}
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


# ----------------------------------------------------------------------------- entry points

def _cells(out: Path, workloads: Sequence[str], probes: Sequence[str], s: Settings, quick: bool, jobs: int,
           verbose: bool) -> dict:
    """Every (workload, probe, seed) cell run or reused: ``{workload: {probe: [cell.json per seed]}}``. With
    ``jobs`` > 1 the cells run in that many worker processes (one XLA:CPU each)."""
    todo = [(w, p, dataclasses.asdict(WORKLOADS[w].settings(quick)), seed, str(out / w / "cells" / slug(p) / f"seed{seed}"))
            for w in workloads for seed in range(s.seeds) for p in probes]
    if verbose:
        for w, p, _, seed, cell in todo:
            print(f"[bench probes] {w}: {p} seed {seed} -> {cell}", file=sys.stderr, flush=True)
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_share_compile_cache, initargs=(_compile_cache_dir(),)) as pool:
            metas = list(pool.map(_run_cell_job, todo))
    else:
        metas = [_run_cell_job(t) for t in todo]
    out_: dict = {w: {p: [] for p in probes} for w in workloads}
    for (w, p, *_), meta in zip(todo, metas):
        out_[w][p].append(meta)
    return out_


def compare(out_dir, probes: Optional[Sequence[str]] = None, quick: bool = False, settings: Optional[Settings] = None,
            verbose: bool = True, command: Optional[str] = None, workloads: Sequence[str] = tuple(WORKLOADS),
            jobs: int = 1) -> dict:
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
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ConfigError(f"--tasks: unknown task {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    if jobs < 1:
        raise ConfigError(f"--jobs: must be >= 1, got {jobs}")
    s = settings or Settings.make(quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    metas = _cells(out, workloads, probes, s, quick, jobs, verbose)
    result_w = {}
    for w in workloads:
        cells = {p: [cell_figures(out / w / "cells" / slug(p) / f"seed{m['seed']}", m) for m in metas[w][p]]
                 for p in probes}
        wl = WORKLOADS[w]
        result_w[w] = {"title": wl.title, "settings": metas[w]["none"][0]["settings"], "skills": list(wl.skills),
                       "curve_label": wl.curve_label, "policies": list(cells["none"][0]["policies"]),
                       "probes": aggregate(cells, probes),
                       "cells": {p: [{**m, "population": f["population"]} for m, f in zip(metas[w][p], cells[p])]
                                 for p in probes},
                       "per_cell": cells}
    bandit = run_bandit(probes, s, quick, out / "bandit", verbose)
    result = {"command": command or f"mrl bench probes{' --quick' if quick else ''} --probes {','.join(probes)} "
                                    f"--tasks {','.join(workloads)} --jobs {jobs} --out {out_dir}",
              "settings": dataclasses.asdict(s), "quick": quick, "probes_run": probes, "jobs": jobs,
              "cpus": os.cpu_count(), "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
              "wall_s": round(time.perf_counter() - t0, 1), "workloads": result_w, "bandit": bandit}
    (out / "probes.json").write_text(json.dumps(result, indent=2))
    (out / "PROBES.md").write_text(probe_report.markdown(result))
    probe_report.figures(result, out)
    if verbose:
        print(f"[bench probes] wrote {out}/PROBES.md, probes.json, <task>_reward_at_1.png, <task>_skills.png, bandit/",
              file=sys.stderr)
    return result


def run_probes(out_dir, *, quick: bool = False, probes: Optional[Sequence[str]] = None,
               tasks: Optional[Sequence[str]] = None, jobs: int = 1) -> dict:
    """``mrl bench probes``: the comparison into ``out_dir`` (``tasks``: default every task); returns its headline
    (per task and probe: average held-out reward@1, its gain over the warm start, its paired difference from
    ``none``, the bandit support)."""
    res = compare(out_dir, probes, quick=quick, verbose=False, workloads=tasks or tuple(WORKLOADS), jobs=jobs)
    head = {w: {p: {"average_reward_at_1": e["figures"]["average/reward_at_1_final"],
                    "average_gain": e["figures"]["average/reward_at_1_gain"],
                    "vs_none": (e.get("vs_none") or {}).get("average/reward_at_1_final"),
                    "bandit_support": res["bandit"][p]["support"]} for p, e in r["probes"].items()}
            for w, r in res["workloads"].items()}
    return {"out": str(out_dir), "wall_s": res["wall_s"], "tasks": head}
