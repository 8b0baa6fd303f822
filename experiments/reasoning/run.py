"""Reasoning experiment: three heterogeneous tiny policies, per-policy and population pass@k before and after
MRL training, under probes ``none`` and ``sgt`` over seeds, on a reasoning-gym mixture (``rg_mixture.yaml``)
and on a small parquet file scored by math-verify (``--variant dataset``; the file is written here).

    python experiments/reasoning/run.py --out /tmp/reasoning [--variant rg|dataset] [--seeds 3] [--quick]
    python experiments/reasoning/run.py --out /tmp/reasoning --collect     # tabulate the finished runs

Runs go seed by seed (none, then sgt, for each seed); a finished run (its summary.json) is not run again.

"Before" is the held-out evaluation of the warm-started policies (summary.json's ``before``, the state round 0
starts from); "after" is the run's final evaluation. Writes results.json and results.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_parquet(path: Path, n: int = 400, seed: int = 0) -> Path:
    """Two-operand arithmetic in words with LaTeX-free gold answers (math-verify reads the completion)."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, 10, size=2))
        op = ["+", "-", "*"][int(rng.integers(0, 3))]
        rows.append({"prompt": f"What is {a} {op} {b}?", "answer": str(eval(f"{a}{op}{b}")), "op": op})
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def config(variant: str, probes: str, seed: int, out: Path, quick: bool):
    import yaml

    from mrl_jax.configs import from_dict
    from mrl_jax.trainer.config import RunConfig

    # read as data: the dataset variant replaces the reasoning-gym task, so it runs without that extra installed
    cfg = yaml.safe_load((HERE / "rg_mixture.yaml").read_text())
    cfg["seed"] = seed
    for p in cfg["policies"]:
        p["probes"] = probes
    if variant == "dataset":
        cfg["task"] = {"name": "dataset", "path": str(write_parquet(out / "arith.parquet")), "verifier": "math_verify",
                       "eval_fraction": 0.15, "prompt_field": "prompt", "answer_field": "answer"}
    if quick:   # a smoke run: every phase once or twice
        cfg.update(rounds=2, eval_prompts=8, eval_samples=2)
        for p in cfg["policies"]:
            p["warm_start"]["steps"] = 20
    return from_dict(RunConfig, cfg)


def pick(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k == "success" or "@" in k}


def result_of(variant: str, probes: str, seed: int, summary: dict) -> dict:
    """The before / after pass@k figures of one run's summary.json."""
    before = summary["before"]
    after = {n: p["eval"] for n, p in summary["policies"].items()}
    return {"variant": variant, "probes": probes, "seed": seed,
            "before": {n: pick(v) for n, v in before.items() if n != "population"}
            | {"population": before["population"]},
            "after": {n: pick(v) for n, v in after.items()} | {"population": summary["population"]}}


def one(variant: str, probes: str, seed: int, out: Path, quick: bool) -> dict:
    from mrl_jax.trainer import train

    run_dir = out / f"{variant}_{probes}_s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config(variant, probes, seed, out, quick)
    return result_of(variant, probes, seed, train(cfg, run_dir, progress=False))


def collect(out: Path) -> list[dict]:
    """The results of every finished run under ``out`` (``{variant}_{probes}_s{seed}/summary.json``)."""
    results = []
    for summary in sorted(out.glob("*_s*/summary.json")):
        variant, probes, seed = summary.parent.name.rsplit("_", 2)
        results.append(result_of(variant, probes, int(seed[1:]), json.loads(summary.read_text())))
    return results


def table(results: list[dict]) -> str:
    lines = ["| variant | probes | seed | who | pass@1 before | pass@1 after | pass@K before | pass@K after |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        K = max(int(k.split("@")[1]) for k in r["after"]["population"] if k.startswith("pass@"))
        for who in r["after"]:
            b, a = r["before"][who], r["after"][who]
            lines.append(f"| {r['variant']} | {r['probes']} | {r['seed']} | {who} | {b['pass@1']:.3f} | "
                         f"{a['pass@1']:.3f} | {b[f'pass@{K}']:.3f} | {a[f'pass@{K}']:.3f} |")
    return "\n".join(lines) + "\n"


def _mean_spread(values: list[float]) -> str:
    """``mean ± sample std`` (``mean`` alone for one value)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return f"{m:.3f}"
    sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{m:.3f} ± {sd:.3f}"


def seed_table(results: list[dict]) -> str:
    """Per (variant, probes, who): pass@1 and pass@K before and after, mean ± std over seeds (n seeds)."""
    lines = ["| variant | probes | seeds | who | pass@1 before | pass@1 after | pass@K before | pass@K after |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in results:
        groups.setdefault((r["variant"], r["probes"]), []).append(r)
    for (variant, probes), rs in sorted(groups.items()):
        K = max(int(k.split("@")[1]) for k in rs[0]["after"]["population"] if k.startswith("pass@"))
        for who in rs[0]["after"]:
            cells = [_mean_spread([r[when][who][f"pass@{k}"] for r in rs])
                     for k in (1, K) for when in ("before", "after")]
            lines.append(f"| {variant} | {probes} | {len(rs)} | {who} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nK = {K}; spread = sample standard deviation over seeds.\n"


def write(out: Path, results: list[dict]) -> str:
    text = seed_table(results) + "\n" + table(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", choices=["rg", "dataset"], default="rg")
    ap.add_argument("--probes", default="none,sgt")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, 8 eval prompts, K = 2, 20 warm-start steps")
    ap.add_argument("--collect", action="store_true", help="only tabulate the finished runs under --out")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        from mrl_jax.compile_cache import enable
        from mrl_jax.configs import ConfigError

        enable()   # the runs share shapes: later ones load their compiled programs from disk
        try:
            for s in range(args.seeds):   # seed-major: an interrupted sweep still pairs the probes per seed
                for p in args.probes.split(","):
                    if not (args.out / f"{args.variant}_{p}_s{s}" / "summary.json").is_file():
                        one(args.variant, p, s, args.out, args.quick)
        except ConfigError as e:   # one line, as `mrl train` says it
            raise SystemExit(f"run.py: config error: {e}") from None
    print(write(args.out, collect(args.out)))


if __name__ == "__main__":
    main()
