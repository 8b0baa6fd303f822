"""``mrl bench``: runs the scripts of ``benchmarks/`` side by side and gathers their figures.

Each ``benchmarks/bench_<name>.py`` exposes ``run(quick: bool) -> dict``; the harness runs every one (or
``only``), keeps going when one fails (its error is recorded), and returns ``{"benchmarks": {name: figures}}``
plus the machine and library versions. The scripts live in the source checkout, not in the wheel (``mrl bench
probes``, :mod:`mrl_jax.bench.probes`, is in the wheel).

``--quick`` is a quick look (a few minutes on 2 cores): the :data:`QUICK_LOOK` benchmarks with their quick
settings, one figure each for the sampler, the update, THL and the TRL comparison; the multi-policy and
multi-device ones (placement, MWRA, scaling) compile several policies or device counts and run with the full
``mrl bench`` only (or when named in ``only``). Their entries say so.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
import time
import traceback
from pathlib import Path

from mrl_jax.bench import load as bench_load
from mrl_jax.configs import ConfigError
from mrl_jax.report.progress import Progress

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
QUICK_LOOK = ("rollout", "thl", "trl", "update")
# not in every `mrl bench`: hours of TPU compiles (--only tpu)
OWN_COMMAND = ("tpu",)


def available() -> list[str]:
    """Names of the benchmarks found in ``benchmarks/`` (``bench_<name>.py``)."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def _load(name: str):
    path = BENCH_DIR / f"bench_{name}.py"
    spec = importlib.util.spec_from_file_location(f"mrl_benchmarks.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses (and pickling) look their module up by name
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
    """The command line every ``benchmarks/bench_*.py`` shares -> JSON on stdout.

    ``[--quick] [--out FILE] [--wait-idle SECONDS] [--idle-load LOAD]``: with ``--wait-idle`` it first waits
    (at most SECONDS) for the 1-min load average to fall below LOAD (default 0.25 per core). The JSON gets
    ``"load"`` (:func:`mrl_jax.bench.load.summarize` of every timed section) and a top-level ``"contended"``.
    """
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small shapes / fewer timed steps")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                    help="wait at most SECONDS for the machine to be quiet before timing (0 = do not wait)")
    ap.add_argument("--idle-load", type=float, default=None, metavar="LOAD",
                    help="quiet = 1-min load average below LOAD; also the contended threshold "
                    f"(default 0.25 per core = {bench_load.default_threshold():g} here)")
    args = ap.parse_args(argv)
    print_figures(run_recorded(lambda: run(quick=args.quick), args.wait_idle, args.idle_load), args.out)
    return 0


def print_figures(figures: dict, out: str | None = None) -> None:
    """A benchmark's figures as indented JSON on stdout, and into ``out`` when given."""
    import json

    text = json.dumps(figures, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def run_recorded(fn, wait_idle_s: float = 0.0, threshold: float | None = None) -> dict:
    """Run ``fn() -> dict`` after an optional bounded idle wait; attach the load record of its sections."""
    wait = bench_load.wait_idle(wait_idle_s, threshold) if wait_idle_s > 0 else None
    bench_load.settle_sections(wait_idle_s)   # and before each timed section (its own set-up raised the load)
    bench_load.collect()  # drop anything logged before this benchmark
    try:
        with bench_load.section("whole_run", threshold) as whole:
            figures = fn()
    finally:
        bench_load.settle_sections(0)
    sections = [r for r in bench_load.collect() if r is not whole]
    load = bench_load.summarize(sections or [whole], wait)
    load["whole_run"] = whole
    figures["load"] = load
    figures["contended"] = load["contended"]
    return figures


def run_benchmarks(out_dir: str | Path, *, quick: bool = False, only: list[str] | None = None,
                   wait_idle_s: float = 0.0, idle_load: float | None = None) -> dict:
    """Run the benchmarks; returns the summary written to ``out_dir/summary.json`` by the CLI.

    Each benchmark's figures carry ``load`` and ``contended`` (see :func:`run_recorded`); the summary's
    ``contended`` is True when any benchmark's is. ``wait_idle_s`` > 0 waits (bounded) for quiet first.
    """
    if not BENCH_DIR.is_dir():
        raise FileNotFoundError(
            f"benchmarks/ not found next to the package ({BENCH_DIR}); run `mrl bench` from a source checkout "
            "installed with `pip install -e .`.")
    names = available()
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        hint = "; the probe comparison is its own verb: `mrl bench probes`" if "probes" in unknown else ""
        raise ConfigError(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(names)}{hint}")
    results: dict[str, dict] = {}
    chosen = only or ([n for n in names if n in QUICK_LOOK] if quick else [n for n in names if n not in OWN_COMMAND])
    for name in sorted(set(names) - set(chosen)) if not only else ():
        results[name] = ({"skipped": f"its own run: `mrl bench --only {name}`"} if name in OWN_COMMAND
                         else {"skipped": "full run only: `mrl bench` without --quick, or --only " + name})
    # no background refresh of the live line while benchmarks time things: it updates between benchmarks only
    bar = Progress(len(chosen), title="bench", unit="benchmark", auto_refresh=False)
    for name in chosen:
        t0 = time.perf_counter()
        bar.start(name)
        try:
            figures = run_recorded(lambda: _load(name).run(quick=quick), wait_idle_s, idle_load)
        except Exception as e:  # one broken benchmark must not lose the others' figures
            figures = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
        figures["wall_s"] = round(time.perf_counter() - t0, 2)
        results[name] = figures
        bar.done(f"{figures.get('error', 'ok')} ({figures['wall_s']} s)")
    bar.close()
    contended = any(r.get("contended") for r in results.values())
    return {"quick": quick, "contended": contended, "environment": environment(), "benchmarks": results}

