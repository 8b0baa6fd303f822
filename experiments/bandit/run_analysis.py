"""Run the contextual-bandit analysis (same as `mrl bandit`), optionally from a YAML config.

    python experiments/bandit/run_analysis.py --out experiments/bandit/results            # full (defaults)
    python experiments/bandit/run_analysis.py --quick --out /tmp/bandit_quick
    python experiments/bandit/run_analysis.py --config experiments/bandit/full.yaml --out DIR
"""

import argparse

from mrl_jax import compile_cache
from mrl_jax.bandit import lab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (summary.json, summary.md, plane.png, curves.png)")
    ap.add_argument("--config", default=None, help="YAML LabConfig (default: built-in full or quick settings)")
    ap.add_argument("--quick", action="store_true",
                    help="small settings, about 2 minutes on 2 CPU cores (1.5 with a warm compilation cache)")
    ap.add_argument("--seed", type=int, default=0, help="base random seed of the Monte Carlo runs")
    args = ap.parse_args()
    cfg = lab.load_config(args.config) if args.config else None
    compile_cache.enable()   # as `mrl bandit` does: a later run loads the probes' compiled programs from disk
    lab.run(args.out, quick=args.quick, seed=args.seed, config=cfg)


if __name__ == "__main__":
    main()
