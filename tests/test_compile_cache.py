"""mrl_jax.compile_cache: the persistent compilation cache `mrl` turns on (directory choice, off switch, entries)."""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl_jax import compile_cache

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import sys
from mrl_jax.compile_cache import enable
import jax, jax.numpy as jnp
print(enable(sys.argv[1]))
f = jax.jit(lambda x: jnp.sin(x) * 2 + jnp.cos(x))
print(float(f(jnp.arange(7.0)).sum()))
"""


def test_resolve_dir():
    assert compile_cache.resolve_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/mrl_jax/jax_cache")
    assert compile_cache.resolve_dir({"MRL_COMPILATION_CACHE": "/y/c"}) == Path("/y/c")
    for off in ("0", "off", "False"):
        assert compile_cache.resolve_dir({"MRL_COMPILATION_CACHE": off}) is None
    assert compile_cache.resolve_dir({}).parts[-2:] == ("mrl_jax", "jax_cache")


def test_disabled_is_none(tmp_path):
    assert compile_cache.enable(tmp_path / "c", disabled=True) is None
    assert not (tmp_path / "c").exists()


def test_cli_flag_parses():
    from mrl_jax.cli import _parser

    args = _parser().parse_args(["--no-compile-cache", "config-help"])
    assert args.no_compile_cache and args.verb == "config-help"


def _run(cache: Path) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cache)], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout


def test_two_processes_share_entries(tmp_path):
    cache = tmp_path / "jax_cache"
    first = _run(cache)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries, "the first process wrote no cache entry"
    second = _run(cache)
    assert first == second  # same result, loaded from the cache
    assert sorted(p.name for p in cache.iterdir()) == entries  # a hit: no new entry


def test_an_entry_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write cut short (here the rename failing; a process killed mid-write alike) leaves no entry a process
    sharing the directory could load half of, and no temporary file; a whole entry reads back."""
    from mrl_jax.compile_cache import AtomicFileCache

    cache = AtomicFileCache(str(tmp_path))
    cache.put("k", b"x" * 1000)
    assert cache.get("k") == b"x" * 1000

    def cut(src, dst):
        raise OSError("cut")
    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(OSError):
        cache.put("other", b"y" * 1000)
    assert cache.get("other") is None and sorted(p.name for p in tmp_path.iterdir()) == ["k-cache"]


def test_mrl_processes_write_through_the_atomic_cache(tmp_path):
    """`enable` makes JAX build its cache as AtomicFileCache (JAX's own where the user bounds it)."""
    check = PROGRAM + "from jax._src import compilation_cache as cc; print(type(cc._cache).__name__)\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    run = functools.partial(subprocess.run, [sys.executable, "-c", check, str(tmp_path / "c")], capture_output=True,
                            text=True, timeout=120, check=True)
    assert run(env=env).stdout.split()[-1] == "AtomicFileCache"
    assert run(env={**env, "JAX_COMPILATION_CACHE_MAX_SIZE": str(2 ** 30)}).stdout.split()[-1] == "LRUCache"


def test_compile_counter_counts_programs_not_calls():
    """Two shapes of one jitted function are two programs; calling again with a seen shape builds none;
    nothing is counted after the block."""
    import jax
    import jax.numpy as jnp

    from mrl_jax.trainer.compile_stats import CompileCounter

    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
    xs = [jnp.ones((n,), jnp.float32) for n in (3, 5, 7)]
    with CompileCounter() as counter:
        for i in (0, 1, 0, 1, 0):
            f(xs[i]).block_until_ready()
    f(xs[2]).block_until_ready()
    assert counter.summary()["programs"] == 2 and counter.seconds > 0
