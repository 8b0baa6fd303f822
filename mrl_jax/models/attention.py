"""The single attention function (used by full forward and by cached decode), RoPE, masks, KV cache.

Shapes: B batch, T new (query) tokens, S key slots, H query heads, K kv heads (H % K == 0), D head dim.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import struct

from . import cudnn, flash, splash
from .flash import blockwise_attention
from .slot_cache import SlotCache, attend_slots

_NEG = -1e30  # finite: fully-masked rows (left-pad queries) give a uniform softmax, never NaN


def _bias(mask: jax.Array) -> jax.Array:
    """float32 additive mask: 0 where ``mask``, ``_NEG`` elsewhere (same shape as ``mask``).

    ``score + _NEG`` rounds to exactly ``_NEG`` for any |score| < 3e22 (half an ulp of 1e30), so adding it equals
    ``where(mask, score, _NEG)``; XLA:CPU runs the add in half the time of a select on a broadcast mask, and its
    gradient is the cotangent itself (no select pass backward).
    """
    return jnp.where(mask, 0.0, _NEG).astype(jnp.float32)


@struct.dataclass
class KVCache:
    """Preallocated key/value cache. k, v: [num_layers, B, S, num_kv_heads, head_dim] (compute dtype).

    Slot s of row b holds the token written there by ``decode``; which slots are valid is the caller's
    ``kv_mask`` (the cache itself stores no lengths, so it is a plain pytree of two arrays).
    """

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
              dtype=jnp.float32) -> "KVCache":
        shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


@struct.dataclass
class SampleCache:
    """The sampler's cache: P prompts, each shared by its G samples (B = P * G rows, row b = p * G + g).

    pk, pv: tuple of L arrays, keys [P, K, D, Tp] and values [P, K, Tp, D]: the prompt's, written ONCE per
      prompt (prefill).
    gk, gv: tuple of L arrays, keys [B, K, D, Lg] and values [B, K, Lg, D]: the generated tokens', Lg the
      current length bucket (:meth:`grow` pads it to the next bucket).
    pmask: bool[P, Tp], True on real prompt tokens (left padding False).
    ``joint`` (G = 1, nothing to share): ``pk = pv = ()`` and the prompt fills the first Tp slots of gk / gv
      ([B, K, D, Tp + Lg], [B, K, Tp + Lg, D]), so a decode step attends over one block (one softmax, half the
      ops of the two-block merge).
    Heads-major per row, keys slot-minor: the decode step's two matmuls (q [., D] x keys [D, S], probs [., S] x
    values [S, D]) read the cache in place, each with a contiguous minor axis (keys [S, D] made XLA:CPU's
    score matmul 1.7x slower per step at B 64, S 127); one array per layer is updated and read without
    slicing a stacked [L, ...] array.
    """

    pk: tuple
    pv: tuple
    gk: tuple
    gv: tuple
    pmask: jax.Array

    @classmethod
    def from_prefill(cls, kv: "KVCache", pmask: jax.Array, num_rows: int, gen_len: int) -> "SampleCache":
        """From a prefilled KVCache [L, P, Tp, K, D] (S = Tp): prompt part heads-major, generated part zeroed
        for ``num_rows`` = P * G rows and ``gen_len`` slots."""
        L = kv.k.shape[0]
        pk = tuple(kv.k[i].transpose(0, 2, 3, 1) for i in range(L))
        pv = tuple(kv.v[i].transpose(0, 2, 1, 3) for i in range(L))
        pmask = pmask.astype(bool)
        if num_rows == pmask.shape[0]:   # G = 1: the prompt's slots lead the generated ones (joint layout)
            return cls(pk=(), pv=(), gk=pk, gv=pv, pmask=pmask).grow(gen_len)
        _, K, D, _ = pk[0].shape
        zk = jnp.zeros((num_rows, K, D, gen_len), pk[0].dtype)
        zv = jnp.zeros((num_rows, K, gen_len, D), pv[0].dtype)
        return cls(pk=pk, pv=pv, gk=(zk,) * L, gv=(zv,) * L, pmask=pmask)

    @property
    def joint(self) -> bool:
        """The prompt is in the first Tp slots of gk / gv (G = 1; see the class docstring)."""
        return not self.pk

    def grow(self, gen_len: int) -> "SampleCache":
        """Pad the generated part to ``gen_len`` slots (the next length bucket; one copy per bucket)."""
        pad = gen_len - self.gen_len
        if pad <= 0:
            return self
        kw, vw = ((0, 0), (0, 0), (0, 0), (0, pad)), ((0, 0), (0, 0), (0, pad), (0, 0))
        return self.replace(gk=tuple(jnp.pad(x, kw) for x in self.gk),
                            gv=tuple(jnp.pad(x, vw) for x in self.gv))

    @property
    def gen_len(self) -> int:
        """Lg, the generated part's current number of slots."""
        return self.gv[0].shape[2] - (self.pmask.shape[1] if self.joint else 0)

    @property
    def num_samples(self) -> int:
        return self.gv[0].shape[0] // self.pmask.shape[0]

    def step_masks(self, gen_index, window: Optional[int] = None):
        """(bool[P, Tp], bool[Lg]) for a new token written at generated slot ``gen_index`` (query slot
        Tp + gen_index): real prompt slots, generated slots <= gen_index, and the sliding window. Joint layout:
        the two as one bool[B, Tp + Lg]."""
        tp, lg = self.pmask.shape[1], self.gen_len
        j = jnp.asarray(gen_index, jnp.int32)
        ps = jnp.arange(tp, dtype=jnp.int32)
        gs = jnp.arange(lg, dtype=jnp.int32)
        pm, gm = self.pmask, gs <= j
        if window is not None:
            pm = pm & (ps > tp + j - window)[None, :]
            gm = gm & (gs > j - window)
        if self.joint:
            return jnp.concatenate([pm, jnp.broadcast_to(gm, (pm.shape[0], lg))], axis=1)
        return pm, gm


@struct.dataclass
class CausalMask:
    """Causal attention of T new queries at slots [offset, offset + T) over S key slots, kept structural (no
    [B, T, S] array): query t sees slot s iff kv_mask[b, s], s <= offset + t and (sliding window) s > offset + t
    - window. ``dense()`` is the bool[B, T, S] of :func:`make_mask`."""

    kv_mask: jax.Array
    offset: jax.Array
    num_queries: int = struct.field(pytree_node=False)
    window: Optional[int] = struct.field(pytree_node=False, default=None)

    def dense(self) -> jax.Array:
        return make_mask(self.kv_mask, self.offset, self.num_queries, self.window)

    @property
    def q_slot(self) -> jax.Array:
        return jnp.asarray(self.offset, jnp.int32) + jnp.arange(self.num_queries, dtype=jnp.int32)


@struct.dataclass
class PrefixMask:
    """Masks of a prompt-shared layout: P prompts of Tp tokens, each followed by M completions of Tc tokens,
    laid out as ONE row of N = P*Tp + P*M*Tc tokens (prompts first, then completions prompt-major).

    Kept structural: prompt_mask bool[P, Tp] (left padding False), completion_mask bool[P*M, Tc], window. The
    dense forms: ``prompt`` bool[P, Tp, Tp] (causal self-attention inside each prompt); ``to_prompt``
    bool[P, M or 1, Tc, Tp] (completion query t of sample m sees prompt slot s); ``completion`` bool[P*M, Tc, Tc]
    (causal inside each completion). The prompt's keys are computed once and read by its M completions
    (gradients summed back).
    """

    prompt_mask: jax.Array
    completion_mask: jax.Array
    window: Optional[int] = struct.field(pytree_node=False, default=None)

    @classmethod
    def build(cls, prompt_mask: jax.Array, completion_mask: jax.Array, window: Optional[int] = None) -> "PrefixMask":
        """prompt_mask bool[P, Tp] (left padding False), completion_mask [P*M, Tc] (1 = real token)."""
        return cls(prompt_mask=prompt_mask.astype(bool), completion_mask=completion_mask > 0, window=window)

    @property
    def prompt(self) -> jax.Array:
        return make_mask(self.prompt_mask, 0, self.prompt_mask.shape[1], self.window)

    @property
    def to_prompt(self) -> jax.Array:
        Tp, Tc = self.prompt_mask.shape[1], self.completion_mask.shape[1]
        to_prompt = self.prompt_mask[:, None, None, :]
        if self.window is not None:   # completion query t sits at slot Tp + t of the concatenated row
            t, s = jnp.arange(Tc)[:, None], jnp.arange(Tp)[None, :]
            to_prompt = to_prompt & (s > Tp + t - self.window)[None, None]
        return to_prompt

    @property
    def completion(self) -> jax.Array:
        return make_mask(self.completion_mask, 0, self.completion_mask.shape[1], self.window)


def default_positions(input_ids: jax.Array, attention_mask: Optional[jax.Array]) -> jax.Array:
    """int32[B, T]: cumsum(mask) - 1 clipped at 0 (left padding works); arange(T) without a mask."""
    B, T = input_ids.shape
    if attention_mask is None:
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def rope_cos_sin(positions: jax.Array, inv_freq) -> Tuple[jax.Array, jax.Array]:
    """cos, sin: f32[B, T, D] for int positions [B, T] (HF layout: freqs repeated twice along D)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, D]; HF ``rotate_half`` convention (first half / second half of D)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rot * sin


def make_mask(kv_mask: jax.Array, cache_index, num_queries: int, window: Optional[int] = None) -> jax.Array:
    """bool[B, T, S]: query t (at slot cache_index + t) may see slot s iff kv_mask[b, s], s <= its slot,
    and (sliding window) s > its slot - window."""
    S = kv_mask.shape[-1]
    q_slot = jnp.asarray(cache_index, jnp.int32) + jnp.arange(num_queries, dtype=jnp.int32)[:, None]
    s = jnp.arange(S, dtype=jnp.int32)[None, :]
    allowed = s <= q_slot
    if window is not None:
        allowed = allowed & (s > q_slot - window)
    return kv_mask.astype(bool)[:, None, :] & allowed[None]


IMPLS = ("auto", "dense", "blockwise", "splash", "cudnn")
_AUTO = {"tpu": "splash", "gpu": "cudnn"}


def resolve_impl(impl: str, platform: str) -> str:
    """The ``impl`` a model runs on ``platform`` ("cpu" | "gpu" | "tpu" ...): "auto" is "splash" on TPU (the
    Pallas kernel, :mod:`mrl_jax.models.splash`), "cudnn" on GPU (:mod:`mrl_jax.models.cudnn`, which keeps ours
    where cuDNN's constraints fail), ours elsewhere; any other choice is kept."""
    if impl not in IMPLS:
        raise ValueError(f"attention must be one of {'|'.join(IMPLS)}, got {impl!r}")
    return _AUTO.get(platform, impl) if impl == "auto" else impl


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask, *, scale: float,
              cache: Optional[KVCache] = None, layer: int = 0, cache_index=0, softcap: Optional[float] = None,
              impl: str = "auto") -> Tuple[jax.Array, Optional[KVCache]]:
    """Grouped-query attention with an explicit cache in and out.

    q: [B, T, H, D]; k, v: [B, T, K, D] for the T new tokens; mask: bool[B, T, S] or a :class:`CausalMask`.
    cache None: the keys are the new tokens (S = T). A KVCache: the new k/v are written into
    ``cache`` layer ``layer`` at slots [cache_index, cache_index + T) (caller keeps cache_index + T <= S)
    and the queries attend over all S slots of that layer. A SampleCache (one decode step, T = 1): see
    :func:`_attend_shared`; ``mask`` is then its ``step_masks`` pair. A SlotCache (the slot sampler's decode step):
    :func:`mrl_jax.models.slot_cache.attend_slots`, ``mask`` its ``step_masks``. A PrefixMask (q, k, v [1, N, ., D] of the
    prompt-shared layout): see :func:`_attend_prefix`.
    softcap: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2 style).
    impl: "dense" (one float32 score array per layer), "blockwise" (:mod:`mrl_jax.models.flash`: online softmax
    over key blocks, recomputing backward, memory linear in length; CausalMask / PrefixMask only), "auto"
    (blockwise for a structural mask with several queries over more than ``flash.BLOCK`` keys, else dense) or
    "splash" (:mod:`mrl_jax.models.splash`, JAX's Pallas TPU kernel, for a PrefixMask and for a CausalMask of
    several queries at offset 0 -- no cache, or a prefill filling its cache -- and "auto" for the rest) or
    "cudnn" (:mod:`mrl_jax.models.cudnn`, ``jax.nn.dot_product_attention``: cuDNN's flash kernel on a CUDA GPU,
    its plain-XLA implementation on the CPU; the same masks as "splash", where cuDNN's dtype / head-dim
    constraints hold and without soft-capping, and "auto" for the rest).
    Scores, mask and softmax in float32; returns ([B, T, H, D] in q.dtype, updated cache or None).
    """
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(cache, SlotCache):
        return attend_slots(q, k, v, mask, scale, cache, layer, softcap, impl)
    if isinstance(cache, SampleCache):
        return _attend_shared(q, k, v, mask, scale, cache, layer, cache_index, softcap)
    if cache is not None:
        idx = jnp.asarray(cache_index, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        start = (jnp.asarray(layer, jnp.int32), zero, idx, zero, zero)
        ck = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start)
        cv = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start)
        cache = KVCache(k=ck, v=cv)
        k, v = ck[layer], cv[layer]
    if impl == "splash":
        if isinstance(mask, PrefixMask):
            return splash.prefix_attention(q, k, v, mask.prompt_mask, mask.completion_mask, scale=scale,
                                           window=mask.window, softcap=softcap), cache
        if isinstance(mask, CausalMask) and 1 < q.shape[1] == k.shape[1]:   # hence offset 0 (offset + T <= S)
            return splash.causal_attention(q, k, v, mask.kv_mask, scale=scale, window=mask.window,
                                           softcap=softcap), cache
        impl = "auto"
    if impl == "cudnn":
        how = cudnn.implementation(q.dtype, q.shape[3], softcap)
        if how is not None and isinstance(mask, PrefixMask):
            return cudnn.prefix_attention(q, k, v, mask.prompt_mask, mask.completion_mask, scale=scale,
                                          window=mask.window, implementation=how), cache
        if how is not None and isinstance(mask, CausalMask) and 1 < q.shape[1] == k.shape[1]:
            return cudnn.causal_attention(q, k, v, mask.kv_mask, scale=scale, window=mask.window,
                                          implementation=how), cache
        impl = "auto"
    if isinstance(mask, PrefixMask):
        Tc, S = mask.completion_mask.shape[1], mask.prompt_mask.shape[1] + mask.completion_mask.shape[1]
        if _blockwise(impl, Tc, S):
            return _attend_prefix_blockwise(q, k, v, mask, scale, softcap), cache
        return _attend_prefix(q, k, v, mask, scale, softcap), cache
    if isinstance(mask, CausalMask):
        if _blockwise(impl, q.shape[1], k.shape[1]):
            S = k.shape[1]
            out = blockwise_attention(q, k, v, mask.q_slot, jnp.arange(S, dtype=jnp.int32), mask.kv_mask,
                                      scale=scale, window=mask.window, softcap=softcap)
            return out, cache
        mask = mask.dense()
    return _attend(q, k, v, mask, scale, softcap), cache


def _blockwise(impl: str, num_queries: int, num_keys: int) -> bool:
    return impl == "blockwise" or (impl == "auto" and num_queries > 1 and num_keys > flash.BLOCK)


def _cap(s: jax.Array, softcap: Optional[float]) -> jax.Array:
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _attend_prefix_blockwise(q, k, v, mask: PrefixMask, scale, softcap):
    """The prompt-shared layout with :func:`flash.blockwise_attention`: prompts causally over themselves;
    completion b = p*M + m over [prompt p's keys (slots 0..Tp-1) ++ its own (slots Tp..)], the prompt's keys
    repeated per completion (their gradients sum back into the prompt)."""
    P, Tp = mask.prompt_mask.shape
    B, Tc = mask.completion_mask.shape
    H, K, D = q.shape[2], k.shape[2], q.shape[3]
    M, n = B // P, P * Tp
    opts = dict(scale=scale, window=mask.window, softcap=softcap)
    pslot, cslot = jnp.arange(Tp, dtype=jnp.int32), jnp.arange(Tp + Tc, dtype=jnp.int32)
    pk, pv = (x[0, :n].reshape(P, Tp, K, D) for x in (k, v))
    out_p = blockwise_attention(q[0, :n].reshape(P, Tp, H, D), pk, pv, pslot, pslot, mask.prompt_mask, **opts)
    kc, vc = (jnp.concatenate([jnp.repeat(p, M, axis=0), x[0, n:].reshape(B, Tc, K, D)], axis=1)
              for p, x in ((pk, k), (pv, v)))
    valid = jnp.concatenate([jnp.repeat(mask.prompt_mask, M, axis=0), mask.completion_mask], axis=1)
    out_c = blockwise_attention(q[0, n:].reshape(B, Tc, H, D), kc, vc, cslot[Tp:], cslot, valid, **opts)
    return jnp.concatenate([out_p.reshape(n, H, D), out_c.reshape(B * Tc, H, D)], 0)[None]


# Every score matmul below is a dot_general with batch dims (K, rows) leading and the queries' (T, g) as one
# free dim, so its output is already in the [K, rows, T, g, S] layout the mask, softmax and the second matmul
# read: no transposed copy of a score-sized array, forward or backward (only the small q/k/v/out are moved).
_QK = (((3,), (3,)), ((0, 1), (0, 1)))    # [K, R, Q, D] x [K, R, S, D] -> [K, R, Q, S]
_PV = (((3,), (2,)), ((0, 1), (0, 1)))    # [K, R, Q, S] x [K, R, S, D] -> [K, R, Q, D]


def _kv_heads_major(x, dtype):
    """[R, S, K, D] -> [K, R, S, D] in ``dtype``."""
    return x.transpose(2, 0, 1, 3).astype(dtype)


def _attend(q, k, v, mask, scale, softcap=None):
    """q [B, T, H, D], k/v [B, S, K, D], mask bool[B, T, S] -> [B, T, H, D]; float32 scores and softmax."""
    B, T, H, D = q.shape
    K, S = k.shape[2], k.shape[1]
    g = H // K
    qh = q.reshape(B, T, K, g, D).transpose(2, 0, 1, 3, 4).reshape(K, B, T * g, D)
    s = jax.lax.dot_general(qh, _kv_heads_major(k, q.dtype), _QK, preferred_element_type=jnp.float32)
    s = _cap(s.reshape(K, B, T, g, S) * scale, softcap) + _bias(mask)[None, :, :, None, :]
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype).reshape(K, B, T * g, S)
    o = jax.lax.dot_general(p, _kv_heads_major(v, q.dtype), _PV).reshape(K, B, T, g, D)
    return o.transpose(1, 2, 0, 3, 4).reshape(B, T, H, D)


def _attend_prefix(q, k, v, mask: PrefixMask, scale, softcap=None):
    """Attention of the prompt-shared layout (see PrefixMask): q [1, N, H, D], k, v [1, N, K, D].

    Prompts attend causally within themselves; completion b = p*M + m attends to prompt p's keys [K, P, Tp, D]
    and to its own earlier tokens [K, B, Tc, D]. The two score blocks share one float32 softmax (a common max
    and normaliser, no concatenated copy, as in flash attention's merge of key blocks), which equals attention
    over [prompt ++ completion].
    """
    P, Tp = mask.prompt.shape[:2]
    B, Tc = mask.completion.shape[:2]
    H, K, D = q.shape[2], k.shape[2], q.shape[3]
    M, g, n, dt = B // P, H // K, P * Tp, q.dtype
    out_p = _attend(q[0, :n].reshape(P, Tp, H, D), k[0, :n].reshape(P, Tp, K, D),
                    v[0, :n].reshape(P, Tp, K, D), mask.prompt, scale, softcap)
    qc = q[0, n:].reshape(P, M, Tc, K, g, D).transpose(3, 0, 1, 2, 4, 5)     # [K, P, M, Tc, g, D]
    pk, pv = (_kv_heads_major(x[0, :n].reshape(P, Tp, K, D), dt) for x in (k, v))
    kc, vc = (_kv_heads_major(x[0, n:].reshape(B, Tc, K, D), dt) for x in (k, v))
    sp = jax.lax.dot_general(qc.reshape(K, P, M * Tc * g, D), pk, _QK, preferred_element_type=jnp.float32)
    sp = _cap(sp.reshape(K, P, M, Tc, g, Tp) * scale, softcap) + _bias(mask.to_prompt)[None, :, :, :, None]
    sc = jax.lax.dot_general(qc.reshape(K, B, Tc * g, D), kc, _QK, preferred_element_type=jnp.float32)
    sc = _cap(sc.reshape(K, P, M, Tc, g, Tc) * scale, softcap)
    sc = sc + _bias(mask.completion.reshape(P, M, Tc, Tc))[None, :, :, :, None]
    # Each block's exponentials against its own max, weighted by exp(own max - common max) / normaliser on the
    # [., D] outputs: no score-sized divide, and each max reduces one block (with one joint max the pair of blocks
    # cost 2.5x the two done apart).
    mp, mc = (jax.lax.stop_gradient(x.max(-1, keepdims=True)) for x in (sp, sc))    # [K, P, M, Tc, g, 1]
    ep, ec = jnp.exp(sp - mp), jnp.exp(sc - mc)
    m = jnp.maximum(mp, mc)
    wp, wc = jnp.exp(mp - m), jnp.exp(mc - m)
    z = ep.sum(-1, keepdims=True) * wp + ec.sum(-1, keepdims=True) * wc
    op = jax.lax.dot_general(ep.astype(dt).reshape(K, P, M * Tc * g, Tp), pv, _PV, preferred_element_type=jnp.float32)
    oc = jax.lax.dot_general(ec.astype(dt).reshape(K, B, Tc * g, Tc), vc, _PV, preferred_element_type=jnp.float32)
    oc = op.reshape(K, P, M, Tc, g, D) * (wp / z) + oc.reshape(K, P, M, Tc, g, D) * (wc / z)
    oc = oc.astype(dt).reshape(K, B, Tc, g, D).transpose(1, 2, 0, 3, 4)
    return jnp.concatenate([out_p.reshape(n, H, D), oc.reshape(B * Tc, H, D)], 0)[None]


def _attend_shared(q, k, v, masks, scale, cache: SampleCache, layer: int, gen_index, softcap=None):
    """One decode step (T = 1) over a SampleCache: each prompt's keys are read once for its G rows.

    q: [B, 1, H, D]; k, v: [B, 1, K, D] (written at generated slot ``gen_index`` of layer ``layer``);
    masks: (bool[P, Tp], bool[Lg]). Scores of the prompt part [P, K, G*g, Tp] and of the generated part
    [B, K, g, Lg] share one float32 softmax (merged by their maxes), so this equals attention over the
    concatenated slots.
    """
    if cache.joint:
        return _attend_joint(q, k, v, masks, scale, cache, layer, gen_index, softcap)
    B, T, H, D = q.shape
    P, K, Tp, _ = cache.pv[layer].shape
    G, g = B // P, H // K
    cache, gk, gv = _write_step(cache, layer, k, v, gen_index)
    pmask, gmask = masks
    qb = q.reshape(B, K, g, D)
    qp = qb.reshape(P, G, K, g, D).transpose(0, 2, 1, 3, 4).reshape(P, K, G * g, D)
    sp = jnp.einsum("pkqd,pkds->pkqs", qp, cache.pk[layer].astype(q.dtype), preferred_element_type=jnp.float32)
    sp = _cap(sp * scale, softcap) + _bias(pmask)[:, None, None, :]
    sg = jnp.einsum("bkqd,bkds->bkqs", qb, gk.astype(q.dtype), preferred_element_type=jnp.float32)
    sg = _cap(sg * scale, softcap) + _bias(gmask)[None, None, None, :]
    # One softmax over both blocks, merged on the small outputs (as in _attend_prefix): the prompt block's scores
    # stay prompt-major [P, K, G*g, Tp]; only its max, normaliser and [., D] output move to row order.
    mp, mg = sp.max(-1, keepdims=True), sg.max(-1, keepdims=True)
    ep, eg = jnp.exp(sp - mp), jnp.exp(sg - mg)
    op = jnp.einsum("pkqs,pksd->pkqd", ep.astype(q.dtype), cache.pv[layer].astype(q.dtype),
                    preferred_element_type=jnp.float32)
    og = jnp.einsum("bkqs,bksd->bkqd", eg.astype(q.dtype), gv.astype(q.dtype), preferred_element_type=jnp.float32)

    def rows(x):   # [P, K, G*g, .] -> [B, K, g, .]
        return x.reshape(P, K, G, g, -1).transpose(0, 2, 1, 3, 4).reshape(B, K, g, -1)

    mp, zp, op = rows(mp), rows(ep.sum(-1, keepdims=True)), rows(op)
    m = jnp.maximum(mp, mg)
    wp, wg = jnp.exp(mp - m), jnp.exp(mg - m)
    o = (op * wp + og * wg) / (zp * wp + eg.sum(-1, keepdims=True) * wg)
    return o.astype(q.dtype).reshape(B, T, H, D), cache


def _attend_joint(q, k, v, mask, scale, cache: SampleCache, layer: int, gen_index, softcap=None):
    """One decode step over a joint SampleCache (G = 1): q [B, 1, H, D]; k, v [B, 1, K, D] written at slot
    Tp + ``gen_index``; mask bool[B, Tp + Lg]. One block: scores [B, K, g, S], one float32 softmax."""
    B, T, H, D = q.shape
    K = k.shape[2]
    g = H // K
    cache, gk, gv = _write_step(cache, layer, k, v, cache.pmask.shape[1] + jnp.asarray(gen_index, jnp.int32))
    s = jnp.einsum("bkqd,bkds->bkqs", q.reshape(B, K, g, D), gk.astype(q.dtype), preferred_element_type=jnp.float32)
    s = _cap(s * scale, softcap) + _bias(mask)[:, None, None, :]
    m = s.max(-1, keepdims=True)
    e = jnp.exp(s - m)
    o = jnp.einsum("bkqs,bksd->bkqd", e.astype(q.dtype), gv.astype(q.dtype), preferred_element_type=jnp.float32)
    o = o / e.sum(-1, keepdims=True)
    return o.astype(q.dtype).reshape(B, T, H, D), cache


def _write_step(cache: SampleCache, layer: int, k, v, slot):
    """Write the step's k, v [B, 1, K, D] at slot ``slot`` of layer ``layer``'s gk / gv. Returns (cache, gk, gv)."""
    B, _, K, D = k.shape
    zero, slot = jnp.zeros((), jnp.int32), jnp.asarray(slot, jnp.int32)
    dt = cache.gk[layer].dtype
    gk = jax.lax.dynamic_update_slice(cache.gk[layer], k.reshape(B, K, D, 1).astype(dt), (zero, zero, zero, slot))
    gv = jax.lax.dynamic_update_slice(cache.gv[layer], v.reshape(B, K, 1, D).astype(dt), (zero, zero, slot, zero))
    return cache.replace(gk=_set(cache.gk, layer, gk), gv=_set(cache.gv, layer, gv)), gk, gv


def _set(xs: tuple, i: int, x) -> tuple:
    return xs[:i] + (x,) + xs[i + 1:]
