"""The GRPO-with-probes objective, written once: the learner wraps it with micro-batching, the bandit lab
calls it directly.

    rows, probe_metrics = prepare(rows, view, key, probe, cfg, peer_logp)     # pre-pass, extend, advantages
    dens = denominators(rows, probe, cfg)                                      # from rows only
    loss, metrics = loss_terms(logp, entropy, rows, probe, cfg, dens)          # differentiable in logp
    loss, metrics = objective(logp_fn, rows, view, key, probe, cfg)            # all three, full batch

``logp_fn(rows) -> (logp f32[R, Tc], entropy f32[R, Tc])`` scores the rows' completions under the policy
being differentiated. Peer rows' ``old_logp`` is the consumer's current log-prob (no-grad pre-pass), so
their PG ratio is 1. The loss is ``pg_sum / pg_den + sum_k term_sum_k / term_den_k``; with micro-batches the
learner sums the per-micro-batch losses, which equals the full-batch loss because every denominator is
computed from the full rows — except ``loss_type="bnpo"``, TRL's local normalisation: each micro-batch's
PG term is divided by its own token count and the micro-batches are averaged.

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
from mrl_jax.rows import OWN, Rows


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
    """(rows, probe metrics): peer rows' old_logp from ``peer_logp(peer_rows) -> f32[S, Tc]`` (no grad) when
    the probe needs it, then ``probe.extend``, GRPO group advantages of own rows (the run's scale/eps), then
    ``probe.advantages``."""
    P, G, n_own = rows.num_prompts, rows.num_generations, rows.num_own
    R = rows.num_rows
    if probe.needs_peers and probe.needs_peer_logp and R > n_own:
        lp = jax.lax.stop_gradient(peer_logp(rows.take(n_own)))
        rows = rows.replace(old_logp=rows.old_logp.at[n_own:].set(lp))
    rows, metrics = probe.extend(rows, view, key)
    own_r = rows.rewards[:n_own].reshape(P, G)
    adv0 = grpo.group_advantages(own_r, cfg.scale_rewards, cfg.reward_eps).reshape(-1)
    adv = jnp.concatenate([adv0, jnp.zeros((R - n_own,), jnp.float32)])
    adv = probe.advantages(rows.rewards, rows, view, adv)
    return rows.replace(advantages=adv), metrics


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
    """(loss, metrics (sum, count)) of ``rows`` (the full batch, or one of ``num_micro`` micro-batches)."""
    s, local_den, m = pg_term(logp, rows, cfg)
    if cfg.loss_type == "bnpo":
        pg = s / jnp.maximum(jax.lax.stop_gradient(local_den), 1.0) / num_micro
    else:
        pg = s / dens.pg
    ts, _, tm = probe.loss_terms(logp, rows)
    own_tok = rows.completion_mask * (rows.row_kind == OWN)[:, None]
    m = grpo.merge_metrics(m, tm)
    m["entropy"] = (jnp.sum(jax.lax.stop_gradient(entropy) * own_tok), jnp.sum(own_tok))
    m["pg_loss"] = (jax.lax.stop_gradient(pg), jnp.float32(0.0))
    return pg + jnp.sum(ts / dens.terms), m


def objective(logp_fn: Callable, rows: Rows, view, key, probe, cfg: GRPOConfig):
    """Full-batch GRPO-with-probes loss and reduced metrics; differentiable through ``logp_fn``."""
    rows, probe_metrics = prepare(rows, view, key, probe, cfg, lambda r: logp_fn(r)[0])
    dens = denominators(rows, probe, cfg)
    logp, ent = logp_fn(rows)
    loss, m = loss_terms(logp, ent, rows, probe, cfg, dens)
    m.pop("pg_loss")
    return loss, grpo.reduce_metrics(grpo.merge_metrics(m, probe_metrics))
