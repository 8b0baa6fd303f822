"""Pure helpers of the probes, shared with the bandit lab: importance weights, effective sample size, the GRAFT
compatibility score and gate, the SGT rescue loss."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from mrl_jax.rows import Rows, chunk_sums

WEIGHT_MODES = ("truncate", "clip", "shaping", "none")
_MAX_LOG = 80.0


def importance_weights(logp_dst: jax.Array, logp_src: jax.Array, *, truncate: float = 1.0,
                       mode: str = "truncate", gamma: float = 0.1, stop_gradient: bool = True) -> jax.Array:
    """Importance weights w = pi_dst / pi_src = exp(logp_dst - logp_src), transformed by ``mode``.

    truncate: min(w, truncate) (truncated IS); clip: clip(w, 1/truncate, truncate) (needs truncate >= 1);
    shaping: LUFFY f(w) = w / (w + gamma); none: w. Computed stably in log space; stop-gradient by default.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"mode must be one of {WEIGHT_MODES}, got {mode!r}")
    d = jnp.asarray(logp_dst, jnp.float32) - jnp.asarray(logp_src, jnp.float32)
    if mode == "truncate":
        if truncate <= 0:
            raise ValueError(f"truncate must be > 0, got {truncate}")
        w = jnp.exp(jnp.minimum(d, jnp.log(truncate)))
    elif mode == "clip":
        if truncate < 1:
            raise ValueError(f"mode='clip' clips to [1/truncate, truncate] and needs truncate >= 1, got {truncate}")
        lc = math.log(truncate)
        w = jnp.exp(jnp.clip(d, -lc, lc))
    elif mode == "shaping":
        w = jax.nn.sigmoid(d - jnp.log(gamma))            # = rho / (rho + gamma)
    else:
        w = jnp.exp(jnp.minimum(d, _MAX_LOG))
    return jax.lax.stop_gradient(w) if stop_gradient else w


def effective_sample_size(w: jax.Array, mask: Optional[jax.Array] = None, normalize: bool = True) -> jax.Array:
    """Kish effective sample size (sum w)^2 / sum w^2 over the masked entries; normalize=True divides by
    the count, giving a fraction in (0, 1] (1 = uniform weights). Empty -> 0."""
    w = jnp.asarray(w, jnp.float32)
    m = jnp.ones_like(w) if mask is None else jnp.asarray(mask, jnp.float32)
    s1, s2, n = jnp.sum(w * m), jnp.sum(w * w * m), jnp.sum(m)
    ess = jnp.where(s2 > 0, s1 * s1 / jnp.maximum(s2, 1e-30), 0.0)
    return jnp.where(n > 0, ess / jnp.maximum(n, 1.0), 0.0) if normalize else ess


def weight_variance(w: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Variance of the masked weights (population)."""
    w = jnp.asarray(w, jnp.float32)
    m = jnp.ones_like(w) if mask is None else jnp.asarray(mask, jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mu = jnp.sum(w * m) / n
    return jnp.sum(m * (w - mu) ** 2) / n


def compatibility_score(mean_logp_i: jax.Array, mean_logp_j: jax.Array) -> jax.Array:
    """GRAFT compatibility s = exp(mean log pi_i - mean log pi_j) of a peer response (means over its chunks)."""
    return jnp.exp(jnp.minimum(jnp.asarray(mean_logp_i, jnp.float32) - jnp.asarray(mean_logp_j, jnp.float32),
                               _MAX_LOG))


def compatibility_gate(score: jax.Array, delta: float = 0.8) -> tuple[jax.Array, jax.Array]:
    """(admit = s > delta, weight = admit * min(s, 1))."""
    admit = score > delta
    return admit, jnp.where(admit, jnp.minimum(score, 1.0), 0.0)


def sgt_rescue_loss(logp: jax.Array, mask: jax.Array, row_weight: jax.Array, *, lam: float = 0.1,
                    length_normalize: bool = True) -> tuple[jax.Array, jax.Array, dict]:
    """SGT rescue term as (sum, denominator, metrics).

    logp f32[R, T] log pi_i of the rescue tokens y*, mask [R, T], row_weight f32[R] (0 = not a rescue row;
    e.g. the compatibility weight). sum = -lam * sum_r w_r * l_r with l_r = (1/|y*_r|) sum_t log pi
    (length_normalize) or sum_t log pi; denominator = number of rows with w_r > 0, so sum/denominator
    = -lam * mean over rescues.
    """
    m = jnp.asarray(mask, jnp.float32)
    w = jax.lax.stop_gradient(jnp.asarray(row_weight, jnp.float32))
    tok = jnp.sum(jnp.where(m > 0, logp.astype(jnp.float32), 0.0) * m, -1)
    ell = tok / jnp.maximum(jnp.sum(m, -1), 1.0) if length_normalize else tok
    s = -lam * jnp.sum(w * ell)
    d = jnp.sum((w > 0).astype(jnp.float32))
    nll = (-jax.lax.stop_gradient(jnp.sum(w * ell)), jnp.sum(w))
    return s, d, {"sgt/nll": nll}


def peer_compatibility(rows: Rows) -> jax.Array:
    """GRAFT score per row from old_logp (consumer) and src_chunk_logp (source), means over valid chunks."""
    C = rows.src_chunk_logp.shape[1]
    valid = rows.chunk_valid.astype(jnp.float32)
    dst = chunk_sums(rows.old_logp * rows.completion_mask, rows.dst_chunk, C)
    n = jnp.maximum(jnp.sum(valid, -1), 1.0)
    # NB: a row with no valid chunk scores exp(0) = 1 (no evidence either way); PRP masks such rows anyway.
    return compatibility_score(jnp.sum(dst * valid, -1) / n, jnp.sum(rows.src_chunk_logp * valid, -1) / n)
