"""Robustness variants of the bandit analysis at the headline setting (G = 4, sigma in {0, 1}).

Each variant changes one thing against the default lab and is written to OUT/<variant>/ (summary.json,
summary.md, plane.png, curves.png); OUT/variants.md collects support / final reward / stability per probe.

    python experiments/bandit/variants.py --out experiments/bandit/results/variants
    python experiments/bandit/variants.py --quick --out DIR     # each variant at `mrl bandit --quick`'s budget
"""

import argparse
import dataclasses
import json
from pathlib import Path

from mrl_jax import compile_cache
from mrl_jax.bandit import lab
from mrl_jax.bandit.env import EnvConfig

BASE = dict(group_sizes=(4,), sigmas=(0.0, 1.0), headline_G=4, headline_sigma=1.0, steps=200, seeds=32)
VARIANTS = {
    # plain softmax sampling: out-of-support correct arms keep the same ~1e-3 raw mass but can be sampled
    "no_truncation": dict(env=EnvConfig(min_p=0.0)),
    # 4x the learning rate: does any probe destabilise (collapse) or gain from the larger steps?
    "high_lr": dict(lr=32.0),
    # parameters shared across contexts (s = 0.5): updates transfer and interfere between contexts
    "shared_params": dict(env=EnvConfig(context_sharing=0.5)),
    # two more probe configurations: PRP with untruncated weights, SGT with lambda = 1
    "extra_probes": dict(probes=("none", "prp", "prp_raw", "sgt", "sgt_lam1")),
}
QUICK_PROBES = {"extra_probes": ("none", "prp_raw", "sgt_lam1")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: each variant at the quick lab's steps and seeds, under none and sgt only "
                         "(extra_probes: its own two probes and none)")
    args = ap.parse_args()
    out = Path(args.out)
    names = args.only.split(",") if args.only else list(VARIANTS)
    compile_cache.enable()   # as `mrl bandit` does
    for name in names:
        cfg = dataclasses.replace(lab.LabConfig(), **{**BASE, **VARIANTS[name]})
        if args.quick:   # each lab probe is its own compile, several seconds: the smoke run compiles few
            cfg = dataclasses.replace(cfg, **{k: lab.QUICK[k] for k in ("steps", "seeds", "record_every")},
                                      probes=QUICK_PROBES.get(name, ("none", "sgt")))
        lab.run(str(out / name), seed=args.seed, config=cfg)
    lines = ["# Bandit variants (headline G = 4, σ = 1)", "",
             "Each variant changes one thing against the default lab (see variants.py).", "",
             "| variant | probe | support | final reward | reward AUC | hard AUC | easy final | update var | dir var | "
             "collapse |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        f = out / name / "summary.json"
        if not f.is_file():
            continue
        s = json.loads(f.read_text())
        for p, r in s["probes"].items():
            st = r["stability"]
            lines.append(f"| {name} | {p} | {r['support']:.3f} ± {r['support_se']:.3f} | {r['final_reward']:.3f} | "
                         f"{r['reward_auc']:.3f} | {r['hard_auc']:.3f} | {r['easy_final']:.3f} | {st['update_var']:.4f} | "
                         f"{st['direction_var']:.3f} | {st['collapse_frac']:.2f} |")
    (out / "variants.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
