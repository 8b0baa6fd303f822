"""JAX's persistent compilation cache for ``mrl`` verbs: a later run loads compiled programs from disk.

Default directory: ``$XDG_CACHE_HOME/mrl_jax/jax_cache`` (``~/.cache/mrl_jax/jax_cache``). The environment
variable ``MRL_COMPILATION_CACHE`` overrides it: a directory, or ``0`` / ``off`` / ``false`` / ``no`` to
turn the cache off (as does ``mrl --no-compile-cache``). Every program is cached, however quick its
compile or small its entry (the sampler and update of tiny CPU policies compile in seconds, which is
what every ``mrl`` start pays again without the cache).

Processes may share the directory (``mrl bench probes --jobs``, the processes of a run on one host, two runs at
once): :class:`AtomicFileCache` writes each entry to a temporary file and renames it into place, so a process reads
a whole entry or none. JAX's own file cache writes entries in place, unlocked (a process can load a half-written
one: a worker of this project's test suite segfaulted in ``deserialize_executable`` that way), or, bounded
(``JAX_COMPILATION_CACHE_MAX_SIZE``), under a lock, reading every entry's access time at each write (0.15 s a
write with 3,000 entries at load 3.6: contended, for scale); with a bound set, JAX's bounded cache is used.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

try:   # the file cache JAX builds its persistent cache with (no public hook)
    from jax._src import compilation_cache as _jax_cache
    from jax._src.lru_cache import LRUCache
except ImportError:   # moved in a later JAX: `enable` bounds JAX's cache instead (locked)
    _jax_cache, LRUCache = None, object

__all__ = ["ENV_VAR", "AtomicFileCache", "resolve_dir", "enable"]

ENV_VAR = "MRL_COMPILATION_CACHE"
BOUND = 8 * 2 ** 30   # JAX's bounded cache, where its file cache cannot be replaced
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
    if _jax_cache is not None and hasattr(_jax_cache, "get_file_cache"):
        _jax_cache.get_file_cache = _file_cache
    elif jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", BOUND)
    return path


class AtomicFileCache(LRUCache):
    """JAX's unbounded file cache whose entries appear whole: each written to a temporary file in the directory and
    renamed into place (atomic on POSIX), so a process sharing the directory reads a whole entry or none; no lock,
    no scan of the directory per entry."""

    def __init__(self, path: str):
        super().__init__(path, max_size=-1)

    def put(self, key: str, value: bytes) -> None:
        if not key:
            raise ValueError("key cannot be empty")
        entry = self.path / f"{key}-cache"
        if entry.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".entry-", suffix=".tmp")   # a key may be near NAME_MAX
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_jax_file_cache = getattr(_jax_cache, "get_file_cache", None)


def _file_cache(path: str):
    """What JAX builds its persistent cache with: :class:`AtomicFileCache`, or JAX's own where a bound is set."""
    import jax

    if (jax.config.jax_compilation_cache_max_size != -1
            or getattr(jax.config, "jax_compilation_cache_check_contents", False)):
        return _jax_file_cache(path)
    return AtomicFileCache(path), path
