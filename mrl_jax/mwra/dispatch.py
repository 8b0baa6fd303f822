"""Concurrent dispatch of per-policy jitted calls (JAX asynchronous dispatch)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax


def _unpack(item) -> tuple[Callable, tuple, dict]:
    if callable(item):
        return item, (), {}
    if not isinstance(item, (tuple, list)) or not item or not callable(item[0]) or len(item) > 3:
        raise ValueError("dispatch_all items are fn, (fn, args) or (fn, args, kwargs); got "
                         f"{type(item).__name__}")
    fn = item[0]
    args = tuple(item[1]) if len(item) > 1 else ()
    kwargs = dict(item[2]) if len(item) > 2 else {}
    return fn, args, kwargs


def dispatch_all(fns_and_args: Sequence[Any], *, block: bool = True) -> list:
    """Launch every call before waiting on any; return their outputs in order.

    Each item is ``fn``, ``(fn, args)`` or ``(fn, args, kwargs)``. A jitted ``fn`` returns as soon as its
    computation is enqueued on its devices, so calls whose inputs live on *disjoint* sub-meshes run at the same
    time; ``block=True`` then waits for all of them (``jax.block_until_ready``). Compile (or warm up) each
    function once before relying on this: a call that has to trace and compile blocks the host while it does.
    Do not read values (``float(x)``, ``np.asarray``) inside ``fn``: that blocks dispatch.
    """
    outs = []
    for item in fns_and_args:
        fn, args, kwargs = _unpack(item)
        outs.append(fn(*args, **kwargs))
    if block:
        outs = jax.block_until_ready(outs)
    return outs
