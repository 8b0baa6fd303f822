"""The GRPO-with-probes objective, written once: the learner wraps it with micro-batching, the bandit lab
calls it directly.

    rows, probe_metrics = prepare(rows, view, key, probe, cfg, peer_logp)     # pre-pass, extend, advantages
    dens = denominators(rows, probe, cfg)                                      # from rows only
    loss, metrics = loss_terms(logp, entropy, rows, probe, cfg, dens)          # differentiable in logp
    loss, metrics = objective(logp_fn, rows, view, key, probe, cfg)            # all three, full batch
    loss, grads, metrics = value_and_grad(forward, params, rows, view, key, probe, cfg, micro_batch_size)

``logp_fn(rows) -> (logp f32[R, Tc], entropy f32[R, Tc])`` scores the rows' completions under the policy
being differentiated. Peer rows' ``old_logp`` is the consumer's current log-prob (no-grad pre-pass), so
their PG ratio is 1. The loss is ``pg_sum / pg_den + sum_k term_sum_k / term_den_k``; ``value_and_grad`` (what
the learner calls) sums the per-micro-batch losses and gradients, which equals the full-batch loss because every
denominator is computed from the full rows — except ``loss_type="bnpo"``, TRL's local normalisation: each
micro-batch's PG term is divided by its own token count and the micro-batches are averaged.

Metrics (sum, count) follow TRL's definitions where the names are TRL's: ``kl``, ``ratio_mean``,
``clip_ratio/*`` and ``entropy`` over the policy's OWN completion tokens; peer rows have their own
``prp/*`` figures. A probe's own PG-like term (PRP's LUFFY shaping) lives in the probe's ``loss_terms``
and shares the PG denominator (its rows keep ``pg_row`` / ``pg_mask``), so the PG term has no probe
branches.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.configs import check, field
from mrl_jax.rows import EMPTY, OWN, PER_ROW, Rows


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO loss options, named as TRL's GRPOConfig."""

    num_generations: int = field(8, help="G: completions sampled per prompt (group size)")
    max_completion_length: int = field(64, help="completion length limit; dr_grpo divides by it (TRL's "
                                                    "default 512; 64 suits the tiny models)")
    epsilon: float = field(0.2, help="lower clip range: ratio clipped below at 1 - epsilon")
    epsilon_high: Optional[float] = field(None, help="upper clip range (DAPO clip-higher); None = epsilon")
    beta: float = field(0.0, help="k3 KL coefficient to the frozen reference; 0 = no reference needed")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = field(
        "grpo", help="TRL's default is dapo; kept grpo here because changing it would change the loss "
                     "of every existing run config (write loss_type: dapo for TRL's). Aggregation: grpo = per-sequence mean then mean over sequences; dapo = token mean over the "
                     "whole batch; bnpo = token mean of each micro-batch, averaged over micro-batches (TRL's "
                     "local normalisation; = dapo with one micro-batch); dr_grpo = token sum / (num_rows * "
                     "max_completion_length)")
    importance_sampling_level: Literal["token", "sequence"] = field(
        "token", help="token ratios, or GSPO sequence ratio exp(mean token log-ratio)")
    scale_rewards: Literal["group", "batch", "none"] = field(
        "group", help="advantage std scaling: group std, batch std, or none (Dr. GRPO)")
    mask_truncated_completions: bool = field(False, help="exclude completions that hit the length limit")
    num_iterations: int = field(1, help="mu: updates per generated batch (pi_old fixed from the batch)")
    temperature: float = field(1.0, help="logits are divided by this before log-softmax (match sampling)")
    reward_eps: float = field(1e-4, help="eps in A = (r - mean) / (std + eps)")
    logprob_chunk_size: int = field(128, help="sequence chunk of the chunked log-softmax (memory bound)")

    def __post_init__(self):
        check(self.num_generations >= 1, "num_generations", f"must be >= 1, got {self.num_generations}")
        check(self.max_completion_length >= 1, "max_completion_length",
              f"must be >= 1, got {self.max_completion_length}")
        check(0.0 <= self.epsilon < 1.0, "epsilon", f"must be in [0, 1), got {self.epsilon}")
        check(self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high",
              f"must be >= 0 or None, got {self.epsilon_high}")
        check(self.beta >= 0.0, "beta", f"must be >= 0, got {self.beta}")
        check(self.loss_type in grpo.LOSS_TYPES, "loss_type", f"must be one of {grpo.LOSS_TYPES}, got {self.loss_type!r}")
        check(self.importance_sampling_level in grpo.IS_LEVELS, "importance_sampling_level",
              f"must be one of {grpo.IS_LEVELS}, got {self.importance_sampling_level!r}")
        check(self.scale_rewards in grpo.SCALES, "scale_rewards",
              f"must be one of {grpo.SCALES}, got {self.scale_rewards!r}")
        check(self.num_iterations >= 1, "num_iterations", f"must be >= 1, got {self.num_iterations}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(self.reward_eps > 0, "reward_eps", f"must be > 0, got {self.reward_eps}")
        check(self.logprob_chunk_size >= 1, "logprob_chunk_size", f"must be >= 1, got {self.logprob_chunk_size}")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class Denominators(NamedTuple):
    pg: jax.Array        # f32[] PG term denominator over the full rows
    terms: jax.Array     # f32[K] probes' loss-term denominators


def prepare(rows: Rows, view, key, probe, cfg: GRPOConfig, peer_logp: Optional[Callable] = None):
    """(rows, probe metrics): truncated rows out of the PG term (``mask_truncated_completions``), peer rows'
    old_logp from ``peer_logp(peer_rows) -> f32[S, Tc]`` (no grad) when the probe needs it, then ``probe.extend``,
    GRPO group advantages of own rows (the run's scale/eps), then ``probe.advantages`` (the pooled advantages a
    chain computed are dropped then: the rows carry the final ``advantages``)."""
    P, G, n_own = rows.num_prompts, rows.num_generations, rows.num_own
    R = rows.num_rows
    if cfg.mask_truncated_completions:   # own rows that hit the length limit leave the PG term
        rows = rows.replace(pg_mask=grpo.truncation_mask(rows.pg_mask, rows.truncated))
    if probe.needs_peers and probe.needs_peer_logp and R > n_own:
        lp = jax.lax.stop_gradient(peer_logp(rows.take(n_own)))
        rows = rows.replace(old_logp=rows.old_logp.at[n_own:].set(lp))
    rows, metrics = probe.extend(rows, view, key)
    own_r = rows.rewards[:n_own].reshape(P, G)
    adv0 = grpo.group_advantages(own_r, cfg.scale_rewards, cfg.reward_eps).reshape(-1)
    adv = jnp.concatenate([adv0, jnp.zeros((R - n_own,), jnp.float32)])
    adv = probe.advantages(rows.rewards, rows, view, adv)
    return rows.replace(advantages=adv, pooled_advantages=None), metrics


def pg_term(logp, rows: Rows, cfg: GRPOConfig):
    """The GRPO policy-gradient term over the rows' PG tokens: (sum, denominator, metrics). KL (beta > 0)
    against own rows' ref_logp (peer rows: none, their k3 is 0); metrics over own tokens."""
    own = (rows.row_kind == OWN)[:, None]
    ref = None
    if cfg.beta != 0.0:
        ref = jnp.where(own, rows.ref_logp, jax.lax.stop_gradient(logp))
    return grpo.policy_loss(logp, rows.old_logp, rows.advantages, rows.pg_mask, epsilon=cfg.epsilon,
                            epsilon_high=cfg.epsilon_high, importance_sampling_level=cfg.importance_sampling_level,
                            beta=cfg.beta, ref_logp=ref, loss_type=cfg.loss_type,
                            max_completion_length=cfg.max_completion_length, weights=rows.pg_weight,
                            row_valid=rows.pg_row, metrics_mask=rows.pg_mask * own)


def denominators(rows: Rows, probe, cfg: GRPOConfig) -> Denominators:
    """Every loss term's denominator from the full rows (they never depend on log-probs)."""
    _, pg_den, _ = pg_term(rows.old_logp, rows, cfg)
    _, t_den, _ = probe.loss_terms(rows.old_logp, rows)
    return Denominators(jax.lax.stop_gradient(jnp.maximum(pg_den, 1e-30)),
                        jax.lax.stop_gradient(jnp.maximum(t_den, 1e-30)))


def loss_terms(logp, entropy, rows: Rows, probe, cfg: GRPOConfig, dens: Denominators, num_micro: int = 1):
    """(loss, (metrics (sum, count), pg)) of ``rows`` (the full batch, or one of ``num_micro`` micro-batches);
    pg: the policy-gradient term's share of the loss (no gradient), reported as ``pg_loss``."""
    s, local_den, m = pg_term(logp, rows, cfg)
    if cfg.loss_type == "bnpo":   # TRL's local normalisation: each micro-batch's own token count
        pg = s / jnp.maximum(jax.lax.stop_gradient(local_den), 1.0) / num_micro
    else:
        pg = s / dens.pg
    ts, _, tm = probe.loss_terms(logp, rows)
    own_tok = rows.completion_mask * (rows.row_kind == OWN)[:, None]
    m = grpo.merge_metrics(m, tm)
    m["entropy"] = (jnp.sum(jax.lax.stop_gradient(entropy) * own_tok), jnp.sum(own_tok))
    return pg + jnp.sum(ts / dens.terms), (m, jax.lax.stop_gradient(pg))


def objective(logp_fn: Callable, rows: Rows, view, key, probe, cfg: GRPOConfig):
    """Full-batch GRPO-with-probes loss and reduced metrics; differentiable through ``logp_fn``."""
    rows, probe_metrics = prepare(rows, view, key, probe, cfg, lambda r: logp_fn(r)[0])
    dens = denominators(rows, probe, cfg)
    logp, ent = logp_fn(rows)
    loss, (m, _) = loss_terms(logp, ent, rows, probe, cfg, dens)
    return loss, grpo.reduce_metrics(grpo.merge_metrics(m, probe_metrics))


# ----------------------------------------------------------------------------- micro-batch accumulation

class MicroBatchPlan(NamedTuple):
    """How ``value_and_grad`` walks R rows (P*G own first): ``main`` rows in micro-batches of ``size``
    (``group`` G > 1: each micro-batch holds whole prompt groups), then the peer rows compacted into chunks of
    ``peer_chunk``. bnpo (a per-micro-batch token mean) keeps the padded layout: own ++ peer rows together."""
    main: int
    size: int
    peer_chunk: int
    group: int

    @classmethod
    def of(cls, rows: Rows, cfg: GRPOConfig, micro_batch_size: int = 0) -> "MicroBatchPlan":
        R, n_own, G = rows.num_rows, rows.num_own, rows.num_generations
        main = R if cfg.loss_type == "bnpo" else n_own
        size = main if micro_batch_size == 0 else min(micro_batch_size, main)
        chunk = peer_chunk_rows(R - n_own, micro_batch_size) if R > n_own else 0
        return cls(main, size, chunk, G if main == n_own and size % G == 0 else 1)


def peer_chunk_rows(num_peer_rows: int, micro_batch_size: int) -> int:
    """Rows per chunk of the compacted peer slots: the micro-batch size, else an eighth of the slots
    (at least 8), so the computed rows follow the used slots in steps of a chunk."""
    if micro_batch_size:
        return min(micro_batch_size, num_peer_rows)
    return min(num_peer_rows, max(8, -(-num_peer_rows // 8)))


def carries_weight(rows: Rows) -> jax.Array:
    """bool[R]: the row enters some loss term — PG tokens (pg_row and pg_mask), an SFT weight or an aux
    weight. A row with none of them adds nothing to any term's sum, gradient or metric (the probes'
    contract), so it is not computed."""
    pg = (rows.pg_row > 0) & jnp.any(rows.pg_mask > 0, axis=1)
    return pg | (rows.sft_weight != 0) | jnp.any(rows.aux_weight != 0, axis=1)


def split_rows(rows: Rows, size: int) -> dict:
    """{per-row field: [n, size, ...]}, padded with inactive rows (masks 0, kind EMPTY, a valid prompt mask so
    that their forward is finite). ``rows.replace(**block)`` of one block is a Rows again."""
    R = rows.num_rows
    pad = -(-R // size) * size - R
    out = {}
    for f in PER_ROW:
        a = getattr(rows, f)
        if pad:
            fill = -1 if f in ("row_kind", "dst_chunk") else (1 if f == "prompt_mask" else 0)
            a = jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)], 0)
        out[f] = a.reshape((-1, size) + a.shape[1:])
    return out


def _compacted(rows: Rows, keep: jax.Array, chunk: int):
    """({field: [n, chunk, ...]} with the kept rows first (stable order), live bool[n] (a chunk holds a kept
    row), order int32[R] (position -> original row))."""
    order = jnp.argsort(~keep, stable=True)
    split = split_rows(rows.replace(**{f: getattr(rows, f)[order] for f in PER_ROW}), chunk)
    kept = jnp.pad(keep[order], (0, split["rewards"].shape[0] * chunk - keep.shape[0]))
    return split, jnp.any(kept.reshape(-1, chunk), axis=1), order


def _first(split: dict) -> dict:
    return jax.tree.map(lambda a: a[0], split)


def _peer_logp(forward: Callable, peers: Rows, chunk: int) -> jax.Array:
    """f32[S, Tc]: the no-grad pre-pass over the peer rows, chunks without a filled slot skipped."""
    split, live, order = _compacted(peers, peers.row_kind != EMPTY, chunk)
    zeros = jnp.zeros((chunk,) + peers.completion_ids.shape[1:], jnp.float32)
    lp = jax.lax.map(lambda a: jax.lax.cond(a[1], lambda f: forward(peers.replace(**f), 1)[0], lambda f: zeros,
                                            a[0]), (split, live))
    lp = lp.reshape((-1,) + lp.shape[2:])[: peers.num_rows]
    return jnp.zeros_like(lp).at[order].set(lp)


def value_and_grad(forward: Callable, params, rows: Rows, view, key, probe, cfg: GRPOConfig,
                   micro_batch_size: int = 0):
    """(loss, grads, metrics) of the GRPO-with-probes objective over ``rows``, the gradient accumulated in
    float32 over micro-batches (``MicroBatchPlan``) and handed back in the params' dtypes.

    ``forward(params, rows, group) -> (logp, entropy) f32[B, Tc]`` scores a block of rows (group G > 1: whole
    prompt groups). Cost follows the rows that carry weight: own rows run in micro-batches; peer slots are
    compacted (rows that ``carries_weight`` first) into chunks and a chunk without such a row is skipped
    (``lax.cond``); the no-grad peer pre-pass likewise skips EMPTY slots. The gradient equals the full
    batch's because every denominator comes from the full rows (bnpo: TRL's per-micro-batch token mean).
    metrics: reduced means, ``loss``, ``pg_loss`` and ``rows_computed`` (rows run forward and backward)."""
    plan = MicroBatchPlan.of(rows, cfg, micro_batch_size)
    rows, probe_metrics = prepare(rows, view, key, probe, cfg,
                                  lambda peers: _peer_logp(lambda r, g: forward(params, r, g), peers, plan.peer_chunk))
    dens = denominators(rows, probe, cfg)
    main = split_rows(rows.take(0, plan.main), plan.size)
    n_micro = main["rewards"].shape[0]
    grad_fn = jax.value_and_grad(
        lambda p, r, group: loss_terms(*forward(p, r, group), r, probe, cfg, dens, n_micro), has_aux=True)

    def add(carry, block: dict, group: int = 1):
        g_acc, l_acc, pg_acc, m_acc = carry
        (loss, (m, pg)), g = grad_fn(params, rows.replace(**block), group)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return g_acc, l_acc + loss, pg_acc + pg, jax.tree.map(jnp.add, m_acc, m)

    m_shape = jax.eval_shape(lambda: grad_fn(params, rows.replace(**_first(main)), 1)[0][1][0])
    carry = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params), jnp.float32(0.0), jnp.float32(0.0),
             jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape))
    if n_micro == 1:   # no loop around a single micro-batch
        carry = add(carry, _first(main), plan.group)
    else:
        carry, _ = jax.lax.scan(lambda c, b: (add(c, b, plan.group), None), carry, main)
    computed = jnp.float32(n_micro * plan.size)
    peers = rows.take(plan.main)
    if peers.num_rows:
        split, live, _ = _compacted(peers, carries_weight(peers), plan.peer_chunk)
        carry, _ = jax.lax.scan(lambda c, a: (jax.lax.cond(a[1], add, lambda c_, b: c_, c, a[0]), None),
                                carry, (split, live))
        computed = computed + plan.peer_chunk * jnp.sum(live.astype(jnp.float32))
    grads, loss, pg_loss, msum = carry
    metrics = grpo.reduce_metrics(grpo.merge_metrics(msum, probe_metrics))
    metrics.update(batch_metrics(rows))
    metrics.update({"loss": loss, "pg_loss": pg_loss, "rows_computed": computed})
    metrics.setdefault("kl", jnp.float32(0.0))
    return loss, jax.tree.map(lambda g, x: g.astype(x.dtype), grads, params), metrics


def batch_metrics(rows: Rows) -> dict:
    """Figures of the batch's own rows. reward_std as TRL's (mean over prompts of the group std, ddof=1);
    reward_std_batch: std over every own reward."""
    P, G = rows.num_prompts, rows.num_generations
    own_r = rows.rewards[:P * G].reshape(P, G)
    std_g = jnp.std(own_r, axis=1, ddof=1) if G > 1 else jnp.zeros((P,), jnp.float32)
    own_row = (rows.row_kind == OWN).astype(jnp.float32)
    return {"reward_mean": jnp.mean(own_r), "reward_std": jnp.mean(std_g), "reward_std_batch": jnp.std(own_r),
            "frac_reward_zero_std": jnp.mean((std_g < 1e-8).astype(jnp.float32)),
            "adv_abs_mean": jnp.sum(jnp.abs(rows.advantages) * own_row) / (P * G),
            "num_tokens": jnp.sum(rows.pg_mask * own_row[:, None]), "pg_rows": jnp.sum(rows.pg_row)}
