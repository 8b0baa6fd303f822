"""JAX's persistent compilation cache for ``mrl`` verbs: a later run loads compiled programs from disk.

Default directory: ``$XDG_CACHE_HOME/mrl_jax/jax_cache`` (``~/.cache/mrl_jax/jax_cache``). The environment
variable ``MRL_COMPILATION_CACHE`` overrides it: a directory, or ``0`` / ``off`` / ``false`` / ``no`` to
turn the cache off (as does ``mrl --no-compile-cache``). Every program is cached, however quick its
compile or small its entry (the sampler and update of tiny CPU policies compile in seconds, which is
what every ``mrl`` start pays again without the cache).

The cache is bounded (:data:`MAX_BYTES`, least recently used entries evicted; ``JAX_COMPILATION_CACHE_MAX_SIZE``
sets another bound), and a bound makes JAX take a file lock around each entry it reads or writes: processes that
share the directory (``mrl bench probes --jobs``, the processes of a run on one host, two runs at once) never load
an entry another one is still writing. Unbounded, JAX writes entries in place, unlocked, and a process can load a
half-written one: a worker of this project's test suite segfaulted in ``deserialize_executable`` that way.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "MAX_BYTES", "resolve_dir", "enable"]

ENV_VAR = "MRL_COMPILATION_CACHE"
MAX_BYTES = 8 * 2 ** 30   # the cache's bound where the user set none
_OFF = {"0", "off", "false", "no", "none"}


def resolve_dir(env: dict | None = None) -> Path | None:
    """The cache directory to use, or None when turned off by ``MRL_COMPILATION_CACHE``."""
    env = os.environ if env is None else env
    value = env.get(ENV_VAR, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mrl_jax" / "jax_cache"


def enable(directory: str | os.PathLike | None = None, *, disabled: bool = False) -> Path | None:
    """Turn the persistent cache on (``directory`` or :func:`resolve_dir`); returns the directory or None.

    Call before the first ``jax.jit`` compile. A directory that cannot be created leaves the cache off.
    """
    path = None if disabled else (Path(directory) if directory is not None else resolve_dir())
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if jax.config.jax_compilation_cache_max_size < 0:   # unbounded (JAX's default): entries read unlocked
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
