"""The slot sampler's KV cache and its decode step's attention (`mrl_jax.rollout_slots`).

S decode slots, each holding one row's sequence from position 0: entry e of a slot holds the key / value of the
token at position e of the row it decodes (its prompt, left-aligned, then its generated tokens). A decode step
writes its token at entry ``qpos`` (its position) and attends over entries [0, qpos] (and the sliding window):
a length per slot, no per-entry mask to keep. Two layouts of the same entries, per layer:

* ``heads`` (CPU, GPU): keys [S, K, D, C], values [S, K, C, D]; heads-major, keys slot-minor, so the step's two
  matmuls read the cache in place (as :class:`mrl_jax.models.SampleCache`).
* ``pages`` (TPU): keys and values [K, S * C / PAGE, PAGE, D], slot s owning pages [s * C / PAGE, (s + 1) * C /
  PAGE): the layout of JAX's Pallas TPU paged attention kernel (``jax.experimental.pallas.ops.tpu.
  paged_attention``), which the step runs on TPU for a layer without a sliding window whose head dim is a multiple
  of 128 (the kernel's lane width; 64- and 96-wide heads do not lower); the other layers, and every platform but
  TPU, run the pure-JAX step over the same pages.

The page table is the identity: a row's prompt is copied into its slot's pages when it enters (`load`), so each
slot holds C = Tc + N - 1 entries (Tc the prompt width, N the new tokens). Sharing each prompt's full pages among
its G slots would save Tc / C of the cache (20 % at 1024 + 4096) at the cost of a gathered read on the
pure-JAX path; not done.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

PAGE = 16          # tokens per page of the ``pages`` layout
KERNEL_LANES = 128   # the paged kernel lowers for head dims that are multiples of this
_NEG = -1e30


@struct.dataclass
class SlotMask:
    """A decode step's mask over a SlotCache: visible bool[S, C] (entry e of slot s is seen: e <= qpos[s], and
    e > qpos[s] - window); window: the layer's sliding window (static; None: none)."""

    visible: jax.Array
    window: Optional[int] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class SlotCache:
    """S slots x C entries per layer: k, v tuples of L arrays (layout: see the module docstring); qpos int32[S]
    the position, hence the entry, of the token each slot feeds at this step; paged: the ``pages`` layout."""

    k: tuple
    v: tuple
    qpos: jax.Array
    paged: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def zeros(cls, slots: int, layers: int, kv_heads: int, head_dim: int, length: int, dtype,
              paged: bool = False) -> "SlotCache":
        """An empty cache of at least ``length`` entries per slot (``pages``: rounded up to a whole page)."""
        if paged:
            n = -(-length // PAGE)
            k = v = jnp.zeros((kv_heads, slots * n, PAGE, head_dim), dtype)
        else:
            k = jnp.zeros((slots, kv_heads, head_dim, length), dtype)
            v = jnp.zeros((slots, kv_heads, length, head_dim), dtype)
        return cls(k=(k,) * layers, v=(v,) * layers, qpos=jnp.zeros((slots,), jnp.int32), paged=paged)

    @property
    def slots(self) -> int:
        return self.qpos.shape[0]

    @property
    def length(self) -> int:
        """C, entries per slot."""
        return self.k[0].shape[1] * PAGE // self.slots if self.paged else self.k[0].shape[3]

    def _slot_major(self, x):
        """A pages-layout array as [K, S, C, D] (a view: each slot owns consecutive pages)."""
        return x.reshape(x.shape[0], self.slots, self.length, x.shape[-1])

    def _pages(self, x):
        return x.reshape(x.shape[0], -1, PAGE, x.shape[-1])

    def step_masks(self, gen_index=None, window: Optional[int] = None) -> SlotMask:
        """The step's :class:`SlotMask` (``gen_index`` unused: each slot's step is its ``qpos``)."""
        e = jnp.arange(self.length, dtype=jnp.int32)[None, :]
        q = self.qpos[:, None]
        seen = e <= q
        if window is not None:
            seen = seen & (e > q - window)
        return SlotMask(visible=seen, window=window)

    def load(self, slots: jax.Array, keys: tuple, values: tuple) -> "SlotCache":
        """Rows entering ``slots`` (int32[a]; S drops the row): per layer their prompts' keys [a, K, D, T] and
        values [a, K, T, D] into entries [0, T)."""
        t = keys[0].shape[-1]
        if self.paged:
            def put(x, new):   # new [a, K, T, D]
                return self._pages(self._slot_major(x).at[:, slots, :t].set(new.transpose(1, 0, 2, 3), mode="drop"))
            return self.replace(k=tuple(put(x, n.swapaxes(2, 3)) for x, n in zip(self.k, keys)),
                                v=tuple(put(x, n) for x, n in zip(self.v, values)))
        return self.replace(k=tuple(x.at[slots, :, :, :t].set(n, mode="drop") for x, n in zip(self.k, keys)),
                            v=tuple(x.at[slots, :, :t].set(n, mode="drop") for x, n in zip(self.v, values)))

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> "SlotCache":
        """The step's keys / values [S, 1, K, D] at entry ``qpos`` of every slot, in layer ``layer``."""
        k, v = k[:, 0].astype(self.k[layer].dtype), v[:, 0].astype(self.v[layer].dtype)   # [S, K, D]

        # one slot's entry, vmapped over the slots: a scatter batched over the slot dim, which a mesh splitting the
        # slots updates in place (an index scatter all-gathers the step's keys and positions, twice per layer)
        def put(axis, slot_axis=0):
            def one(x, new, pos):
                return jax.lax.dynamic_update_slice_in_dim(x, jnp.expand_dims(new, axis), pos, axis)
            return jax.vmap(one, in_axes=(slot_axis, 0, 0), out_axes=slot_axis)

        if self.paged:   # slot-major view [K, S, C, D]: one slot's [K, C, D], the entry on axis 1
            nk = self._pages(put(1, 1)(self._slot_major(self.k[layer]), k, self.qpos))
            nv = self._pages(put(1, 1)(self._slot_major(self.v[layer]), v, self.qpos))
        else:            # one slot's keys [K, D, C] (entry on axis 2), values [K, C, D] (axis 1)
            nk = put(2)(self.k[layer], k, self.qpos)
            nv = put(1)(self.v[layer], v, self.qpos)
        return self.replace(k=_set(self.k, layer, nk), v=_set(self.v, layer, nv))

    def constrain(self, rows: Optional[NamedSharding]) -> "SlotCache":
        """The slots split as ``rows`` (a sharding of dim 0) splits rows; None: unchanged."""
        if rows is None:
            return self
        c = jax.lax.with_sharding_constraint
        pages = NamedSharding(rows.mesh, PartitionSpec(None, rows.spec[0]))
        kv = pages if self.paged else rows
        return self.replace(k=tuple(c(x, kv) for x in self.k), v=tuple(c(x, kv) for x in self.v),
                            qpos=c(self.qpos, rows))


def attend_slots(q, k, v, mask: SlotMask, scale: float, cache: SlotCache, layer: int,
                 softcap: Optional[float] = None, impl: str = "auto"):
    """One decode step over a SlotCache: q [S, 1, H, D]; k, v [S, 1, K, D] written at each slot's entry ``qpos``
    first. ``impl`` "splash" (the model's TPU choice) runs the paged kernel where it applies (module docstring).
    Float32 scores and softmax. Returns ([S, 1, H, D] in q.dtype, cache)."""
    cache = cache.write(layer, k, v)
    S, _, H, D = q.shape
    K = k.shape[2]
    if not cache.paged:
        return _attend(q.reshape(S, K, H // K, D), cache.k[layer], cache.v[layer], mask.visible, scale,
                       softcap, "skqd,skdc->skqc", "skqc,skcd->skqd").reshape(S, 1, H, D), cache
    ks, vs = cache._slot_major(cache.k[layer]), cache._slot_major(cache.v[layer])   # [K, S, C, D]

    def pure(q, ks, vs, visible, qpos):
        del qpos
        return _attend(q.reshape(S, K, H // K, D), ks, vs, visible, scale, softcap, "skqd,kscd->skqc",
                       "skqc,kscd->skqd").reshape(S, 1, H, D)

    if impl != "splash" or mask.window is not None or D % KERNEL_LANES:
        return pure(q, ks, vs, mask.visible, cache.qpos), cache

    def kernel(q, ks, vs, visible, qpos):
        return _paged_kernel(q, ks, vs, qpos + 1, scale, softcap)

    out = jax.lax.platform_dependent(q, ks, vs, mask.visible, cache.qpos, tpu=kernel, default=pure)
    return out, cache


def _attend(q, ks, vs, visible, scale, softcap, qk: str, pv: str):
    """Scores (``qk`` einsum of q [S, K, g, D] and the keys), masked by ``visible`` bool[S, C], one float32
    softmax, ``pv`` einsum with the values -> [S, K, g, D] in q.dtype."""
    s = jnp.einsum(qk, q, ks.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = s + jnp.where(visible, 0.0, _NEG)[:, None, None, :]
    e = jnp.exp(s - s.max(-1, keepdims=True))
    o = jnp.einsum(pv, e.astype(q.dtype), vs.astype(q.dtype), preferred_element_type=jnp.float32)
    return (o / e.sum(-1, keepdims=True)).astype(q.dtype)


def _paged_kernel(q, ks, vs, lengths, scale, softcap):
    """JAX's Pallas TPU paged attention over slot-major pages ks, vs [K, S, C, D] (each slot its own pages),
    lengths int32[S]; q [S, 1, H, D] (scaled here: the kernel does not scale). On a mesh (`splash.on_mesh`), under
    ``shard_map`` with the slots split as the rows are."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    from . import splash

    def local(q, ks, vs, lengths):
        S, _, H, D = q.shape
        n = ks.shape[2] // PAGE
        table = jnp.arange(S * n, dtype=jnp.int32).reshape(S, n)
        pages = tuple(x.reshape(x.shape[0], S * n, PAGE, D) for x in (ks, vs))
        qs = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
        out = paged_attention(qs, *pages, lengths, table, attn_logits_soft_cap=softcap,
                              pages_per_compute_block=_block(n))
        return out[:, None].astype(q.dtype)

    mesh = splash.current_mesh()
    if mesh is None or mesh.devices.size == 1 or q.shape[0] % mesh.devices.size:
        return local(q, ks, vs, lengths)
    lead = tuple(mesh.axis_names)
    rows, kv = PartitionSpec(lead), PartitionSpec(None, lead)
    return jax.shard_map(local, mesh=mesh, in_specs=(rows, kv, kv, rows), out_specs=rows,
                         check_vma=False)(q, ks, vs, lengths)


def _block(pages: int) -> int:
    """Pages per compute block of the kernel: the largest of 8, 4, 2, 1 dividing a slot's pages."""
    return next(b for b in (8, 4, 2, 1) if pages % b == 0)


def _set(xs: tuple, i: int, x) -> tuple:
    return xs[:i] + (x,) + xs[i + 1:]
