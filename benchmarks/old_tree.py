"""Import the package as it was at a git revision, beside today's, for in-process A/Bs of whole code paths.

    old = import_old_package("HEAD~1")          # mrl_jax at HEAD~1, importable as ``mrl_jax_old``
    old_rollout = importlib.import_module("mrl_jax_old.rollout")

The old tree is extracted with ``git archive`` into a temporary folder and every ``mrl_jax`` in its sources is
renamed, so both versions run in one process, each with its own jit caches (a module-level jit caches by
function identity). Use it when a change spans modules (a cache layout and its kernels); single-file swaps
(``ab_attention --old``) patch less.
"""
from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_old_package(rev: str, name: str = "mrl_jax_old"):
    """``mrl_jax`` at git revision ``rev`` imported as ``name`` (a module); raises if ``rev`` is unknown."""
    if name in sys.modules:
        raise RuntimeError(f"{name} is already imported; one old tree per process")
    proc = subprocess.run(["git", "-C", str(REPO), "archive", rev, "mrl_jax"], capture_output=True)
    if proc.returncode != 0:
        raise ValueError(f"git archive {rev!r} failed: {proc.stderr.decode().strip()}")
    dest = Path(tempfile.mkdtemp(prefix="mrl_old_tree_"))
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(dest)
    (dest / "mrl_jax").rename(dest / name)
    for f in (dest / name).rglob("*.py"):
        f.write_text(re.sub(r"\bmrl_jax\b", name, f.read_text(encoding="utf-8")), encoding="utf-8")
    sys.path.insert(0, str(dest))
    return importlib.import_module(name)
