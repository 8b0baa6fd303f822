"""The single attention function (used by full forward and by cached decode), RoPE, masks, KV cache.

Shapes: B batch, T new (query) tokens, S key slots, H query heads, K kv heads (H % K == 0), D head dim.
"""
from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from flax import struct

_NEG = -1e30  # finite: fully-masked rows (left-pad queries) give a uniform softmax, never NaN


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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float,
              cache: Optional[KVCache] = None, layer: int = 0,
              cache_index=0) -> Tuple[jax.Array, Optional[KVCache]]:
    """Grouped-query attention with an explicit cache in and out.

    q: [B, T, H, D]; k, v: [B, T, K, D] for the T new tokens; mask: bool[B, T, S].
    cache None: the keys are the new tokens (S = T). Otherwise the new k/v are written into
    ``cache`` layer ``layer`` at slots [cache_index, cache_index + T) (caller keeps cache_index + T <= S)
    and the queries attend over all S slots of that layer.
    Scores, mask and softmax in float32; returns ([B, T, H, D] in q.dtype, updated cache or None).
    """
    if cache is not None:
        idx = jnp.asarray(cache_index, jnp.int32)
        zero = jnp.zeros((), jnp.int32)
        start = (jnp.asarray(layer, jnp.int32), zero, idx, zero, zero)
        ck = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start)
        cv = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start)
        cache = KVCache(k=ck, v=cv)
        k, v = ck[layer], cv[layer]
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None, :, :], scores * scale, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(q.dtype))
    return out.reshape(B, T, H, D), cache
