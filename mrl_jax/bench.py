"""``mrl bench``: runs the scripts of ``benchmarks/`` side by side and gathers their figures.

Each ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> dict``; the harness runs every one (or
``only``), keeps going when one fails (its error is recorded), and returns ``{"benchmarks": {name: figures}}``
plus the machine and library versions. The scripts live in the source checkout, not in the wheel.
"""

from __future__ import annotations

import importlib.util
import platform
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def available() -> list[str]:
    """Names of the benchmarks found in ``benchmarks/`` (``bench_<name>.py``)."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def _load(name: str):
    path = BENCH_DIR / f"bench_{name}.py"
    spec = importlib.util.spec_from_file_location(f"mrl_benchmarks.{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def environment() -> dict:
    """Machine and versions, recorded with every set of figures."""
    import jax

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for lib in ("flax", "optax", "tokenizers", "transformers", "torch"):
        try:
            versions[lib] = __import__(lib).__version__
        except ImportError:
            versions[lib] = None
    return {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "devices": [str(d) for d in jax.devices()], "versions": versions}


def script_main(run, description: str, argv: list[str] | None = None) -> int:
    """The command line every ``benchmarks/bench_*.py`` shares: ``[--quick] [--out FILE]`` -> JSON on stdout."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small shapes / fewer timed steps")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    text = json.dumps(run(quick=args.quick), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def run_benchmarks(out_dir: str | Path, *, quick: bool = False, only: list[str] | None = None) -> dict:
    """Run the benchmarks; returns the summary written to ``out_dir/summary.json`` by the CLI."""
    if not BENCH_DIR.is_dir():
        raise FileNotFoundError(
            f"benchmarks/ not found next to the package ({BENCH_DIR}); run `mrl bench` from a source checkout "
            "installed with `pip install -e .`.")
    names = available()
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; available: {names}")
    results: dict[str, dict] = {}
    for name in only or names:
        t0 = time.perf_counter()
        try:
            figures = _load(name).run(quick=quick)
        except Exception as e:  # one broken benchmark must not lose the others' figures
            figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
        figures["wall_s"] = round(time.perf_counter() - t0, 2)
        results[name] = figures
        print(f"[bench] {name}: {figures.get('error', 'ok')} ({figures['wall_s']} s)", flush=True)
    return {"quick": quick, "environment": environment(), "benchmarks": results}
