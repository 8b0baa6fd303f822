"""How many XLA programs a run builds, and how long that takes (``jax.monitoring`` listeners).

    with CompileCounter() as compiles:
        ...                      # a run, a benchmark
    compiles.summary()           # {"programs": 7, "seconds": 12.4, "cache_hits": 5}

``programs`` counts every backend compile request, a load from the persistent compilation cache included
(``cache_hits`` of them; see ``mrl_jax.compile_cache``); ``seconds`` is their wall time (compile or load).
A run whose shapes are bucketed builds a handful of programs; a count that grows with the rounds is a
recompile to find.
"""
from __future__ import annotations

from jax import monitoring

__all__ = ["CompileCounter"]

_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts backend compiles (and persistent-cache hits) between ``__enter__`` and ``__exit__``."""

    def __init__(self):
        self.programs, self.seconds, self.cache_hits = 0, 0.0, 0

    def _on_duration(self, event: str, duration: float, **_) -> None:
        if event == _COMPILE:
            self.programs += 1
            self.seconds += float(duration)

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            self.cache_hits += 1

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)

    def summary(self) -> dict:
        return {"programs": self.programs, "seconds": round(self.seconds, 3), "cache_hits": self.cache_hits}
