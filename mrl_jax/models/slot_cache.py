"""The slot sampler's KV cache and its decode step's attention (`mrl_jax.sampler.slots`).

Names as the sampler's: S slots, P prompts, G samples per prompt, N the completion length (a slot's N - 1
generated entries), W the slots' prompt width (``width``: the prompt columns a slot or the prompt store holds).

S decode slots, each holding one row's entries: its prompt's keys / values (positions [0, plen), left-aligned)
and its generated tokens' (generated entry j: position plen + j). A decode step feeds its token at position
``qpos``, writes its key / value at generated entry qpos - plen (:attr:`SlotCache.entry`) and attends over its
prompt and its generated entries up to that one (and the sliding window): a length per slot, no per-entry mask
to keep. Two layouts, per layer:

* ``heads`` (CPU, GPU): keys [S, K, D, w] / values [S, K, w, D] in parts, the generated entries cut at
  :func:`spans` ``(N - 1)`` (a quarter, a half and all of them, or doubling from 64 when N is short), the first
  part led by the slot's prompt (W columns: generated entry j is column W + j);
  heads-major, keys slot-minor, so the step's two matmuls read the cache in place (as
  :class:`mrl_jax.models.SampleCache`). A step reads the parts up to the first span past every slot's entry (a
  ``lax.switch`` over the spans, one program): a round whose slots hold short rows reads short spans, as the
  static sampler's length buckets do, without copying a slice of the cache (XLA:CPU copies a sliced operand
  before a matmul: a slice per step cost more than the entries it saved). **Shared prompts** (``group`` G > 0: a
  slot per row, slot s decoding row s, the G rows of prompt p in slots [p * G, (p + 1) * G), every slot at the
  same entry: all enter at step 1, none refills, and a free slot steps with the live ones): the parts hold the
  generated entries only, a step writes one column of every slot (a dynamic-update-slice, as the static
  sampler's), and it reads each prompt's entries
  from the sampler's prompt store (keys [P, K, D, W], values [P, K, W, D], attached for the step as ``pk`` /
  ``pv``) once for its G slots (one [G * g, D] x [D, W] matmul per prompt and head, merged into the parts'
  softmax by the maxes, as the static sampler does); :meth:`SlotCache.take` puts each kept slot's prompt in front
  of its first part, the layout of the ladder's rungs below the first.
* ``pages`` (TPU): keys and values [K, S * C / PAGE, PAGE, D], C = W + N - 1, slot s owning pages
  [s * C / PAGE, (s + 1) * C / PAGE) in position order (plen is 0 to this layout: entry = position): the layout
  of JAX's Pallas TPU paged attention kernel (``jax.experimental.pallas.ops.tpu.paged_attention``), which the
  step runs on TPU for a layer without a sliding window whose head dim is a multiple of 128 (the kernel's lane
  width; 64- and 96-wide heads do not lower); the other layers, and every platform but TPU, run the pure-JAX step
  over the same pages. The page table is the identity: a row's prompt is copied into its slot's pages when it
  enters (`load`); sharing them among a prompt's G slots would need the partial last page copied per slot (not
  done).
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
    """A decode step's mask over a SlotCache: visible bool[S, C] over each slot's columns (a prompt column c seen
    below its prompt's length, a generated entry up to the slot's own; both within the sliding window), shared
    prompts bool[1, C] (every slot at one entry); prompt (shared prompts; else None) the prompt store's entries
    seen: bool[P, W], those below each prompt's length (a live slot's position is past them), or with a sliding
    window bool[P, G, W], per slot; span int32: how many parts the step reads, less one (the first part end past
    every slot's column); window: the layer's sliding window (static; None: none)."""

    visible: jax.Array
    span: jax.Array
    prompt: Optional[jax.Array] = None
    window: Optional[int] = struct.field(pytree_node=False, default=None)


@struct.dataclass
class SlotCache:
    """S slots' columns per layer (layouts: see the module docstring): k, v tuples of L layers, each (``heads``) a
    tuple of parts or (``pages``) one array; qpos int32[S]: the position each slot feeds at this step; plen
    int32[S]: its row's prompt length (the position of generated entry 0; ``pages``: 0); pk, pv: the shared
    prompt store, L x [P, K, D, W] / [P, K, W, D], attached for a step or a move (else ()); paged: the ``pages``
    layout; width: the prompt columns leading the first part (``heads`` without shared prompts; else 0); group: G
    slots per prompt sharing its entries, every slot at one entry (:attr:`shared_entry`; 0: none)."""

    k: tuple
    v: tuple
    qpos: jax.Array
    plen: jax.Array
    pk: tuple = ()
    pv: tuple = ()
    paged: bool = struct.field(pytree_node=False, default=False)
    width: int = struct.field(pytree_node=False, default=0)
    group: int = struct.field(pytree_node=False, default=0)

    @classmethod
    def zeros(cls, slots: int, layers: int, kv_heads: int, head_dim: int, width: int, length: int, dtype,
              paged: bool = False, span: int = SPAN, group: int = 0) -> "SlotCache":
        """An empty cache for prompts of ``width`` columns and ``length`` generated entries per slot: ``pages``
        width + length columns rounded up to whole pages; ``heads`` the generated entries in parts cut at
        ``spans(length, span)``, the prompt's columns in front of the first (none with ``group``: G slots per
        prompt read the prompt store)."""
        if group and (paged or slots % group):
            raise ValueError(f"SlotCache: shared prompts need the heads layout and G ({group}) dividing the "
                             f"slots ({slots})")
        zero = jnp.zeros((slots,), jnp.int32)
        if paged:
            n = -(-(width + length) // PAGE)
            k = v = jnp.zeros((kv_heads, slots * n, PAGE, head_dim), dtype)
            return cls(k=(k,) * layers, v=(v,) * layers, qpos=zero, plen=zero, paged=True)
        lead = 0 if group else int(width)
        ends = spans(length, span)
        widths = [b - a + (lead if a == 0 else 0) for a, b in zip((0,) + ends, ends)]
        k = tuple(jnp.zeros((slots, kv_heads, head_dim, w), dtype) for w in widths)
        v = tuple(jnp.zeros((slots, kv_heads, w, head_dim), dtype) for w in widths)
        return cls(k=(k,) * layers, v=(v,) * layers, qpos=zero, plen=zero, width=lead, group=group)

    @property
    def slots(self) -> int:
        return self.qpos.shape[0]

    @property
    def length(self) -> int:
        """C, columns per slot (prompt columns included)."""
        return self.k[0].shape[1] * PAGE // self.slots if self.paged else sum(x.shape[3] for x in self.k[0])

    @property
    def ends(self) -> tuple[int, ...]:
        """The column each part ends at (``pages``: one part)."""
        return (self.length,) if self.paged else tuple(np.cumsum([x.shape[3] for x in self.k[0]]).tolist())

    @property
    def entry(self) -> jax.Array:
        """int32[S]: the generated entry each slot's step writes, qpos - plen (negative for a free slot stepping at
        position 0: it writes nothing); its column is ``width`` + entry."""
        return self.qpos - self.plen

    @property
    def shared_entry(self) -> jax.Array:
        """int32: the generated entry every slot of a shared-prompt cache (``group``) is at: the sampler steps its
        free slots with the live ones (a free slot's row has ended; what it computes is never read back)."""
        return self.qpos[0] - self.plen[0]

    def _slot_major(self, x):
        """A pages-layout array as [K, S, C, D] (a view: each slot owns consecutive pages)."""
        return x.reshape(x.shape[0], self.slots, self.length, x.shape[-1])

    def _pages(self, x):
        return x.reshape(x.shape[0], -1, PAGE, x.shape[-1])

    def step_masks(self, gen_index=None, window: Optional[int] = None) -> SlotMask:
        """The step's :class:`SlotMask` (``gen_index`` unused: each slot's step is its ``qpos``)."""
        def seen(e, q):   # entries e [1, n] against the query's q, both counted from the same origin
            out = e <= q
            return out if window is None else out & (e > q - window)

        c = jnp.arange(self.length, dtype=jnp.int32)[None, :]
        at = self.shared_entry[None, None] if self.group else self.entry[:, None]   # shared: one row of columns
        qpos, plen = self.qpos[:, None], self.plen[:, None]
        visible = seen(c - self.width, at)
        if self.width:   # the prompt's columns lead the first part
            visible = jnp.where(c < self.width, seen(c, qpos) & (c < plen), visible)
        prompt = None
        if self.group:   # the store's entry c is position c, below a live slot's position: per prompt but for a window
            t = jnp.arange(self.pk[0].shape[-1], dtype=jnp.int32)
            prompt = t[None, :] < self.plen[::self.group, None]   # [P, W]: a prompt's G slots share its length
            if window is not None:
                prompt = prompt[:, None, :] & (t > self.qpos.reshape(-1, self.group)[:, :, None] - window)
        span = jnp.sum(jnp.asarray(self.ends, jnp.int32) <= jnp.max(at) + self.width, dtype=jnp.int32)
        return SlotMask(visible=visible, span=span, prompt=prompt, window=window)

    def load(self, slots: jax.Array, keys: tuple, values: tuple, lengths: jax.Array) -> "SlotCache":
        """Rows entering ``slots`` (int32[a]; S drops the row): per layer their prompts' keys [a, K, D, T] and
        values [a, K, T, D] (left-aligned, T the prompt width) into columns [0, T); ``lengths`` int32[a] their
        prompt lengths (``heads``)."""
        t = keys[0].shape[-1]
        if self.paged:
            def put(x, new):   # new [a, K, T, D]
                return self._pages(self._slot_major(x).at[:, slots, :t].set(new.transpose(1, 0, 2, 3), mode="drop"))
            return self.replace(k=tuple(put(x, n.swapaxes(2, 3)) for x, n in zip(self.k, keys)),
                                v=tuple(put(x, n) for x, n in zip(self.v, values)))

        def first(parts, new, axis):   # the prompt's columns of a layer's first part
            return (parts[0].at[(slots,) + (slice(None),) * (axis - 1) + (slice(0, t),)].set(new, mode="drop"),
                    ) + parts[1:]
        return self.replace(k=tuple(first(x, n, 3) for x, n in zip(self.k, keys)),
                            v=tuple(first(x, n, 2) for x, n in zip(self.v, values)),
                            plen=self.plen.at[slots].set(lengths, mode="drop"))

    def take(self, local: jax.Array) -> "SlotCache":
        """The cache of the slots ``local`` names (int32[d, S' / d]: in each of d blocks of S / d consecutive slots
        -- a device's share of them --, the slots it keeps, in order; S / d: an empty slot): S' slots, each block's
        from its own slots (a mesh splitting the slots moves nothing between devices). Shared prompts (the store
        attached, d dividing P) come out unshared: each kept slot's prompt, from its block's own prompts, in front
        of its first part."""
        def blocks(x, axis=0):
            return take_blocks(x, local, axis)
        if self.paged:
            k = tuple(self._pages(blocks(self._slot_major(x), 1)) for x in self.k)
            v = tuple(self._pages(blocks(self._slot_major(x), 1)) for x in self.v)
            return self.replace(k=k, v=v, qpos=blocks(self.qpos))
        k, v = jax.tree.map(blocks, (self.k, self.v))
        cache = self.replace(k=k, v=v, qpos=blocks(self.qpos), plen=blocks(self.plen))
        if not self.group:
            return cache

        def lead(store, parts, axis):   # slot s reads prompt s // G: in a block, local slot l its prompt l // G
            return (jnp.concatenate([take_blocks(store, local // self.group, 0), parts[0]], axis),) + parts[1:]
        return cache.replace(k=tuple(lead(x, ps, 3) for x, ps in zip(self.pk, k)),
                             v=tuple(lead(x, ps, 2) for x, ps in zip(self.pv, v)), pk=(), pv=(),
                             width=self.pk[0].shape[-1], group=0)

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> "SlotCache":
        """The step's keys / values [S, 1, K, D] at column ``width`` + :attr:`entry` of every slot, in layer
        ``layer`` (shared prompts: :attr:`shared_entry`, in every slot -- a free one's row has ended)."""
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

        # one slot's keys [K, D, w] (column on axis 2), values [K, w, D] (axis 1); a part not holding the slot's
        # column, or no column (a free slot's negative entry), drops the write (moved past the part's end: a
        # negative index would count from the end)
        def put_part(axis):
            def one(x, new, pos):
                at = jnp.where(pos < 0, x.shape[axis], pos)
                return x.at[(slice(None),) * axis + (at,)].set(new, mode="drop")
            return jax.vmap(one)

        if self.group:   # every slot at one entry: one column of every slot, written in place
            at = self.shared_entry
            return self.replace(k=_set(self.k, layer, _put_column(self.k[layer], k[..., None], at, 3)),
                                v=_set(self.v, layer, _put_column(self.v[layer], v[:, :, None], at, 2)))
        entry = self.entry
        col = jnp.where(entry < 0, -1 - self.length, entry + self.width)
        starts = (0,) + self.ends[:-1]
        nk = tuple(put_part(2)(x, k, col - lo) for x, lo in zip(self.k[layer], starts))
        nv = tuple(put_part(1)(x, v, col - lo) for x, lo in zip(self.v[layer], starts))
        return self.replace(k=_set(self.k, layer, nk), v=_set(self.v, layer, nv))

    def constrain(self, rows: Optional[NamedSharding]) -> "SlotCache":
        """The slots split as ``rows`` (a sharding of dim 0) splits rows; None: unchanged."""
        if rows is None:
            return self
        c = jax.lax.with_sharding_constraint
        pages = NamedSharding(rows.mesh, PartitionSpec(None, rows.spec[0]))
        kv = pages if self.paged else rows
        return self.replace(k=jax.tree.map(lambda x: c(x, kv), self.k), v=jax.tree.map(lambda x: c(x, kv), self.v),
                            qpos=c(self.qpos, rows), plen=c(self.plen, rows))


def _put_column(parts: tuple, new: jax.Array, col: jax.Array, axis: int) -> tuple:
    """Column ``col`` (int32, of the parts laid end to end along ``axis``) of every slot set to ``new`` (the column's
    shape): a dynamic-update-slice in the part holding it; the others rewrite their own column at the clamped
    index."""
    out, lo = [], 0
    for x in parts:
        w = x.shape[axis]
        at = jnp.clip(col - lo, 0, w - 1)
        here = (col >= lo) & (col < lo + w)
        keep = jax.lax.dynamic_slice_in_dim(x, at, 1, axis)
        out.append(jax.lax.dynamic_update_slice_in_dim(x, jnp.where(here, new.astype(x.dtype), keep), at, axis))
        lo += w
    return tuple(out)


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
    """One decode step over a SlotCache: q [S, 1, H, D]; k, v [S, 1, K, D] written at each slot's entry first.
    ``impl`` "splash" (the model's TPU choice) runs the paged kernel where it applies (module docstring).
    Float32 scores and softmax. Returns ([S, 1, H, D] in q.dtype, cache)."""
    cache = cache.write(layer, k, v)
    S, _, H, D = q.shape
    K = k.shape[2]
    if not cache.paged:
        q = q.reshape(S, K, H // K, D)
        merge = _shared_prompts(q, cache, layer, mask.prompt, scale, softcap) if cache.group else None
        out = _attend_parts(q, cache.k[layer], cache.v[layer], mask, scale, softcap, cache.ends, merge)
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


def _scores(s, scale, softcap, seen):
    """Scaled, soft-capped float32 scores with ``_NEG`` where not ``seen`` (broadcast against s)."""
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s + jnp.where(seen, 0.0, _NEG)


def _shared_prompts(q, cache: SlotCache, layer: int, seen, scale, softcap):
    """Shared prompts' block for q [S, K, g, D]: each prompt's keys [K, D, W] scored once for its G slots' queries
    (one [G * g, D] x [D, W] matmul per prompt and head, as the static sampler does); returns (max, normaliser,
    unnormalised output) [S, K, g, 1 | 1 | D] of its part of the softmax."""
    S, K, g, D = q.shape
    pk, pv = cache.pk[layer].astype(q.dtype), cache.pv[layer].astype(q.dtype)
    P, G = pk.shape[0], cache.group
    qp = q.reshape(P, G, K, g, D).transpose(0, 2, 1, 3, 4).reshape(P, K, G * g, D)
    s = jnp.einsum("pkqd,pkdc->pkqc", qp, pk, preferred_element_type=jnp.float32)   # [P, K, G * g, W]
    # the mask [P, 1, 1 | G * g, W]; scores kept 4-D as the static sampler's (a [P, K, G, g, W] view made
    # XLA:CPU's fused softmax 3.5x slower)
    seen = seen[:, None, None, :] if seen.ndim == 2 else jnp.repeat(seen, g, axis=1)[:, None]
    s = _scores(s, scale, softcap, seen)
    m = s.max(-1, keepdims=True)
    e = jnp.exp(s - m)
    o = jnp.einsum("pkqc,pkcd->pkqd", e.astype(q.dtype), pv, preferred_element_type=jnp.float32)

    def rows(x):   # [P, K, G, g, .] -> [S, K, g, .]
        return x.reshape(P, K, G, g, -1).transpose(0, 2, 1, 3, 4).reshape(S, K, g, -1)
    return rows(m), rows(e.sum(-1, keepdims=True)), rows(o)


def _attend_parts(q, ks: tuple, vs: tuple, mask: SlotMask, scale, softcap, ends: tuple, merge=None):
    """The ``heads`` layout's step: q [S, K, g, D] over the first ``mask.span`` + 1 parts (keys [S, K, D, w],
    values [S, K, w, D]), each read in place: the parts' scores concatenated, one float32 softmax, the values'
    products summed; ``merge``: shared prompts' (max, normaliser, unnormalised output) [S, K, g, 1 | 1 | D] in the
    same softmax, merged by the maxes. Returns [S, K, g, D] in q.dtype."""
    def upto(j, q, ks, vs, visible, merge):
        s = jnp.concatenate([jnp.einsum("skqd,skdc->skqc", q, x.astype(q.dtype), preferred_element_type=jnp.float32)
                             for x in ks[:j + 1]], -1)
        s = _scores(s, scale, softcap, visible[:, None, None, :ends[j]])
        m = s.max(-1, keepdims=True)
        e = jnp.exp(s - m)
        o = sum(jnp.einsum("skqc,skcd->skqd", e[..., lo:hi].astype(q.dtype), x.astype(q.dtype),
                           preferred_element_type=jnp.float32) for x, lo, hi in zip(vs, (0,) + ends, ends[:j + 1]))
        z = e.sum(-1, keepdims=True)
        if merge is not None:
            mp, zp, op = merge
            top = jnp.maximum(m, mp)
            w, wp = jnp.exp(m - top), jnp.exp(mp - top)
            o, z = o * w + op * wp, z * w + zp * wp
        return (o / z).astype(q.dtype)

    if len(ends) == 1:
        return upto(0, q, ks, vs, mask.visible, merge)
    return jax.lax.switch(mask.span, [functools.partial(upto, j) for j in range(len(ends))], q, ks, vs, mask.visible,
                          merge)


def _attend(q, ks, vs, visible, scale, softcap, qk: str, pv: str):
    """Scores (``qk`` einsum of q [S, K, g, D] and the keys), masked by ``visible`` bool[S, C], one float32
    softmax, ``pv`` einsum with the values -> [S, K, g, D] in q.dtype."""
    s = _scores(jnp.einsum(qk, q, ks.astype(q.dtype), preferred_element_type=jnp.float32), scale, softcap,
                visible[:, None, None, :])
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
