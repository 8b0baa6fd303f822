"""The README's installs, rebuilt from this environment without the network: a virtual environment whose
site-packages holds exactly the distributions ``pip install -e .`` (or ``.[extra,...]``) would bring -- the
closure of ``pyproject.toml``'s dependencies (markers evaluated, requested extras followed) -- linked from the
running environment, their metadata included, and the project's ``mrl_jax`` package with its ``mrl`` script, as
an editable install exposes them. What the test extra alone brings (torch, pytest, reasoning-gym, ...) is absent,
so a command that needs it fails there as on a user's plain install.

    venv = readme_install(tmp_path / "venv", clone)            # the README's `pip install -e .`
    subprocess.run([venv / "bin" / "mrl", "demo", "--quick", ...], cwd=clone)
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

__all__ = ["FreshClone", "clean_clone", "dependency_closure", "readme_install"]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wanted(req: Requirement, extras: frozenset) -> bool:
    """Whether ``req`` applies here when its distribution was asked for with ``extras``."""
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def dependency_closure(pyproject: Path, extras: tuple[str, ...] = ()) -> dict[str, metadata.Distribution]:
    """{canonical name: installed distribution} of every distribution ``pip install -e .[extras]`` of
    ``pyproject`` brings. Raises LookupError naming a required distribution this environment lacks."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in extras:
        reqs += [Requirement(r) for r in project.get("optional-dependencies", {})[extra]]
    todo = [(r, frozenset()) for r in reqs if _wanted(r, frozenset())]
    found: dict[str, metadata.Distribution] = {}
    asked: dict[str, frozenset] = {}
    while todo:
        req, _ = todo.pop()
        name, wanted = _canonical(req.name), frozenset(req.extras)
        if name in asked and wanted <= asked[name]:
            continue
        asked[name] = asked.get(name, frozenset()) | wanted
        try:
            dist = found.get(name) or metadata.distribution(name)
        except metadata.PackageNotFoundError as e:
            raise LookupError(f"{req.name} (required by {pyproject}) is not installed here") from e
        found[name] = dist
        for sub in dist.requires or []:
            r = Requirement(sub)
            if _wanted(r, asked[name]):
                todo.append((r, asked[name]))
    return found


# what setuptools' editable install leaves: a finder that maps the package (only it) to the checkout
_EDITABLE = """import sys
from importlib.util import spec_from_file_location


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "mrl_jax":
            return spec_from_file_location(fullname, "{package}/__init__.py", submodule_search_locations=["{package}"])
        return None


sys.meta_path.append(_Finder)
"""


def readme_install(where: Path, project: Path, extras: tuple[str, ...] = ()) -> Path:
    """A virtual environment at ``where`` as ``pip install -e project[extras]`` leaves it: the
    :func:`dependency_closure` linked from this environment's site-packages, ``project/mrl_jax`` importable from
    the checkout (not the project's other folders) and ``bin/mrl``. Returns ``where``."""
    where, project = Path(where), Path(project).resolve()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    source = Path(sysconfig.get_paths()["purelib"]).resolve()
    for dist in dependency_closure(project / "pyproject.toml", extras).values():
        base = Path(dist.locate_file("")).resolve()
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}:
            src, dst = base / top, target / top
            if src.exists() and not dst.exists() and src.is_relative_to(source):
                os.symlink(src, dst)
    (target / "_mrl_jax_editable.py").write_text(_EDITABLE.format(package=project / "mrl_jax"))
    (target / "_mrl_jax_editable.pth").write_text("import _mrl_jax_editable\n")
    script = where / "bin" / "mrl"
    script.write_text(f"#!{python}\nimport sys\nfrom mrl_jax.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return where


def clean_clone(source: Path, where: Path) -> Path:
    """The files a clone of ``source`` would hold (tracked, plus untracked ones git does not ignore: the work in
    progress) copied to ``where``; nothing ignored (no .venv, runs/, caches) and no ``../shared`` beside it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = Path(source) / rel
        if src.is_file():
            (Path(where) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, Path(where) / rel)
    return Path(where)


@dataclasses.dataclass
class FreshClone:
    """A clean clone (``root``) with no ``../shared`` beside it and the README's installs of it, built lazily:
    ``venv(())`` = ``pip install -e .``, ``venv(("reasoning",))`` = ``pip install -e '.[reasoning]'``. The commands
    it runs share one compilation cache (as a user's ``mrl`` runs share ``~/.cache/mrl_jax``): ``cache``, by default
    ``scratch/jax_cache`` (the suite passes its own run's cache, tests/support.py ``compile_cache_dir``, so a
    command loads the programs another test's process compiled; entries are written whole,
    `mrl_jax.compile_cache.AtomicFileCache`, so processes may share it)."""

    root: Path
    scratch: Path
    cache: Path | None = None
    _venvs: dict = dataclasses.field(default_factory=dict)

    def venv(self, extras: tuple[str, ...] = ()) -> Path:
        if extras not in self._venvs:
            self._venvs[extras] = readme_install(self.scratch / ("venv-" + "-".join(("plain",) + extras)),
                                                 self.root, extras)
        return self._venvs[extras]

    def run(self, command: str, *, extras: tuple[str, ...] = (), timeout: float = 900) -> subprocess.CompletedProcess:
        """``command`` as written in the docs (``mrl ...`` / ``python ...``), in the clone's root, with the venv's
        ``bin`` first on PATH and nothing of this environment's Python path."""
        venv = self.venv(extras)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
                   MRL_COMPILATION_CACHE=str(self.cache or self.scratch / "jax_cache"),
                   MRL_SHARED_TOKENIZERS=str(self.root.parent / "shared" / "tokenizers"))
        return subprocess.run(["bash", "-c", command], cwd=self.root, env=env, capture_output=True, text=True,
                              timeout=timeout)
