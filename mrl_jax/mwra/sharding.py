"""Sharding rules for one policy on its sub-mesh: parameters, optimizer state, batches, jitted steps.

Rules are written once as ``(path regex, spec)`` pairs matched with `re.search` against a parameter's path
string (``"layers/0/attn/q_proj/kernel"``: pytree keys joined by ``/``, the trailing ``value`` of an
`nnx.Variable` dropped); the first match wins. A spec is a `PartitionSpec` (validated: every sharded dim must
divide by its mesh axes), `REPLICATED`, or `FSDP`: shard the *largest* dimension divisible by the mesh size
over the data axes (ZeRO-3 / FSDP style: XLA all-gathers weights for the matmul and reduce-scatters grads).
Leaves with fewer than ``min_size`` elements are replicated whatever the rule says (norm scales, biases,
small matrices: sharding them costs more collectives than it saves memory).

All placements go through `put`, which works for a single process (``jax.device_put``) and for meshes that
span processes (``jax.make_array_from_callback`` from a host copy every process holds).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FSDP = "fsdp"  # sentinel spec: shard the largest dim divisible by the mesh size over the data axes
REPLICATED = PartitionSpec()
DEFAULT_MIN_SIZE = 1 << 16  # elements; smaller leaves are replicated

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    (r"(^|/)(bias|scale|b)$", REPLICATED),  # biases, norm scales
    (r"(norm|ln_\w+|layernorm)(/|$)", REPLICATED),  # any parameter of a norm module
    (r".*", FSDP),  # embeddings, kernels, heads
)


def path_str(path: Sequence[Any]) -> str:
    """``(DictKey('layers'), DictKey(0), DictKey('kernel'), GetAttrKey('value'))`` -> ``'layers/0/kernel'``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if len(parts) > 1 and parts[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        parts = parts[:-1]
    return "/".join(parts)


def data_axes(mesh: Mesh, axes: Sequence[str] | None = None) -> tuple[str, ...]:
    """The mesh axes that carry data/FSDP sharding (default: all of them)."""
    return tuple(mesh.axis_names) if axes is None else tuple(axes)


def _axes_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


def _fsdp_spec(shape: tuple[int, ...], mesh: Mesh, axes: tuple[str, ...]) -> PartitionSpec:
    size = _axes_size(mesh, axes)
    if size == 1 or not shape:
        return REPLICATED
    cands = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not cands:
        return REPLICATED
    d = max(cands, key=lambda k: (shape[k], -k))  # largest dim, ties to the earlier one
    entry = axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*([None] * d + [entry]))


def spec_for(path: str, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES, *,
             min_size: int = DEFAULT_MIN_SIZE, axes: Sequence[str] | None = None) -> PartitionSpec:
    """The `PartitionSpec` the rules give a leaf of this path and shape on ``mesh``."""
    axes = data_axes(mesh, axes)
    if int(np.prod(shape, dtype=np.int64)) < min_size:
        return REPLICATED
    for pattern, spec in rules:
        if re.search(pattern, path):
            break
    else:
        return REPLICATED
    if isinstance(spec, str):
        if spec != FSDP:
            raise ValueError(f"rule {pattern!r}: unknown spec {spec!r}; use FSDP, REPLICATED or a PartitionSpec")
        return _fsdp_spec(tuple(shape), mesh, axes)
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"rule {pattern!r}: spec must be FSDP, REPLICATED or a PartitionSpec, got {spec!r}")
    if len(spec) > len(shape):
        raise ValueError(f"rule {pattern!r} gives {spec} to '{path}' of rank {len(shape)}: fix the rule's rank")
    for dim, entry in enumerate(spec):
        n = _axes_size(mesh, entry)
        if shape[dim] % n:
            raise ValueError(f"rule {pattern!r} shards dim {dim} (size {shape[dim]}) of '{path}' over {entry} "
                             f"({n} devices): not divisible; change the rule or the mesh size")
    return spec


def param_shardings(params_state, mesh: Mesh, rules=DEFAULT_RULES, *, min_size: int = DEFAULT_MIN_SIZE,
                    axes: Sequence[str] | None = None):
    """A pytree of `NamedSharding` mirroring ``params_state`` (any pytree of arrays, e.g. an ``nnx.State``)."""
    def one(path, leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, spec_for(path_str(path), shape, mesh, rules, min_size=min_size, axes=axes))

    return jax.tree_util.tree_map_with_path(one, params_state)


def _put_leaf(x, sharding: NamedSharding):
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # global -> global reshard (same processes)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):   # typed PRNG key
        return jax.random.wrap_key_data(_put_leaf(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx], dtype=host.dtype)


def put(tree, shardings):
    """Place every leaf of ``tree`` with the matching sharding (a pytree prefix or one sharding for all).

    Single process: ``jax.device_put`` (device-to-device copies when the leaf lives on another mesh).
    Mesh spanning processes: built from the host value each process holds (every process must pass the
    same value, e.g. parameters initialised from the same seed).
    """
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: _put_leaf(x, shardings), tree)
    return jax.tree.map(lambda s, x: jax.tree.map(lambda y: _put_leaf(y, s), x), shardings, tree,
                        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def opt_state_shardings(opt_state, params_shardings, mesh: Mesh):
    """Shardings for an optax state: leaves that mirror a parameter (same path suffix and shape, e.g. AdamW
    ``mu``/``nu``) take that parameter's sharding; everything else (step counts, scalars) is replicated."""
    table: dict[tuple[str, ...], list] = {}
    for path, s in jax.tree_util.tree_flatten_with_path(
            params_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]:
        table.setdefault(tuple(path_str(path).split("/")), []).append(s)
    max_len = max((len(k) for k in table), default=0)
    replicated = NamedSharding(mesh, REPLICATED)

    def one(path, leaf):
        parts = tuple(path_str(path).split("/"))
        shape = tuple(getattr(leaf, "shape", ()))
        for n in range(min(len(parts), max_len), 0, -1):  # longest matching suffix first
            for s in table.get(parts[-n:], ()):
                if len(s.spec) <= len(shape) and all(
                        e is None or shape[d] % _axes_size(s.mesh, e) == 0 for d, e in enumerate(s.spec)):
                    return NamedSharding(mesh, s.spec)
        return replicated

    return jax.tree_util.tree_map_with_path(one, opt_state)


def row_sharding(mesh: Mesh, axes: Sequence[str] | None = None) -> NamedSharding:
    """Rows (dim 0) split over the data axes; the other dims unsharded."""
    axes = data_axes(mesh, axes)
    return NamedSharding(mesh, PartitionSpec(axes[0] if len(axes) == 1 else axes))


def row_shardings(tree, mesh: Mesh, axes: Sequence[str] | None = None, *, strict: bool = True):
    """Per-leaf shardings for a pytree of rows (dim 0): row-sharded leaves, scalars replicated.

    ``strict``: a leaf whose row count does not divide by the mesh size raises (pad rows to a multiple);
    otherwise it is replicated.
    """
    n = _axes_size(mesh, data_axes(mesh, axes))
    bs = None

    def one(path, x):
        shape = tuple(np.shape(x))
        if not shape:
            return NamedSharding(mesh, REPLICATED)
        if shape[0] % n:
            if strict:
                raise ValueError(f"leaf '{path_str(path)}' has {shape[0]} rows, not divisible by the "
                                 f"mesh's {n} devices: pad the rows to a multiple of {n} (masked)")
            return NamedSharding(mesh, REPLICATED)
        nonlocal bs
        bs = bs or row_sharding(mesh, axes)
        return bs

    return jax.tree_util.tree_map_with_path(one, tree)


def shard_rows(tree, mesh: Mesh, axes: Sequence[str] | None = None, *, strict: bool = True):
    """Place a pytree of rows (host numpy or arrays on any mesh) on ``mesh``, rows split over the data axes."""
    return put(tree, row_shardings(tree, mesh, axes, strict=strict))


def to_mesh(tree, mesh: Mesh, *, via_host: bool = False):
    """Move experience (any pytree) to ``mesh``: row-sharded where rows divide, replicated otherwise.

    ``via_host=True`` copies through host numpy first (what crossing processes needs); otherwise an explicit
    device-to-device ``jax.device_put``.
    """
    if via_host:
        tree = jax.tree.map(np.asarray, jax.device_get(tree))
    return put(tree, row_shardings(tree, mesh, strict=False))


def devices_of(tree) -> set[int]:
    """Ids of every device holding a shard of any array leaf of ``tree`` (for placement checks)."""
    out: set[int] = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            out |= {d.id for d in x.sharding.device_set}
    return out
