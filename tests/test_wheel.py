"""The user verbs work from an installed wheel, not only from a source checkout: ``mrl bench probes`` from a
non-editable install of the built wheel, run outside any checkout."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import support
from installs import clean_clone

REPO = Path(__file__).resolve().parents[1]


def _pip(*args: str, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-index", "--disable-pip-version-check", "-q"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A folder holding only what ``pip install --target`` put there from the wheel of this checkout (built from a
    clean copy of it, so the build leaves nothing in the checkout)."""
    base = tmp_path_factory.mktemp("wheel")
    source = clean_clone(REPO, base / "source")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(base / "dist"), str(source), cwd=base)
    (wheel,) = (base / "dist").glob("mrl_jax-*.whl")
    _pip("install", "--no-deps", "--target", str(base / "site"), str(wheel), cwd=base)
    return base / "site"


def _env(site: Path) -> dict:
    """The install alone on the Python path; the run's compilation cache (`support.compile_cache_env`: the
    programs of test_bench_probes' quick comparison, whose facts cells these are, load from it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return {**env, **support.compile_cache_env(), "PYTHONPATH": str(site)}


BUILD_WORKLOADS = """
import mrl_jax
from mrl_jax.bench.probe_workloads import WORKLOADS
for w in WORKLOADS.values():
    s = w.settings(True)
    w.config("none", s, 0, len(w.task(s).eval_prompts()))
print(mrl_jax.__file__)
"""


def test_the_wheel_holds_the_package_and_no_checkout_folder(installed, tmp_path):
    """Imported outside any checkout, the package comes from the install, and every task of ``mrl bench probes``
    builds its task and run config there."""
    where = subprocess.run([sys.executable, "-c", BUILD_WORKLOADS], cwd=tmp_path, env=_env(installed),
                           capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout
    assert not any((installed / d).exists() for d in ("benchmarks", "tests", "experiments"))


@pytest.mark.slow
def test_bench_probes_quick_runs_from_the_installed_wheel(installed, tmp_path):
    """``python -m mrl_jax.cli bench probes --quick`` (the baseline probe on the facts task, and the bandit plane;
    the other task's pieces are built above) from a folder outside any checkout, the package imported from the
    wheel's install: exit 0 and its summary."""
    out, cwd = tmp_path / "out", tmp_path / "elsewhere"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "mrl_jax.cli", "bench", "probes", "--quick", "--probes", "none",
                           "--tasks", "facts", "--out", str(out)], cwd=cwd, env=_env(installed), capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith(f"wrote {out / 'summary.json'}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["out"] == str(out) and list(summary["tasks"]) == ["facts"]
    none = summary["tasks"]["facts"]["none"]
    assert none["average_reward_at_1"]["n"] == 1 and math.isfinite(none["average_reward_at_1"]["mean"])
    assert none["vs_none"] is None and none["bandit_support"] == 0.0
    for f in ("PROBES.md", "probes.json", "facts_reward_at_1.png", "facts_skills.png", "bandit/summary.json"):
        assert (out / f).is_file(), f
