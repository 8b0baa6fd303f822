"""Blockwise (flash-style) attention: online softmax over key blocks, a recomputing backward, no T x S array.

Shapes: B rows, T queries, S keys, H query heads, K kv heads (H % K == 0, g = H // K), D head dim.
The mask is structural, given by slots: query t of any row sits at slot ``q_slot[t]``, key s at ``k_slot[s]``;
query t sees key s iff ``kv_valid[b, s]``, ``k_slot[s] <= q_slot[t]`` and, with a sliding window,
``k_slot[s] > q_slot[t] - window``. That covers causal attention with left/right padding, Mistral / Gemma
sliding windows and the prompt-shared layout (a completion's keys are its prompt's slots then its own).

Forward: for each query block (``lax.map``), a ``lax.scan`` over key blocks keeps the running max, normaliser
and output. Every block pair is computed, masked ones too: a ``lax.cond`` skip of the causally hidden blocks
made XLA:CPU keep a [B, H, T, S]-sized buffer once the layer ran inside remat's ``lax.scan`` over layers
(3.1x the temporaries at 2 layers x 2048 tokens). Backward (``jax.custom_vjp``): the scores of each block pair
are recomputed from q, k and the saved log-normaliser, so the residuals are q, k, v, the output and one float32 per query and head. Memory is
O(B * H * (T + S) * D) plus one [B, H, block_q, block_k] score block. Scores, softmax and accumulators are
float32; matmul inputs are the compute dtype.
A query that sees no key at all (a left-padding position) gives zeros and passes no gradient.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

BLOCK = 512          # default query / key block
_FAR = 2 ** 30       # slot of a padding key: after every query


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_slot: jax.Array, k_slot: jax.Array,
                        kv_valid: jax.Array, *, scale: float, window: Optional[int] = None,
                        softcap: Optional[float] = None, block_q: Optional[int] = None,
                        block_k: Optional[int] = None) -> jax.Array:
    """q [B, T, H, D]; k, v [B, S, K, D]; q_slot int32[T]; k_slot int32[S]; kv_valid bool[B, S].

    softcap: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2); block_q / block_k:
    block sizes (default ``BLOCK``; a block over a short axis is that axis). Returns [B, T, H, D] in q.dtype."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    g = H // K
    bq, bk = min(block_q or BLOCK, T), min(block_k or BLOCK, S)
    nq, nk = -(-T // bq), -(-S // bk)
    pq, pk = nq * bq - T, nk * bk - S
    dt = q.dtype
    qs = jnp.pad(jnp.asarray(q_slot, jnp.int32), (0, pq), mode="edge").reshape(nq, bq)
    ks = jnp.pad(jnp.asarray(k_slot, jnp.int32), (0, pk), constant_values=_FAR).reshape(nk, bk)
    valid = jnp.pad(jnp.asarray(kv_valid, bool), ((0, 0), (0, pk))).reshape(B, nk, bk).swapaxes(0, 1)
    qb = jnp.pad(q, ((0, 0), (0, pq), (0, 0), (0, 0))).reshape(B, nq, bq, K, g, D).swapaxes(0, 1)
    kb, vb = (jnp.pad(x.astype(dt), ((0, 0), (0, pk), (0, 0), (0, 0))).reshape(B, nk, bk, K, D).swapaxes(0, 1)
              for x in (k, v))
    opts = (float(scale), None if window is None else int(window), None if softcap is None else float(softcap))
    out = _flash(qb, kb, vb, qs, ks, valid, opts)                 # [nq, B, bq, K, g, D]
    return out.swapaxes(0, 1).reshape(B, nq * bq, H, D)[:, :T]


def _scores(qi, kj, qs, ks, valid, opts):
    """(capped scores, masked scores) f32[B, K, g, bq, bk]; masked entries -inf."""
    scale, window, cap = opts
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    allowed = ks[None, :] <= qs[:, None]
    if window is not None:
        allowed = allowed & (ks[None, :] > qs[:, None] - window)
    mask = valid[:, None, None, None, :] & allowed[None, None, None]
    return s, jnp.where(mask, s, -jnp.inf)


def _forward_block(qi, qs, k, v, ks, valid, opts):
    """One query block qi [B, bq, K, g, D] over every key block -> (out [B, bq, K, g, D], lse f32[B, K, g, bq])."""
    B, bq, K, g, D = qi.shape

    def step(carry, kv):
        kj, vj, ksj, vl = kv

        def compute(c):
            m, l, acc = c
            _, s = _scores(qi, kj, qs, ksj, vl, opts)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(qi.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

        return compute(carry), None

    init = (jnp.full((B, K, g, bq), -jnp.inf, jnp.float32), jnp.zeros((B, K, g, bq), jnp.float32),
            jnp.zeros((B, K, g, bq, D), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (k, v, ks, valid))
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out.transpose(0, 3, 1, 2, 4).astype(qi.dtype), lse


def _fwd(q, k, v, qs, ks, valid, opts):
    out, lse = jax.lax.map(lambda a: _forward_block(a[0], a[1], k, v, ks, valid, opts), (q, qs))
    return out, (q, k, v, qs, ks, valid, out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, qs, ks, valid, opts):
    """q [nq, B, bq, K, g, D]; k, v [nk, B, bk, K, D]; qs int32[nq, bq]; ks int32[nk, bk]; valid bool[nk, B, bk]."""
    return _fwd(q, k, v, qs, ks, valid, opts)[0]


def _flash_fwd(q, k, v, qs, ks, valid, opts):
    return _fwd(q, k, v, qs, ks, valid, opts)


def _backward_block(qi, qs, doi, lse, delta, k, v, ks, valid, opts):
    """Gradients of one query block: (dq [B, bq, K, g, D], dk, dv [nk, B, bk, K, D]) in float32."""
    scale, _, cap = opts
    dt = qi.dtype
    do = doi.transpose(0, 2, 3, 1, 4)                               # [B, K, g, bq, D]

    def step(dq, kv):
        kj, vj, ksj, vl = kv

        def compute(dq):
            s_cap, s = _scores(qi, kj, qs, ksj, vl, opts)
            p = jnp.exp(s - lse[..., None])
            dv = jnp.einsum("bkgqs,bkgqd->bskd", p.astype(dt), do, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bskd->bkgqs", do, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None])
            if cap is not None:
                ds = ds * (1.0 - jnp.square(s_cap / cap))
            ds = (ds * scale).astype(dt)
            dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
            dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32)
            return dq, (dk, dv)

        return compute(dq)

    return jax.lax.scan(step, jnp.zeros(qi.shape, jnp.float32), (k, v, ks, valid))


def _flash_bwd(opts, res, dout):
    q, k, v, qs, ks, valid, out, lse = res
    delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def one(carry, a):
        dq, (dk, dv) = _backward_block(*a, k, v, ks, valid, opts)
        return (carry[0] + dk, carry[1] + dv), dq

    zeros = jnp.zeros(k.shape, jnp.float32)
    (dk, dv), dq = jax.lax.scan(one, (zeros, zeros), (q, qs, dout.astype(q.dtype), lse, delta))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
