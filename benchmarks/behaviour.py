"""Whole-run behaviour of a tree, and the differences between two recordings: the evidence a refactor needs.
Used by ``ab.py --base REV --case behaviour`` (this checkout against a revision):

    python benchmarks/ab.py --base REV --case behaviour [--only tiny_two_policy demo] [--rtol 0] [--records DIR]

``record(out, root)`` runs ``root``'s library (``PYTHONPATH=root``, each run in its own process): each YAML of
``root/experiments/configs/`` except ``real_checkpoints.yaml`` (it needs downloaded checkpoints) for 3 rounds with a
checkpoint and a held-out eval at round 3 (``families.yaml`` on the tiny Hugging Face directories
``experiments/family_models.py`` writes), ``mrl demo --quick`` (its first seed) and ``mrl bandit --quick``.
``compare`` reads every metrics / samples / groups record, every leaf of each run's final checkpoint and both
summaries, and reports each value whose relative difference exceeds ``rtol``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compare reads checkpoints: no TPU backend probed where libtpu is installed
RECORD_FILES = ("metrics.jsonl", "samples.jsonl", "groups.jsonl")
SKIPPED_CONFIGS = ("real_checkpoints.yaml",)
TIME_KEYS = ("time", "wall", "_s", "per_s", "seconds", "timestamp", "compile")


def _env(root: Path) -> dict:
    """This environment with ``root`` first on ``PYTHONPATH``: a child process imports that tree's ``mrl_jax``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}


def _mrl(*args: str, cwd: Path, root: Path) -> None:
    subprocess.run([sys.executable, "-m", "mrl_jax.cli", *args], cwd=cwd, env=_env(root), check=True,
                   stdout=sys.stderr)   # stdout is the report's


def _three_rounds(src: Path, dst: Path) -> Path:
    cfg = yaml.safe_load(src.read_text())
    cfg.update(rounds=3, checkpoint_every=3, eval_every=3)
    dst.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


def record(out: Path, root: Path = ROOT, only: list[str] | None = None) -> None:
    """Write ``out/<config>/`` run directories, ``out/demo/`` and ``out/bandit/`` of the tree at ``root``."""
    out.mkdir(parents=True, exist_ok=True)
    configs = sorted(p for p in (root / "experiments" / "configs").glob("*.yaml") if p.name not in SKIPPED_CONFIGS)
    for src in configs:
        name = src.stem
        if only and name not in only:
            continue
        if name == "families" and not (out / "runs" / "family_models").exists():
            subprocess.run([sys.executable, str(root / "experiments" / "family_models.py"), "runs/family_models"],
                           cwd=out, env=_env(root), check=True, stdout=sys.stderr)
        cfg = _three_rounds(src, out / f"{name}.yaml")
        _mrl("train", "--config", str(cfg), "--out", str(out / name), cwd=out, root=root)
    if not only or "demo" in only:
        _mrl("demo", "--quick", "--out", str(out / "demo"), cwd=out, root=root)
    if not only or "bandit" in only:
        _mrl("bandit", "--quick", "--out", str(out / "bandit"), cwd=out, root=root)


def _is_time(key: str) -> bool:
    return any(t in key.lower() for t in TIME_KEYS)


def _diff(a, b, where: str, rtol: float, found: list) -> None:
    """Append ``where`` (and the values) for every leaf of two JSON values that differ beyond ``rtol``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if _is_time(k):
                continue
            if k not in a or k not in b:
                found.append(f"{where}/{k}: only in {'B' if k not in a else 'A'}")
            else:
                _diff(a[k], b[k], f"{where}/{k}", rtol, found)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            found.append(f"{where}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", rtol, found)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not (a == b or (math.isnan(a) and math.isnan(b))
                or abs(a - b) <= rtol * max(abs(a), abs(b), 1e-6)):
            found.append(f"{where}: {a!r} vs {b!r}")
    elif a != b:
        found.append(f"{where}: {str(a)[:60]!r} vs {str(b)[:60]!r}")


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checkpoint_leaves(run_dir: Path) -> list[tuple[str, object]]:
    """``[(path, np.ndarray)]`` of a run's latest checkpoint, read without a template."""
    import jax

    from mrl_jax.trainer.checkpoint import RunCheckpointer

    ckpt = RunCheckpointer(run_dir)
    try:
        tree, _ = ckpt.read()
    finally:
        ckpt.close()
    return [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def compare(a: Path, b: Path, rtol: float = 1e-6) -> dict:
    """``{run: [differences]}`` between two recordings (an empty list: the same to ``rtol``)."""
    import numpy as np

    report = {}
    for run in sorted(p.name for p in a.iterdir() if p.is_dir() and p.name != "runs"):
        found: list = []
        for name in RECORD_FILES:
            _diff(_records(a / run / name), _records(b / run / name), f"{name}", rtol, found)
        if (a / run / "summary.json").exists():
            _diff(json.loads((a / run / "summary.json").read_text()),
                  json.loads((b / run / "summary.json").read_text()), "summary.json", rtol, found)
        if (a / run / "checkpoints").exists():
            la, lb = checkpoint_leaves(a / run), checkpoint_leaves(b / run)
            if [p for p, _ in la] != [p for p, _ in lb]:
                found.append(f"checkpoint: leaf paths differ ({len(la)} vs {len(lb)} leaves)")
            for (p, x), (_, y) in zip(la, lb):
                x, y = np.asarray(x), np.asarray(y)
                if x.shape != y.shape or x.dtype != y.dtype:
                    found.append(f"checkpoint{p}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
                elif np.issubdtype(x.dtype, np.floating) and not np.allclose(x, y, rtol=rtol, atol=rtol * 1e-2):
                    found.append(f"checkpoint{p}: max |diff| {float(np.max(np.abs(x - y))):.3g}")
                elif not np.issubdtype(x.dtype, np.floating) and not np.array_equal(x, y):
                    found.append(f"checkpoint{p}: integers differ")
        report[run] = found
    return report
