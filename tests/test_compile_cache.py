"""mrl_jax.compile_cache: the persistent compilation cache `mrl` turns on (directory choice, off switch, entries)."""
import os
import subprocess
import sys
from pathlib import Path

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


def _run(cache: Path, **env_vars) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), **env_vars}
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


def test_entries_are_read_and_written_under_a_lock_within_a_bound(tmp_path):
    """A bounded cache: JAX locks each read and write (a process sharing the directory never loads a half-written
    entry) and keeps an access time per entry for its eviction; the user's own bound wins over ours."""
    cache = tmp_path / "jax_cache"
    _run(cache)
    entries = [p.name[:-len("-cache")] for p in cache.iterdir() if p.name.endswith("-cache")]
    assert entries and (cache / ".lockfile").exists()
    assert all((cache / f"{e}-atime").is_file() for e in entries)

    small = tmp_path / "small"
    _run(small, JAX_COMPILATION_CACHE_MAX_SIZE="100")   # smaller than any entry: none is kept
    assert not [p for p in small.iterdir() if p.name.endswith("-cache")]


def test_compile_counter_counts_programs_not_calls():
    """Two shapes of one jitted function are two programs; calling again with a seen shape builds none;
    nothing is counted after the block."""
    import jax
    import jax.numpy as jnp

    from mrl_jax.compile_stats import CompileCounter

    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
    xs = [jnp.ones((n,), jnp.float32) for n in (3, 5, 7)]
    with CompileCounter() as counter:
        for i in (0, 1, 0, 1, 0):
            f(xs[i]).block_until_ready()
    f(xs[2]).block_until_ready()
    assert counter.summary()["programs"] == 2 and counter.seconds > 0
