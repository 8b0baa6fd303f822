"""The slot sampler's KV cache and its decode step's attention (`mrl_jax.rollout_slots`).

S decode slots, each holding one row's sequence from position 0: entry e of a slot holds the key / value of the
token at position e of the row it decodes (its prompt, left-aligned, then its generated tokens). A decode step
writes its token at entry ``qpos`` (its position) and attends over entries [0, qpos] (and the sliding window):
a length per slot, no per-entry mask to keep. Two layouts of the same entries, per layer:

* ``heads`` (CPU, GPU): keys [S, K, D, w], values [S, K, w, D] in parts of w entries, the entries cut at
  :func:`spans` ``(C)`` (C / 4, C / 2, C, or doubling from 64 when C is short); heads-major, keys slot-minor, so
  the step's two matmuls read the
  cache in place (as :class:`mrl_jax.models.SampleCache`). A step reads only the parts up to the first span past
  every slot's qpos (a ``lax.switch`` over the spans, one program): a round whose slots hold short rows reads
  short spans, as the static sampler's length buckets do, without copying a slice of the cache (XLA:CPU copies a
  sliced operand before a matmul: a slice per step cost more than the entries it saved).
* ``pages`` (TPU): keys and values [K, S * C / PAGE, PAGE, D], slot s owning pages [s * C / PAGE, (s + 1) * C /
  PAGE): the layout of JAX's Pallas TPU paged attention kernel (``jax.experimental.pallas.ops.tpu.
  paged_attention``), which the step runs on TPU for a layer without a sliding window whose head dim is a multiple
  of 128 (the kernel's lane width; 64- and 96-wide heads do not lower); the other layers, and every platform but
  TPU, run the pure-JAX step over the same pages.

The page table is the identity: a row's prompt is copied into its slot's pages when it enters (`load`), so each
slot holds C = Tc + N - 1 entries (Tc the prompt width, N the new tokens).

**Shared prompts** (``group`` G > 0, the ``heads`` layout with a slot per row: slot s decodes row s, the G rows of
prompt p in slots [p * G, (p + 1) * G)): a slot holds its generated entries only (entry e: position plen + e,
plen its prompt's length), and a step reads each prompt's entries once for its G slots from the prompt store
(keys [P, K, D, Tc], values [P, K, Tc, D], left-aligned; ``pk`` / ``pv`` / ``plen``, attached for the step by
the sampler): the static sampler's block-merged softmax (:func:`mrl_jax.models.attention._attend_shared`), the
generated block read in parts as above. :meth:`SlotCache.take` moves such slots into an unshared cache (their
prompt's entries copied in), as the ladder's rungs below the first hold.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

PAGE = 16          # tokens per page of the ``pages`` layout
KERNEL_LANES = 128   # the paged kernel lowers for head dims that are multiples of this
SPAN = 64          # the ``heads`` layout's first part, by default (:func:`spans`)
PARTS = 3          # the ``heads`` layout's parts at most: its decode program grows with their square
_NEG = -1e30


def spans(length: int, smallest: int = SPAN) -> tuple[int, ...]:
    """Where the ``heads`` layout cuts a slot's ``length`` entries into at most :data:`PARTS` parts: doubling from
    ``smallest`` or from ``length / 2 ** (PARTS - 1)``, the larger, the last one ``length`` (136, 272, 543 for 543
    entries from 64; 10, 20, 40 for 40 from 8). A step reads at most twice the entries its slots reach, or the
    first part; the decode program holds PARTS * (PARTS + 1) / 2 matmul pairs per layer (a switch branch per
    span)."""
    out, w = [], max(int(smallest), -(-int(length) // 2 ** (PARTS - 1)))
    while w < length:
        out.append(w)
        w *= 2
    return tuple(out) + (int(length),)


@struct.dataclass
class SlotMask:
    """A decode step's mask over a SlotCache: visible bool[S, C] (entry e of slot s is seen: its position at most
    qpos[s] and above qpos[s] - window); span int32: how many of the cache's parts the step reads, less one (the
    first part end past every slot's entry); prompt: bool[S, Tc], the prompt store's entries each slot sees (shared
    prompts; None otherwise); window: the layer's sliding window (static; None: none)."""

    visible: jax.Array
    span: jax.Array
    prompt: Optional[jax.Array] = None
    window: Optional[int] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class SlotCache:
    """S slots x C entries per layer: k, v tuples of L layers, each (``heads``) a tuple of parts or (``pages``) one
    array (layouts: see the module docstring); qpos int32[S] the position of the token each slot feeds at this
    step (its entry: :attr:`entry`); paged: the ``pages`` layout; group: G > 0 where the slots share their
    prompts' entries (module docstring; then pk, pv: L x the prompt store's keys [P, K, D, Tc] / values
    [P, K, Tc, D], plen int32[P], attached for a step or a move, else () / None)."""

    k: tuple
    v: tuple
    qpos: jax.Array
    pk: tuple = ()
    pv: tuple = ()
    plen: Optional[jax.Array] = None
    paged: bool = struct.field(pytree_node=False, default=False)
    group: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def zeros(cls, slots: int, layers: int, kv_heads: int, head_dim: int, length: int, dtype,
              paged: bool = False, span: int = SPAN, group: int = 0) -> "SlotCache":
        """An empty cache of at least ``length`` entries per slot (``pages``: rounded up to a whole page);
        ``heads``: in parts cut at ``spans(length, span)``; ``group``: G slots per prompt share its entries
        (``heads`` only; ``length``: the generated entries)."""
        if group and (paged or slots % group):
            raise ValueError(f"SlotCache: shared prompts need the heads layout and G ({group}) dividing the "
                             f"slots ({slots})")
        if paged:
            n = -(-length // PAGE)
            k = v = jnp.zeros((kv_heads, slots * n, PAGE, head_dim), dtype)
        else:
            ends = spans(length, span)
            widths = [b - a for a, b in zip((0,) + ends, ends)]
            k = tuple(jnp.zeros((slots, kv_heads, head_dim, w), dtype) for w in widths)
            v = tuple(jnp.zeros((slots, kv_heads, w, head_dim), dtype) for w in widths)
        return cls(k=(k,) * layers, v=(v,) * layers, qpos=jnp.zeros((slots,), jnp.int32), paged=paged, group=group)

    @property
    def slots(self) -> int:
        return self.qpos.shape[0]

    @property
    def length(self) -> int:
        """C, entries per slot."""
        return self.k[0].shape[1] * PAGE // self.slots if self.paged else sum(x.shape[3] for x in self.k[0])

    @property
    def ends(self) -> tuple[int, ...]:
        """The entry each part ends at (``pages``: one part)."""
        return (self.length,) if self.paged else tuple(np.cumsum([x.shape[3] for x in self.k[0]]).tolist())

    @property
    def entry(self) -> jax.Array:
        """int32[S]: the entry each slot's step writes, qpos less its prompt's length where prompts are shared
        (negative for a free slot: no entry)."""
        if not self.group:
            return self.qpos
        return self.qpos - jnp.repeat(self.plen, self.group, total_repeat_length=self.slots)

    def _slot_major(self, x):
        """A pages-layout array as [K, S, C, D] (a view: each slot owns consecutive pages)."""
        return x.reshape(x.shape[0], self.slots, self.length, x.shape[-1])

    def _pages(self, x):
        return x.reshape(x.shape[0], -1, PAGE, x.shape[-1])

    def step_masks(self, gen_index=None, window: Optional[int] = None) -> SlotMask:
        """The step's :class:`SlotMask` (``gen_index`` unused: each slot's step is its ``qpos``)."""
        def seen(e, q):   # entries e [1, n] at positions e + (q - at) against the query's position q
            out = e <= q
            return out if window is None else out & (e > q - window)

        at = self.entry[:, None]
        prompt = None
        if self.group:   # prompt entry c is position c, seen below the prompt's length
            c = jnp.arange(self.pk[0].shape[-1], dtype=jnp.int32)[None, :]
            plen = jnp.repeat(self.plen, self.group, total_repeat_length=self.slots)[:, None]
            prompt = seen(c, self.qpos[:, None]) & (c < plen)
        span = jnp.sum(jnp.asarray(self.ends, jnp.int32) <= jnp.max(at), dtype=jnp.int32)   # its part
        return SlotMask(visible=seen(jnp.arange(self.length, dtype=jnp.int32)[None, :], at), span=span,
                        prompt=prompt, window=window)

    def load(self, slots: jax.Array, keys: tuple, values: tuple) -> "SlotCache":
        """Rows entering ``slots`` (int32[a]; S drops the row): per layer their prompts' keys [a, K, D, T] and
        values [a, K, T, D] into entries [0, T)."""
        t = keys[0].shape[-1]
        if self.paged:
            def put(x, new):   # new [a, K, T, D]
                return self._pages(self._slot_major(x).at[:, slots, :t].set(new.transpose(1, 0, 2, 3), mode="drop"))
            return self.replace(k=tuple(put(x, n.swapaxes(2, 3)) for x, n in zip(self.k, keys)),
                                v=tuple(put(x, n) for x, n in zip(self.v, values)))
        def parts(xs, new, axis):   # the entries [0, t) of one layer's parts; new: the layer's [a, ...] rows
            out = []
            for x, lo, hi in zip(xs, (0,) + self.ends, self.ends):
                if lo < t:
                    idx = (slots,) + (slice(None),) * (axis - 1) + (slice(0, min(hi, t) - lo),)
                    x = x.at[idx].set(jax.lax.slice_in_dim(new, lo, min(hi, t), axis=axis), mode="drop")
                out.append(x)
            return tuple(out)
        return self.replace(k=tuple(parts(x, n, 3) for x, n in zip(self.k, keys)),
                            v=tuple(parts(x, n, 2) for x, n in zip(self.v, values)))

    def take(self, local: jax.Array, span: int = SPAN) -> "SlotCache":
        """The cache of the slots ``local`` names (int32[d, S' / d]: in each of d blocks of S / d consecutive slots
        -- a device's share of them --, the slots it keeps, in order; S / d: an empty slot): S' slots, each block's
        from its own slots (a mesh splitting the slots moves nothing between devices). Shared prompts (their store
        attached; d dividing P) come out unshared, each slot's prompt copied into its entries [0, Tc) and its
        generated ones after its prompt's length, in parts cut at ``spans(Tc + C, span)``."""
        if self.group:
            return self._unshare(local, span)
        if self.paged:
            k = tuple(self._pages(take_blocks(self._slot_major(x), local, 1)) for x in self.k)
            v = tuple(self._pages(take_blocks(self._slot_major(x), local, 1)) for x in self.v)
        else:
            k, v = jax.tree.map(lambda x: take_blocks(x, local, 0), (self.k, self.v))
        return self.replace(k=k, v=v, qpos=take_blocks(self.qpos, local, 0))

    def _unshare(self, local: jax.Array, span: int) -> "SlotCache":
        """:meth:`take` of shared prompts: the kept slots' prompt entries (from the store, per block of slots and
        prompts) then their generated entries at their prompt's length, as one unshared cache."""
        prompt = local // self.group   # each kept slot's prompt within its block's P / d prompts
        plen = take_blocks(self.plen, prompt, 0)
        qpos = take_blocks(self.qpos, local, 0)
        tc, n = self.pk[0].shape[-1], self.length
        ends = spans(tc + n, span)

        def one(store, parts, axis):   # one layer's keys (axis 3) or values (axis 2) -> its unshared parts
            gen = take_blocks(jnp.concatenate(parts, axis), local, 0)
            full = jnp.concatenate([take_blocks(store, prompt, 0), jnp.zeros_like(gen)], axis)
            full = jax.vmap(lambda f, g, at: jax.lax.dynamic_update_slice_in_dim(f, g, at, axis - 1))(full, gen, plen)
            return tuple(jax.lax.slice_in_dim(full, lo, hi, axis=axis) for lo, hi in zip((0,) + ends, ends))

        return SlotCache(k=tuple(one(s, x, 3) for s, x in zip(self.pk, self.k)),
                         v=tuple(one(s, x, 2) for s, x in zip(self.pv, self.v)), qpos=qpos)

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> "SlotCache":
        """The step's keys / values [S, 1, K, D] at :attr:`entry` of every slot, in layer ``layer``."""
        dtype = jax.tree.leaves(self.k[layer])[0].dtype
        k, v = k[:, 0].astype(dtype), v[:, 0].astype(dtype)   # [S, K, D]

        # one slot's entry, vmapped over the slots: a scatter batched over the slot dim, which a mesh splitting the
        # slots updates in place (an index scatter all-gathers the step's keys and positions, twice per layer)
        def put(axis, slot_axis=0):
            def one(x, new, pos):
                return jax.lax.dynamic_update_slice_in_dim(x, jnp.expand_dims(new, axis), pos, axis)
            return jax.vmap(one, in_axes=(slot_axis, 0, 0), out_axes=slot_axis)

        if self.paged:   # slot-major view [K, S, C, D]: one slot's [K, C, D], the entry on axis 1
            nk = self._pages(put(1, 1)(self._slot_major(self.k[layer]), k, self.qpos))
            nv = self._pages(put(1, 1)(self._slot_major(self.v[layer]), v, self.qpos))
            return self.replace(k=_set(self.k, layer, nk), v=_set(self.v, layer, nv))

        # one slot's keys [K, D, w] (entry on axis 2), values [K, w, D] (axis 1); a part not holding the slot's
        # entry drops the write (its index moved past the part's end: a negative one would count from the end)
        def put_part(axis):
            def one(x, new, pos):
                at = jnp.where(pos < 0, x.shape[axis], pos)
                return x.at[(slice(None),) * axis + (at,)].set(new, mode="drop")
            return jax.vmap(one)

        starts, entry = (0,) + self.ends[:-1], self.entry
        nk = tuple(put_part(2)(x, k, entry - lo) for x, lo in zip(self.k[layer], starts))
        nv = tuple(put_part(1)(x, v, entry - lo) for x, lo in zip(self.v[layer], starts))
        return self.replace(k=_set(self.k, layer, nk), v=_set(self.v, layer, nv))

    def constrain(self, rows: Optional[NamedSharding]) -> "SlotCache":
        """The slots split as ``rows`` (a sharding of dim 0) splits rows; None: unchanged."""
        if rows is None:
            return self
        c = jax.lax.with_sharding_constraint
        pages = NamedSharding(rows.mesh, PartitionSpec(None, rows.spec[0]))
        kv = pages if self.paged else rows
        return self.replace(k=jax.tree.map(lambda x: c(x, kv), self.k), v=jax.tree.map(lambda x: c(x, kv), self.v),
                            qpos=c(self.qpos, rows))


def take_blocks(x, local: jax.Array, axis: int, fill=0):
    """``x``'s slot dim (``axis``, S) as d blocks of S / d, block i keeping its slots ``local[i]`` (int32[d, S' / d];
    S / d: ``fill``) -> S' along ``axis``: a gather batched over the blocks, which a mesh splitting the slots (d
    ways) runs on each device."""
    d, keep = local.shape
    xb = x.reshape(x.shape[:axis] + (d, x.shape[axis] // d) + x.shape[axis + 1:])
    out = jax.vmap(lambda b, i: jnp.take(b, i, axis=axis, mode="fill", fill_value=fill), in_axes=(axis, 0),
                   out_axes=axis)(xb, local)
    return out.reshape(x.shape[:axis] + (d * keep,) + x.shape[axis + 1:])


def attend_slots(q, k, v, mask: SlotMask, scale: float, cache: SlotCache, layer: int,
                 softcap: Optional[float] = None, impl: str = "auto"):
    """One decode step over a SlotCache: q [S, 1, H, D]; k, v [S, 1, K, D] written at each slot's entry ``qpos``
    first. ``impl`` "splash" (the model's TPU choice) runs the paged kernel where it applies (module docstring).
    Float32 scores and softmax. Returns ([S, 1, H, D] in q.dtype, cache)."""
    cache = cache.write(layer, k, v)
    S, _, H, D = q.shape
    K = k.shape[2]
    if cache.group:
        out = _attend_shared(q.reshape(S, K, H // K, D), cache, layer, mask, scale, softcap)
        return out.reshape(S, 1, H, D), cache
    if not cache.paged:
        out = _attend_parts(q.reshape(S, K, H // K, D), cache.k[layer], cache.v[layer], mask, scale, softcap,
                            cache.ends)
        return out.reshape(S, 1, H, D), cache
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


def _attend_parts(q, ks: tuple, vs: tuple, mask: SlotMask, scale, softcap, ends: tuple, merge=None):
    """The ``heads`` layout's step: q [S, K, g, D] over the first ``mask.span`` + 1 parts (keys [S, K, D, w],
    values [S, K, w, D]), each read in place: the parts' scores concatenated, one float32 softmax, the values'
    products summed. ``merge``: another block's (max, normaliser, unnormalised output) [S, K, g, 1 | 1 | D] in
    the same softmax. Returns [S, K, g, D] in q.dtype."""
    def upto(j, q, ks, vs, visible, merge):
        s = jnp.concatenate([jnp.einsum("skqd,skdc->skqc", q, x.astype(q.dtype), preferred_element_type=jnp.float32)
                             for x in ks[:j + 1]], -1) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = s + jnp.where(visible[:, :ends[j]], 0.0, _NEG)[:, None, None, :]
        m = s.max(-1, keepdims=True)
        e = jnp.exp(s - m)
        o = sum(jnp.einsum("skqc,skcd->skqd", e[..., lo:hi].astype(q.dtype), x.astype(q.dtype),
                           preferred_element_type=jnp.float32) for x, lo, hi in zip(vs, (0,) + ends, ends[:j + 1]))
        z = e.sum(-1, keepdims=True)
        if merge is not None:   # one softmax over both blocks, merged by their maxes
            mo, zo, oo = merge
            top = jnp.maximum(m, mo)
            w, wo = jnp.exp(m - top), jnp.exp(mo - top)
            o, z = o * w + oo * wo, z * w + zo * wo
        return (o / z).astype(q.dtype)

    if len(ends) == 1:
        return upto(0, q, ks, vs, mask.visible, merge)
    return jax.lax.switch(mask.span, [functools.partial(upto, j) for j in range(len(ends))], q, ks, vs, mask.visible,
                          merge)


def _attend_shared(q, cache: SlotCache, layer: int, mask: SlotMask, scale, softcap):
    """Shared prompts' step: q [S, K, g, D], S = P * G; each prompt's keys [K, D, Tc] scored once for its G slots'
    queries (one [G * g, D] x [D, Tc] matmul per prompt and head), merged in one softmax with each slot's
    generated entries (:func:`_attend_parts`). Returns [S, K, g, D] in q.dtype."""
    S, K, g, D = q.shape
    P, G = cache.plen.shape[0], cache.group
    qp = q.reshape(P, G, K, g, D).transpose(0, 2, 1, 3, 4).reshape(P, K, G * g, D)
    sp = jnp.einsum("pkqd,pkdc->pkqc", qp, cache.pk[layer].astype(q.dtype), preferred_element_type=jnp.float32)
    sp = sp * scale
    if softcap is not None:
        sp = softcap * jnp.tanh(sp / softcap)
    seen = mask.prompt.reshape(P, G, 1, -1).transpose(0, 2, 1, 3)[:, :, :, None, :]   # [P, 1, G, 1, Tc]
    sp = sp.reshape(P, K, G, g, -1) + jnp.where(seen, 0.0, _NEG)
    mp = sp.max(-1, keepdims=True)
    ep = jnp.exp(sp - mp)
    op = jnp.einsum("pkqc,pkcd->pkqd", ep.reshape(P, K, G * g, -1).astype(q.dtype), cache.pv[layer].astype(q.dtype),
                    preferred_element_type=jnp.float32)

    def rows(x):   # [P, K, G, g, .] -> [S, K, g, .]
        return x.reshape(P, K, G, g, -1).transpose(0, 2, 1, 3, 4).reshape(S, K, g, -1)

    merge = (rows(mp), rows(ep.sum(-1, keepdims=True)), rows(op))
    return _attend_parts(q, cache.k[layer], cache.v[layer], mask, scale, softcap, cache.ends, merge)


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
