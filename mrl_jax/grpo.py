"""GRPO math: log-probs, advantages, the clipped surrogate, k3 KL and the loss aggregations.

Pure ``jax.numpy`` functions, no model code. Everything inside the loss is float32.

Loss functions return ``(loss_sum, denominator, metrics)`` instead of a mean: summing ``loss_sum`` and
``denominator`` over micro-batches and dividing once gives the exact full-batch value for every
aggregation (``grpo``: mean over rows of the per-row token mean; ``dapo``/``bnpo``: global token mean;
``dr_grpo``: token sum / (num_rows * max_completion_length)). Denominators never depend on the
log-probs being differentiated, so a learner can compute them first and accumulate gradients of
``loss_sum / denominator`` per micro-batch.

``metrics`` is a dict ``name -> (sum, count)``; summing over micro-batches and dividing gives exact means.

    adv = group_advantages(rewards)                       # f32[P, G]
    logp = chunked_token_logprobs(hidden, model.head, targets, chunk_size=128)   # f32[B, T]
    s, d, m = policy_loss(logp, old_logp, adv.reshape(-1), mask, epsilon=0.2, loss_type="dapo")
    loss = s / d
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

SCALES = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
IS_LEVELS = ("token", "sequence")
# the columns of a group's sufficient statistics f32[..., 4] (SEE's GroupStats, ``pooled_advantages_from_stats``)
STAT_COUNT, STAT_REWARD_SUM, STAT_REWARD_SQ_SUM, STAT_SUCCESSES = 0, 1, 2, 3


def normalize_scale(scale) -> str:
    """A ``scale_rewards`` value as one of ``SCALES`` (True = group, False / None = none)."""
    if scale is True:
        return "group"
    if scale is False or scale is None:
        return "none"
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES} (or True/False), got {scale!r}")
    return scale


# ----------------------------------------------------------------------------- log-probs

def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets] in float32. logits f32[..., V], targets int32[...] -> f32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position, float32. f32[..., V] -> f32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def chunked_token_stats(hidden: jax.Array, head_fn: Callable[[jax.Array], jax.Array], targets: jax.Array,
                        chunk_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """Token log-probs and entropies without materialising the float32 [B, T, V] log-softmax.

    hidden: [B, T, D] (hidden state that predicts ``targets``), head_fn: [..., D] -> logits [..., V],
    targets: int32[B, T]. Returns (logp f32[B, T], entropy f32[B, T]).
    The sequence axis is cut into chunks of ``chunk_size``; each chunk's head + log-softmax runs under
    ``jax.checkpoint`` inside ``lax.map``, so forward and backward hold one [B, chunk, V] block at a time.
    """
    B, T, D = hidden.shape
    cs = int(max(1, min(chunk_size, T)))
    n = -(-T // cs)
    pad = n * cs - T
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = hidden.reshape(B, n, cs, D).swapaxes(0, 1)           # [n, B, cs, D]
    ts = targets.reshape(B, n, cs).swapaxes(0, 1).astype(jnp.int32)

    @jax.checkpoint
    def one(args):
        h, t = args
        logits = head_fn(h).astype(jnp.float32)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        p = jnp.exp(logits - logz[..., None])
        ent = logz - jnp.sum(p * logits, axis=-1)
        return picked - logz, ent

    if n == 1:
        lp, ent = one((hs[0], ts[0]))
        lp, ent = lp[None], ent[None]
    else:
        lp, ent = jax.lax.map(one, (hs, ts))
    lp = lp.swapaxes(0, 1).reshape(B, n * cs)[:, :T]
    ent = ent.swapaxes(0, 1).reshape(B, n * cs)[:, :T]
    return lp, ent


def chunked_token_logprobs(hidden: jax.Array, head_fn: Callable[[jax.Array], jax.Array], targets: jax.Array,
                           chunk_size: int = 128) -> jax.Array:
    """log pi(targets) f32[B, T] from hidden [B, T, D] and head_fn, chunked over T (see chunked_token_stats)."""
    return chunked_token_stats(hidden, head_fn, targets, chunk_size)[0]


# ----------------------------------------------------------------------------- advantages

def _unbiased_std(x, w, axis):
    """Weighted std with reliability weights; equals ddof=1 std for 0/1 weights. Zero when < 2 samples."""
    v1 = jnp.sum(w, axis=axis, keepdims=True)
    v2 = jnp.sum(w * w, axis=axis, keepdims=True)
    mean = jnp.sum(w * x, axis=axis, keepdims=True) / jnp.maximum(v1, 1e-30)
    ss = jnp.sum(w * (x - mean) ** 2, axis=axis, keepdims=True)
    den = v1 - v2 / jnp.maximum(v1, 1e-30)
    ok = den > 1e-12
    return mean, jnp.where(ok, jnp.sqrt(jnp.maximum(ss, 0.0) / jnp.where(ok, den, 1.0)), 0.0)


def _scaled(centered: jax.Array, scale: str, eps: float, group_std: jax.Array, batch_std: Callable) -> jax.Array:
    """The advantage scaling of every estimator: centered / (std + eps) with the group's std ("group") or the
    batch's (``batch_std()``, "batch"), or centered as it is ("none", Dr. GRPO)."""
    if scale == "group":
        return centered / (group_std + eps)
    if scale == "batch":
        return centered / (batch_std() + eps)
    return centered


def group_advantages(rewards: jax.Array, scale="group", eps: float = 1e-4,
                     mask: Optional[jax.Array] = None) -> jax.Array:
    """GRPO advantages. rewards f32[P, G] -> f32[P, G].

    A = (r - mean_g r) / (std + eps). scale: "group" (std over the group, ddof=1 as TRL/torch.std),
    "batch" (group mean, std over all rewards of the batch, ddof=1, as TRL scale_rewards="batch"),
    "none" (no division: Dr. GRPO). G = 1 or zero std gives numerator / eps = 0.
    mask: optional f32/bool[P, G], 1 = real sample; masked entries are ignored and get advantage 0.
    """
    scale = normalize_scale(scale)
    r = jnp.asarray(rewards, jnp.float32)
    w = jnp.ones_like(r) if mask is None else jnp.asarray(mask, jnp.float32)
    mean, std = _unbiased_std(r, w, axis=-1)
    return _scaled(r - mean, scale, eps, std, lambda: _unbiased_std(r.reshape(-1), w.reshape(-1), axis=0)[1]) * w


def capability_weights(rewards: jax.Array, mask: Optional[jax.Array] = None, threshold: Optional[float] = None,
                       floor: float = 1e-3) -> jax.Array:
    """HACPO peer weights f32[N]: each policy's success rate on the batch relative to the mean rate.

    rewards f32[N, P, G]; success = reward (threshold None; for 0/1 rewards) or reward >= threshold.
    w_n = (rate_n + floor) / mean_m (rate_m + floor), so equal policies get weight 1.
    """
    r = jnp.asarray(rewards, jnp.float32)
    w = jnp.ones_like(r) if mask is None else jnp.asarray(mask, jnp.float32)
    s = r if threshold is None else (r >= threshold).astype(jnp.float32)
    rate = jnp.sum(s * w, axis=(1, 2)) / jnp.maximum(jnp.sum(w, axis=(1, 2)), 1.0) + floor
    return rate / jnp.mean(rate)


def pooled_advantages(rewards: jax.Array, scale="group", eps: float = 1e-4,
                      peer_weights: Optional[jax.Array] = None, mask: Optional[jax.Array] = None) -> jax.Array:
    """XGRPO advantages. rewards f32[N, P, G] -> f32[N, P, G].

    Baseline and std for prompt p pooled over all N*G rewards of p: A_{n,p,g} = (r - b_p) / (s_p + eps),
    std unbiased (ddof=1). scale as in group_advantages ("batch": std over every reward).
    peer_weights: optional f32[N] or f32[N, P] (HACPO, e.g. ``capability_weights(rewards)``): each policy's
    rewards enter the pooled mean/std with that weight (reliability weights, so all-ones == unweighted).
    With N = 1 this equals group_advantages.
    """
    scale = normalize_scale(scale)
    r = jnp.asarray(rewards, jnp.float32)
    N, P, G = r.shape
    m = jnp.ones_like(r) if mask is None else jnp.asarray(mask, jnp.float32)
    w = m
    if peer_weights is not None:
        pw = jnp.asarray(peer_weights, jnp.float32)
        pw = pw[:, None, None] if pw.ndim == 1 else pw[:, :, None]
        w = m * pw
    rp = r.transpose(1, 0, 2).reshape(P, N * G)
    wp = w.transpose(1, 0, 2).reshape(P, N * G)
    mean, std = _unbiased_std(rp, wp, axis=-1)
    adv = _scaled(rp - mean, scale, eps, std, lambda: _unbiased_std(rp.reshape(-1), wp.reshape(-1), axis=0)[1])
    return adv.reshape(P, N, G).transpose(1, 0, 2) * m


def pooled_advantages_from_stats(rewards: jax.Array, prompt_slot: jax.Array, own: jax.Array,
                                 peer_stats: jax.Array, *, scale="group", eps: float = 1e-4,
                                 capability_weighted: bool = False, tau: float = 1.0,
                                 floor: float = 1e-3) -> jax.Array:
    """XGRPO advantages of rows from sufficient statistics (what SEE's GroupStats hold).

    rewards f32[R], prompt_slot int32[R] (0..P-1), own bool[R] (the consumer's own samples, pooled from
    their rewards), peer_stats f32[P, N, 4] = (count, sum r, sum r^2, successes) of every other policy on
    each prompt (the consumer's column zero). Returns A_r = (r - b_p) / (s_p + eps), b and s (unbiased)
    pooled over own rows and all peers' stats of the row's prompt; equals ``pooled_advantages`` on the
    same samples. capability_weighted (HACPO): reliability weights = each policy's success rate
    (r >= tau) relative to the mean rate of the policies present (``capability_weights``).
    """
    scale = normalize_scale(scale)
    P = peer_stats.shape[0]
    o = own.astype(jnp.float32)
    r = rewards.astype(jnp.float32)
    seg = lambda x: jax.ops.segment_sum(x * o, prompt_slot, num_segments=P)
    c_o, s_o, q_o = seg(jnp.ones_like(r)), seg(r), seg(r * r)
    st = peer_stats.astype(jnp.float32)
    c_n, s_n, q_n, k_n = (st[..., STAT_COUNT], st[..., STAT_REWARD_SUM], st[..., STAT_REWARD_SQ_SUM],
                          st[..., STAT_SUCCESSES])
    if capability_weighted:
        own_rate = jnp.sum(o * (r >= tau)) / jnp.maximum(jnp.sum(o), 1.0) + floor
        peer_rate = jnp.sum(k_n, 0) / jnp.maximum(jnp.sum(c_n, 0), 1.0) + floor      # [N]
        present = (jnp.sum(c_n, 0) > 0).astype(jnp.float32)
        mean_rate = (own_rate + jnp.sum(peer_rate * present)) / (1.0 + jnp.sum(present))
        w_o, w_n = own_rate / mean_rate, (peer_rate / mean_rate)[None, :]
    else:
        w_o, w_n = 1.0, jnp.ones_like(c_n)
    V1 = w_o * c_o + jnp.sum(w_n * c_n, -1)
    V2 = w_o * w_o * c_o + jnp.sum(w_n * w_n * c_n, -1)
    S1 = w_o * s_o + jnp.sum(w_n * s_n, -1)
    Q = w_o * q_o + jnp.sum(w_n * q_n, -1)

    def mean_std(v1, v2, s1, q):
        mean = s1 / jnp.maximum(v1, 1e-30)
        den = v1 - v2 / jnp.maximum(v1, 1e-30)
        ok = den > 1e-12
        return mean, jnp.where(ok, jnp.sqrt(jnp.maximum(q - mean * mean * v1, 0.0) / jnp.where(ok, den, 1.0)), 0.0)

    mean, std = mean_std(V1, V2, S1, Q)
    return _scaled(r - mean[prompt_slot], scale, eps, std[prompt_slot],
                   lambda: mean_std(jnp.sum(V1), jnp.sum(V2), jnp.sum(S1), jnp.sum(Q))[1])


# ----------------------------------------------------------------------------- loss

def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    return jnp.exp(d) - d - 1.0


def policy_shaping(rho: jax.Array, gamma: float = 0.1) -> jax.Array:
    """LUFFY policy shaping f(rho) = rho / (rho + gamma)."""
    return rho / (rho + gamma)


def aggregate(per_token: jax.Array, mask: jax.Array, loss_type: str = "grpo",
              max_completion_length: Optional[int] = None,
              row_valid: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
    """(sum, denominator) of a per-token quantity f32[B, T] for a TRL loss_type.

    grpo:  sum_rows (sum_t x*m / max(sum_t m, 1)), denom = number of valid rows.
    dapo/bnpo: sum x*m, denom = sum m (token mean; the objective gives bnpo its TRL meaning by using the
    tokens of each micro-batch, dapo those of the whole batch).
    dr_grpo: sum x*m, denom = num valid rows * max_completion_length (default T).
    row_valid f32/bool[B]: rows that count in grpo/dr_grpo denominators (default: all rows).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    m = mask.astype(jnp.float32)
    rv = jnp.ones(m.shape[0], jnp.float32) if row_valid is None else row_valid.astype(jnp.float32)
    x = jnp.where(m > 0, per_token.astype(jnp.float32), 0.0) * m
    if loss_type == "grpo":
        s = jnp.sum(rv * jnp.sum(x, -1) / jnp.maximum(jnp.sum(m, -1), 1.0))
        return s, jnp.sum(rv)
    if loss_type == "dr_grpo":
        L = m.shape[-1] if max_completion_length is None else max_completion_length
        return jnp.sum(x * rv[:, None]), jnp.sum(rv) * float(L)
    return jnp.sum(x * rv[:, None]), jnp.sum(m * rv[:, None])


def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                epsilon: float = 0.2, epsilon_high: Optional[float] = None,
                importance_sampling_level: str = "token", beta: float = 0.0,
                ref_logp: Optional[jax.Array] = None, loss_type: str = "grpo",
                max_completion_length: Optional[int] = None,
                weights: Optional[jax.Array] = None, row_valid: Optional[jax.Array] = None,
                metrics_mask: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, dict]:
    """Clipped GRPO surrogate (+ beta * k3 KL), as unreduced (loss_sum, denominator, metrics).

    logp, old_logp: f32[B, T] (logp differentiable); advantages f32[B] or f32[B, T]; mask f32/bool[B, T].
    ratio rho = exp(logp - old_logp) per token, or per sequence (importance_sampling_level="sequence",
    GSPO: exp of the masked mean token log-ratio, broadcast over the row). Per token:
        loss_t = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta * kl_k3(logp, ref_logp)
    epsilon_high defaults to epsilon. beta = 0 needs no ref_logp.
    weights: optional f32[B, T] or f32[B] (stop-gradient) multiplying loss_t (probe row/importance weights).
    row_valid: rows counted in grpo/dr_grpo denominators (see ``aggregate``).
    Metrics (sum, count) over ``metrics_mask`` (default: mask; e.g. own tokens only, as TRL's): kl,
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, ratio_mean.
    """
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got {importance_sampling_level!r}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (log-probs of the frozen reference policy)")
    eps_low = float(epsilon)
    eps_high = eps_low if epsilon_high is None else float(epsilon_high)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    m = mask.astype(jnp.float32)
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    if adv.ndim == 1:
        adv = adv[:, None]
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = (jnp.sum(log_ratio * m, -1) / jnp.maximum(jnp.sum(m, -1), 1.0))[:, None]
    # mask out padding before exp so garbage in padded positions cannot create inf * 0 = nan
    log_ratio = jnp.where(m > 0, log_ratio, 0.0) if log_ratio.shape == m.shape else log_ratio
    coef1 = jnp.exp(log_ratio)
    coef2 = jnp.clip(coef1, 1.0 - eps_low, 1.0 + eps_high)
    obj = jnp.minimum(coef1 * adv, coef2 * adv)
    per_token = -jnp.broadcast_to(obj, m.shape)
    mm = m if metrics_mask is None else metrics_mask.astype(jnp.float32)
    metrics = {}
    if beta != 0.0:
        kl = kl_k3(logp, jax.lax.stop_gradient(ref_logp.astype(jnp.float32)))
        kl = jnp.where(m > 0, kl, 0.0)
        per_token = per_token + beta * kl
        metrics["kl"] = (jnp.sum(kl * mm), jnp.sum(mm))
    if weights is not None:
        w = jax.lax.stop_gradient(jnp.asarray(weights, jnp.float32))
        per_token = per_token * (w[:, None] if w.ndim == 1 else w)
    s, d = aggregate(per_token, m, loss_type, max_completion_length, row_valid)
    cb = jnp.broadcast_to(coef1, m.shape)
    ab = jnp.broadcast_to(adv, m.shape)
    low = ((cb < 1.0 - eps_low) & (ab < 0)).astype(jnp.float32)
    high = ((cb > 1.0 + eps_high) & (ab > 0)).astype(jnp.float32)
    n = jnp.sum(mm)
    metrics.update({
        "clip_ratio/low_mean": (jnp.sum(low * mm), n),
        "clip_ratio/high_mean": (jnp.sum(high * mm), n),
        "clip_ratio/region_mean": (jnp.sum(jnp.maximum(low, high) * mm), n),
        "ratio_mean": (jax.lax.stop_gradient(jnp.sum(cb * mm)), n),
    })
    return s, d, metrics


def truncation_mask(mask: jax.Array, truncated: jax.Array) -> jax.Array:
    """mask_truncated_completions: zero the completion mask of rows that hit the length limit (no EOS)."""
    return mask * (1 - truncated.astype(mask.dtype))[:, None]


def merge_metrics(a: dict, b: dict) -> dict:
    """Sum two (sum, count) metric dicts key-wise."""
    out = dict(a)
    for k, v in b.items():
        out[k] = (out[k][0] + v[0], out[k][1] + v[1]) if k in out else v
    return out


def reduce_metrics(metrics: dict) -> dict:
    """(sum, count) -> sum / max(count, 1e-30) (count 0 gives 0)."""
    return {k: jnp.where(c > 0, s / jnp.maximum(c, 1e-30), 0.0) for k, (s, c) in metrics.items()}
