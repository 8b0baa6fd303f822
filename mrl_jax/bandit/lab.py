"""The full analysis: every probe x setting (group size G, THL residual sigma) -> summary.json, summary.md,
plane.png, curves.png. ``run(out_dir, quick=False, seed=0)`` is what ``mrl bandit`` calls."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import numpy as np

from mrl_jax.bandit import env as E
from mrl_jax.bandit import lab_probes as LP
from mrl_jax.bandit import measure as M
from mrl_jax.bandit import report as R
from mrl_jax.configs import check, field, load_yaml, to_dict
from mrl_jax.report.progress import Progress


@dataclasses.dataclass(frozen=True)
class LabConfig:
    """One analysis run (every field documented; ``mrl_jax.configs.load_yaml(LabConfig, path)``)."""

    env: E.EnvConfig = field(default_factory=E.EnvConfig, help="the bandit and its policies")
    probes: tuple[str, ...] = field(LP.DEFAULT_PROBES, help="lab probe names (see mrl_jax.bandit.lab_probes.LAB_PROBES) or "
                                                 "probe specs (e.g. 'pkg.mod:hedge:lam=0.2+sgt'; Monte Carlo only)")
    group_sizes: tuple[int, ...] = field((2, 4, 8), help="G values; each runs at the headline sigma")
    sigmas: tuple[float, ...] = field((0.0, 0.5, 1.0, 2.0), help="THL residual levels (std of the log-ratio noise, nats); "
                                                     "each runs at the headline G")
    headline_G: int = field(4, help="G of the headline table")
    headline_sigma: float = field(1.0, help="sigma of the headline table and of the G sweep")
    drop: float = field(0.0, help="probability that a peer row's only THL chunk is residual (masked)")
    lr: float = field(8.0, help="SGD learning rate on the learner's loss (a mean over the C prompts)")
    steps: int = field(200, help="training steps (rounds)")
    seeds: int = field(32, help="Monte Carlo seeds (vmapped)")
    record_every: int = field(10, help="record success every this many steps")
    exact_flow: bool = field(True, help="also run the exact expected-update flow (closed-form probes)")
    compile_mode: str = field("auto", help="fast (XLA backend optimisation level 0: quick compiles, slower steps) | "
                                           "optimized | auto (fast, except long runs of the SGT probes, whose "
                                           "O(rows^2) rescue draw runs much faster optimised)")

    def __post_init__(self):
        for p in self.probes:
            try:
                LP.get(p)
            except ValueError as e:
                check(False, "probes", str(e))
        check(self.headline_G in self.group_sizes, "headline_G", "must be one of group_sizes")
        check(self.headline_sigma in self.sigmas, "headline_sigma", "must be one of sigmas")
        check(all(g >= 1 for g in self.group_sizes), "group_sizes", "must be >= 1")
        check(all(s >= 0 for s in self.sigmas), "sigmas", "must be >= 0")
        check(0.0 <= self.drop < 1.0, "drop", "must be in [0, 1)")
        check(self.compile_mode in ("auto", "fast", "optimized"), "compile_mode",
              f"must be auto | fast | optimized, got {self.compile_mode!r}")
        check(self.lr > 0 and self.steps >= self.record_every >= 1 and self.seeds >= 2, "steps",
              "need lr > 0, steps >= record_every >= 1, seeds >= 2")

    def grid(self) -> list[dict]:
        """The settings: the sigma sweep at headline_G, then the G sweep at headline_sigma."""
        out = [{"G": self.headline_G, "sigma": float(s)} for s in self.sigmas]
        out += [{"G": g, "sigma": float(self.headline_sigma)} for g in self.group_sizes if g != self.headline_G]
        return out


QUICK = dict(group_sizes=(4,), sigmas=(0.0, 1.0), steps=60, seeds=16, record_every=10)


def default_config(quick: bool = False) -> LabConfig:
    return LabConfig(**QUICK) if quick else LabConfig()


def _setting_rows(env: E.Env, name: str, spec: LP.LabProbe, G: int, sigmas: list, cfg: LabConfig, seed: int,
                  curves: dict) -> list[dict]:
    """Run one probe at one G over the given sigmas; return one result row per sigma."""
    run_sigmas = sigmas if spec.uses_ratio else sigmas[:1]               # sigma cannot change the others
    # SGT's rescue draw is O(rows^2) per step: worth an optimised compile once the run is long enough
    work = cfg.seeds * cfg.steps * len(run_sigmas) * (G / 4.0) ** 2
    fast = cfg.compile_mode == "fast" or (cfg.compile_mode == "auto" and not (spec.sgt and work > 4000))
    mc = M.train_mc(env, spec, G=G, lr=cfg.lr, steps=cfg.steps, seeds=cfg.seeds, sigmas=run_sigmas, drop=cfg.drop,
                    record_every=cfg.record_every, seed=seed, fast_compile=fast)
    ex = None
    if cfg.exact_flow and spec.exact:
        ex = M.train_exact(env, spec, G=G, lr=cfg.lr, steps=cfg.steps, sigmas=run_sigmas, drop=cfg.drop,
                           record_every=cfg.record_every, fast_compile=cfg.compile_mode != "optimized")
    rows = []
    for li_req, sigma in enumerate(sigmas):
        li = li_req if spec.uses_ratio else 0
        J = mc["J"][li]                                                   # [S, R, N, C]
        km = M.kind_means(env, J)                                         # kind -> [S, R]
        gain = km["oos"][:, -1] - km["oos"][:, 0]
        allm = J.mean((-1, -2))                                           # [S, R]
        sup, sup_se = M.mean_se(gain)
        fin, fin_se = M.mean_se(allm[:, -1])
        eu0 = None if ex is None else ex["eu0"][li]
        uv = M.update_variance(mc["u0"][li], eu0)
        stab = {"update_var": uv["var"], "update_var_se": uv["var_se"], "noise_ratio": uv["noise_ratio"],
                "direction_var": uv["direction_var"],
                "update_signal": uv["signal"], "kl_per_step": float(mc["kl"][li].mean()),
                "collapse_frac": float(M.collapsed(env, J).mean())}
        for k, v in mc["metrics"].items():
            stab["mc_" + k.replace("/", "_")] = float(np.asarray(v[li]).mean())
        if ex is not None and ex["weights"]:
            stab["weight_ess"] = float(np.mean(ex["weights"]["ess"][li]))
            stab["weight_var"] = float(np.mean(ex["weights"]["var"][li]))
            stab["weight_mean"] = float(np.mean(ex["weights"]["mean"][li]))
        elif spec.prp:
            stab["weight_ess"] = stab.get("mc_prp_ess")
            stab["weight_var"] = stab.get("mc_prp_weight_var")
        row = {"probe": name, "G": G, "sigma": float(sigma), "support": sup, "support_se": sup_se,
               "final_reward": fin, "final_reward_se": fin_se,
               "hard_final": float(km["hard"][:, -1].mean()), "easy_final": float(km["easy"][:, -1].mean()),
               "reward_auc": float(allm.mean()), "hard_auc": float(km["hard"].mean()),
               "oos_final": float(km["oos"][:, -1].mean()), "stability": stab, "exact": spec.exact,
               "sigma_independent": not spec.uses_ratio}
        cd = {"steps": mc["steps_recorded"], "mc_all": allm.mean(0), "mc_all_se": allm.std(0, ddof=1) / np.sqrt(len(allm)),
              "mc_oos": km["oos"].mean(0), "mc_oos_se": km["oos"].std(0, ddof=1) / np.sqrt(len(allm))}
        if ex is not None:
            Je = ex["J"][li]                                              # [R, N, C]
            kme = M.kind_means(env, Je)
            row["support_exact"] = float(kme["oos"][-1] - kme["oos"][0])
            row["final_reward_exact"] = float(Je[-1].mean())
            row["support_rate"] = float(np.mean(ex["rate0"][li]))
            row["stability"]["kl_per_step_exact"] = float(np.mean(ex["kl"][li]))
            cd.update(exact_steps=ex["steps_recorded"], exact_all=Je.mean((-1, -2)), exact_oos=kme["oos"])
        row["curve_mc_all"] = [float(x) for x in cd["mc_all"]]
        row["curve_mc_oos"] = [float(x) for x in cd["mc_oos"]]
        row["curve_steps"] = [int(x) for x in cd["steps"]]
        curves[(name, G, float(sigma))] = cd
        rows.append(row)
    return rows


def run(out_dir: str, quick: bool = False, seed: int = 0, config: Optional[LabConfig] = None,
        verbose: bool = True) -> dict:
    """Run the analysis and write summary.json, summary.md, plane.png and curves.png into out_dir.
    Returns the summary dict ({"probes": {name: {...}}, "settings": {...}, "results": [...]})."""
    cfg = config if config is not None else default_config(quick)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    env = E.make_env(cfg.env)
    grid = cfg.grid()
    results, curves = [], {}
    sizes = sorted({s["G"] for s in grid})
    with Progress(len(cfg.probes) * len(sizes), title="bandit", unit="setting", enabled=verbose) as bar:
        for name in cfg.probes:
            spec = LP.get(name)
            for G in sizes:
                sig = [s["sigma"] for s in grid if s["G"] == G]
                t = time.time()
                bar.start(f"{name} G={G}")
                rows = _setting_rows(env, name, spec, G, sig, cfg, seed, curves)
                results += rows
                bar.done(f"sigmas={sig}: support " + " ".join(f"{r['support']:.3f}" for r in rows)
                         + " final reward " + " ".join(f"{r['final_reward']:.3f}" for r in rows)
                         + f" ({time.time() - t:.1f}s)")
    head = {"G": cfg.headline_G, "sigma": float(cfg.headline_sigma)}
    probes = {}
    for name in cfg.probes:
        r = next(r for r in results if r["probe"] == name and r["G"] == head["G"] and r["sigma"] == head["sigma"])
        probes[name] = {k: v for k, v in r.items() if not k.startswith("curve_") and k not in ("probe",)}
    summary = {"probes": probes,
               "settings": {"quick": quick, "seed": seed, "headline": head, "grid": grid, "env": E.describe(env),
                            "train": {"lr": cfg.lr, "steps": cfg.steps, "seeds": cfg.seeds, "drop": cfg.drop,
                                      "optimizer": "sgd"},
                            "config": to_dict(cfg), "seconds": None},
               "results": results, "notes": notes(results, head)}
    summary["settings"]["seconds"] = round(time.time() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    (out / "summary.md").write_text(R.markdown(summary))
    R.plane(summary, out / "plane.png")
    R.curves(summary, curves, out / "curves.png")
    if verbose:
        print(f"[bandit] wrote {out}/summary.json, summary.md, plane.png, curves.png in {time.time() - t0:.0f}s")
    return summary


def rewrite_markdown(out_dir: str) -> None:
    """Regenerate summary.md from an existing summary.json (after a report-format change)."""
    out = Path(out_dir)
    (out / "summary.md").write_text(R.markdown(json.loads((out / "summary.json").read_text())))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def notes(results: list[dict], head: dict) -> list[str]:
    """Automatic, factual observations (which probe leads each figure at each setting)."""
    out = []
    settings = sorted({(r["G"], r["sigma"]) for r in results})
    for G, s in settings:
        rs = [r for r in results if r["G"] == G and r["sigma"] == s]
        best_sup = max(rs, key=lambda r: r["support"])
        best_fin = max(rs, key=lambda r: r["final_reward"])
        out.append(f"G={G}, σ={s:g}: most support {best_sup['probe']} ({best_sup['support']:.3f}); "
                   f"best final reward {best_fin['probe']} ({best_fin['final_reward']:.3f}); zero-support probes: "
                   + (", ".join(r["probe"] for r in rs if r["support"] == 0.0) or "none"))
    return out


def load_config(path: str) -> LabConfig:
    """A LabConfig from YAML (keys as the dataclass fields; env: {...})."""
    return load_yaml(LabConfig, path)


__all__ = ["LabConfig", "default_config", "run", "load_config", "rewrite_markdown"]
