"""Device side of the THL: move per-token quantities across vocabularies through chunk ids (jitted, static shapes).

Chunk ids come from :func:`mrl_jax.thl.align_batch` (``int32[B, T]``, ``-1`` on padding). ``num_chunks`` is the
static chunk width ``C`` (``BatchAlignment.max_chunks``); pick it from a few bucket sizes to bound recompiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["chunk_sum", "chunk_mean", "chunk_to_tokens", "chunk_logprob_ratio"]


@functools.partial(jax.jit, static_argnames=("num_chunks",))
def chunk_sum(values: jax.Array, chunk_ids: jax.Array, num_chunks: int) -> jax.Array:
    """``out[b, c] = sum_t values[b, t] * [chunk_ids[b, t] == c]``: f32[B, T], int32[B, T] -> f32[B, C].

    Tokens with a negative chunk id (padding) or an id ``>= num_chunks`` are ignored.
    """
    values = jnp.asarray(values)
    chunk_ids = jnp.asarray(chunk_ids, dtype=jnp.int32)
    B, T = chunk_ids.shape
    C = int(num_chunks)
    ok = (chunk_ids >= 0) & (chunk_ids < C)
    seg = jnp.where(ok, chunk_ids + C * jnp.arange(B, dtype=jnp.int32)[:, None], B * C)
    out = jax.ops.segment_sum(values.reshape(-1), seg.reshape(-1), num_segments=B * C + 1)
    return out[: B * C].reshape(B, C)


@functools.partial(jax.jit, static_argnames=("num_chunks",))
def chunk_mean(values: jax.Array, chunk_ids: jax.Array, num_chunks: int) -> jax.Array:
    """Mean of ``values`` per chunk (0 for chunks without tokens): f32[B, T] -> f32[B, C]."""
    s = chunk_sum(values, chunk_ids, num_chunks)
    n = chunk_sum(jnp.ones_like(values), chunk_ids, num_chunks)
    return s / jnp.maximum(n, 1.0)


@jax.jit
def chunk_to_tokens(chunk_vals: jax.Array, chunk_ids: jax.Array) -> jax.Array:
    """``out[b, t] = chunk_vals[b, chunk_ids[b, t]]`` (0 on padding): f32[B, C], int32[B, T] -> f32[B, T]."""
    chunk_vals = jnp.asarray(chunk_vals)
    chunk_ids = jnp.asarray(chunk_ids, dtype=jnp.int32)
    C = chunk_vals.shape[1]
    ok = (chunk_ids >= 0) & (chunk_ids < C)
    got = jnp.take_along_axis(chunk_vals, jnp.clip(chunk_ids, 0, max(C - 1, 0)), axis=1)
    return jnp.where(ok, got, jnp.zeros((), chunk_vals.dtype))


@functools.partial(jax.jit, static_argnames=("num_chunks",))
def chunk_logprob_ratio(logp_dst: jax.Array, dst_chunk: jax.Array, chunk_logp_src: jax.Array | None = None, *,
                        logp_src: jax.Array | None = None, src_chunk: jax.Array | None = None,
                        num_chunks: int | None = None, chunk_valid: jax.Array | None = None) -> jax.Array:
    """Per-chunk log importance ratio ``log pi_dst(chunk) - log pi_src(chunk)``: f32[B, C].

    ``logp_dst: f32[B, Td]`` with ``dst_chunk: int32[B, Td]``; the source side either as chunk sums
    ``chunk_logp_src: f32[B, C]`` (e.g. stored in the SEE) or as token log-probs ``logp_src: f32[B, Ts]`` with
    ``src_chunk``. ``num_chunks`` defaults to ``chunk_logp_src.shape[1]``. Where ``chunk_valid: bool[B, C]`` is
    False (padding, THL residual) the ratio is 0 (weight 1): mask those chunks in the loss as well.
    """
    if chunk_logp_src is None:
        if logp_src is None or src_chunk is None or num_chunks is None:
            raise ValueError("chunk_logprob_ratio: give chunk_logp_src, or logp_src + src_chunk + num_chunks")
        chunk_logp_src = chunk_sum(logp_src, src_chunk, num_chunks)
    C = chunk_logp_src.shape[1] if num_chunks is None else int(num_chunks)
    if chunk_logp_src.shape[1] != C:
        raise ValueError(f"chunk_logp_src has {chunk_logp_src.shape[1]} chunks, num_chunks={C}")
    ratio = chunk_sum(logp_dst, dst_chunk, C) - chunk_logp_src.astype(jnp.result_type(logp_dst))
    if chunk_valid is not None:
        ratio = jnp.where(chunk_valid, ratio, jnp.zeros((), ratio.dtype))
    return ratio
