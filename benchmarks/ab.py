"""No-regression A/B of our CPU figures against a git revision, in ONE process: ``bench_trl``'s GRPO step and
``bench_rollout``'s sampler, this checkout vs ``--base``, timed alternately.

    python benchmarks/ab.py --base 4b4674d [--quick] [--repeats 5] [--tolerance 0.05] [--out FILE]

The base revision's ``mrl_jax/`` and ``benchmarks/`` are extracted (``git archive``) to a temporary folder and
imported beside this checkout's: each side's modules are swapped into ``sys.modules`` while that side runs, so
both live in the same process (same allocator, same thread pools, same load) and keep their own compiled
programs. The work is identical: the same assets (tokenizer, tiny Qwen2 / Llama weights saved by
``transformers``), prompts and keys, built once by this checkout's benchmark code; each side runs its own
library on them (``bench_trl._run_ours``: rollout + decode + reward + update per step; ``bench_rollout``: one
``generate`` call of the fixed-length cases). The sides alternate (A B, then B A, ...) ``--repeats`` times and the
figure of a side is its minimum (the least disturbed run). ``no_worse`` per figure: head <= base * (1 +
tolerance). TRL and ``transformers.generate`` are not run: they do not change between revisions.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
ROOTS = ("mrl_jax", "benchmarks")


class Side:
    """One revision's ``mrl_jax`` + ``benchmarks`` modules, importable from ``root`` and swapped in by ``active``."""

    def __init__(self, name: str, root: Path):
        self.name, self.root, self.modules = name, Path(root), {}

    @contextlib.contextmanager
    def active(self):
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ROOTS}
        sys.modules.update(self.modules)
        sys.path.insert(0, str(self.root))
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.path.remove(str(self.root))
            self.modules = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ROOTS}
            sys.modules.update(saved)

    def module(self, name: str):
        mod = importlib.import_module(name)
        origin = Path(mod.__file__).resolve()
        if self.root.resolve() not in origin.parents:
            raise RuntimeError(f"ab: {name} of side {self.name} was imported from {origin}, not {self.root}")
        return mod


def extract(rev: str, dest: Path) -> Path:
    """``rev``'s mrl_jax/ and benchmarks/ under ``dest`` (git archive of this repository)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "mrl_jax", "benchmarks"], check=True,
                             capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _trl_case(side: Side, assets: dict, shape_name: str, plan: dict) -> float:
    """Seconds per GRPO step (min over the timed steps) of ``side``'s library on bench_trl's ``shape_name``."""
    with side.active():
        bt = side.module("benchmarks.bench_trl")
        r = bt._run_ours(assets["tok"], assets["model_dir"], plan["warmup"], plan["steps"],
                         bt.SHAPES[shape_name], assets["prompts"][shape_name])
    return float(r["ours_s_per_step_min"])


def _rollout_case(side: Side, case: dict, key_seed: int = 0) -> float:
    """Seconds of one ``generate`` call (after a compile call) of ``side``'s sampler on a fixed-length case."""
    with side.active():
        import jax
        from flax import nnx

        models, rollout = side.module("mrl_jax.models"), side.module("mrl_jax.rollout")
        if "params" not in case.setdefault(side.name, {}):
            case[side.name]["params"] = nnx.split(models.from_pretrained(case["dir"]))
        graphdef, params = case[side.name]["params"]
        s, g = case["spec"], case["spec"].get("samples", 1)
        cfg = rollout.SamplingConfig(max_new_tokens=s["new_tokens"], temperature=1.0, eos_id=None, pad_id=0)
        ids, mask = jax.numpy.asarray(case["ids"]), jax.numpy.asarray(case["mask"])
        extra = {"num_samples": g} if g > 1 else {}

        def call():
            return jax.block_until_ready(rollout.generate(graphdef, params, ids, mask, jax.random.key(key_seed),
                                                          cfg, **extra))

        call()
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0


def _assets(head: Side, root: Path, quick: bool) -> tuple[dict, dict]:
    """bench_trl's tokenizer, model and prompts; bench_rollout's saved weights and prompts (head's code)."""
    with head.active():
        bt, br = head.module("benchmarks.bench_trl"), head.module("benchmarks.bench_rollout")
        tok, model_dir, _ = bt._build_assets(str(root))
        trl = {"tok": tok, "model_dir": model_dir,
               "prompts": {n: bt._prompts(64, sh["prompt_tokens"], tok) for n, sh in bt.SHAPES.items()}}
        cases = {}
        for fam, name in br.PLAN[bool(quick)]:
            if fam != "llama":
                continue
            spec = br.CASES[name]
            d = root / f"rollout_{name}"
            br._hf_model(fam, spec).save_pretrained(d, safe_serialization=True)
            ids, mask = br._prompts(spec, spec["vocab"])
            cases[name] = {"spec": spec, "dir": str(d), "ids": ids, "mask": mask}
    return trl, cases


def run(base_rev: str, quick: bool = False, repeats: int = 5, tolerance: float = 0.05) -> dict:
    plan = {"warmup": 2, "steps": 3} if quick else {"warmup": 3, "steps": 6}
    with tempfile.TemporaryDirectory(prefix="ab_") as tmp:
        tmp = Path(tmp)
        head, base = Side("head", REPO), Side("base", extract(base_rev, tmp / "base"))
        trl, cases = _assets(head, tmp, quick)
        figures = {f"trl_{n}": {"head": [], "base": []} for n in trl["prompts"]}
        figures.update({f"rollout_{n}": {"head": [], "base": []} for n in cases})
        for rep in range(repeats):
            order = (head, base) if rep % 2 == 0 else (base, head)
            for side in order:
                for n in trl["prompts"]:
                    figures[f"trl_{n}"][side.name].append(_trl_case(side, trl, n, plan))
                for n, case in cases.items():
                    figures[f"rollout_{n}"][side.name].append(_rollout_case(side, case))
    out = {"benchmark": "ab", "base": base_rev, "head": _head_rev(), "quick": quick, "repeats": repeats,
           "tolerance": tolerance, "figures": {}}
    for name, f in figures.items():
        h, b = min(f["head"]), min(f["base"])
        out["figures"][name] = {"head_s": h, "base_s": b, "head_over_base": h / b, "no_worse": h <= b * (1 + tolerance),
                                "head_all": f["head"], "base_all": f["base"]}
    out["no_worse"] = all(f["no_worse"] for f in out["figures"].values())
    return out


def _head_rev() -> str:
    r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "mrl_jax", "benchmarks"],
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def table(r: dict) -> str:
    lines = [f"A/B head {r['head']} vs base {r['base']} (min of {r['repeats']} alternating runs, one process)",
             "| figure | head s | base s | head / base | no worse |", "|---|---|---|---|---|"]
    for name, f in r["figures"].items():
        lines.append(f"| {name} | {f['head_s']:.4f} | {f['base_s']:.4f} | {f['head_over_base']:.3f} | "
                     f"{f['no_worse']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git revision to compare with (e.g. 4b4674d)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    r = run(args.base, args.quick, args.repeats, args.tolerance)
    print(table(r), file=sys.stderr)
    text = json.dumps(r, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if r["no_worse"] else 1


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
