"""Sampled (Monte Carlo) updates: one MRL round on the bandit, run through the library's probe code.

Each round every policy draws G arms per context from its min-p sampler; the verifier pays Bernoulli(q).
For consumer i the round becomes exactly what the LLM learner sees (``mrl_jax.probes.Rows``): own rows
(P = C prompts x G, one "token" = the arm) followed by a peer view with (N-1)*G slots per prompt holding
every peer's rollouts (kind PEER). THL is one chunk per row; its residual is modelled by corrupting the
source log-prob the consumer sees, ``src_chunk_logp = log pi_j(a) + sigma * xi`` (xi ~ N(0, 1), fresh per
consumer and row), and by dropping a row's only chunk with probability ``drop`` (chunk_valid False).
The update is the learner's objective (``mrl_jax.objective``, written once): probe.extend -> GRPO group
advantages -> probe.advantages -> GRPO policy term (weights, masks, row counts, LUFFY shaping) + the
probe's loss terms, each divided by its full-batch denominator; the direction is minus its gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax import probes as P
from mrl_jax import rows as R
from mrl_jax.objective import GRPOConfig, objective
from mrl_jax.see import SeeView
from mrl_jax.bandit import env as E
from mrl_jax.bandit.lab_probes import LabProbe

TAU = 1.0


View = SeeView  # the view the probes read: the same pytree as the LLM trainer's


class Round(NamedTuple):
    """One round of rollouts: arms int32[N, C, G], rewards f32[N, C, G]; THL residual draws for every
    (consumer, source) pair: noise f32[N, N, C, G], valid bool[N, N, C, G]."""
    arms: jax.Array
    rewards: jax.Array
    noise: jax.Array
    valid: jax.Array


def sample_round(env: E.Env, logp: jax.Array, G: int, key: jax.Array, drop: float = 0.0) -> Round:
    """Draw G arms per (policy, context) from the min-p samplers and their verified rewards.
    logp f32[N, C, K] raw log-probs."""
    N, C, K = logp.shape
    k_arm, k_rew, k_noise, k_drop = jax.random.split(key, 4)
    slog = E.sampler_logits(logp, env.min_p)                                 # [N, C, K]
    arms = jax.random.categorical(k_arm, slog[:, :, None, :], axis=-1, shape=(N, C, G))
    qa = jnp.take_along_axis(jnp.broadcast_to(env.q, (N, C, K)), arms, axis=-1)
    rewards = (jax.random.uniform(k_rew, (N, C, G)) < qa).astype(jnp.float32)
    noise = jax.random.normal(k_noise, (N, N, C, G))
    valid = jax.random.uniform(k_drop, (N, N, C, G)) >= drop
    return Round(arms.astype(jnp.int32), rewards, noise, valid)


def peer_stats(rewards: jax.Array, consumer) -> jax.Array:
    """GroupStats-style [C, N, 4] (count, sum r, sum r^2, successes) of this round, consumer column zero."""
    N, C, G = rewards.shape
    st = jnp.stack([jnp.full((N, C), float(G)), rewards.sum(-1), (rewards ** 2).sum(-1),
                    (rewards >= TAU).sum(-1).astype(jnp.float32)], axis=-1)          # [N, C, 4]
    st = jnp.where((jnp.arange(N) == consumer)[:, None, None], 0.0, st)
    return st.transpose(1, 0, 2)


def peers_of(consumer, N: int) -> jax.Array:
    """int32[N-1]: the other policies, in cyclic order after the consumer (consumer may be traced)."""
    return (consumer + 1 + jnp.arange(N - 1, dtype=jnp.int32)) % N


def build_rows(env: E.Env, consumer, logp: jax.Array, rnd: Round, sigma, with_peers: bool, probe_index=0):
    """(Rows, View) for consumer i (int or traced), laid out as the learner lays them out
    (``mrl_jax.rows.own_rows`` ++ ``peer_rows``): own rows (C*G, prompt-major, active) then the view's
    (N-1)*G peer slots per prompt (inactive until a probe's extend activates them). One token per row (the
    arm), one THL chunk per peer row."""
    N, C, G = rnd.arms.shape
    i = jnp.asarray(consumer, jnp.int32)
    n = C * G
    own_arms = rnd.arms[i].reshape(n, 1)
    own_lp = jnp.take_along_axis(logp[i], rnd.arms[i], axis=-1).reshape(n, 1)
    prompts, pmask = jnp.arange(C, dtype=jnp.int32)[:, None], jnp.ones((C, 1), bool)
    rows = R.own_rows(prompts, pmask, own_arms, jnp.ones((n, 1)), jax.lax.stop_gradient(own_lp),
                      jnp.zeros((n, 1)), rnd.rewards[i].reshape(-1), jnp.zeros((n,), bool), consumer=i,
                      num_generations=G, probe_index=probe_index)
    Kp = (N - 1) * G
    S = C * Kp if with_peers else 0
    stats = peer_stats(rnd.rewards, i)
    if not S:
        z = jnp.zeros((0, 1))
        view = View(completion_ids=z.astype(jnp.int32), completion_mask=z, dst_chunk=z.astype(jnp.int32), src_chunk_logp=z,
                    chunk_valid=z.astype(bool), rewards=jnp.zeros((0,)), source=jnp.zeros((0,), jnp.int32),
                    row_kind=jnp.zeros((0,), jnp.int32), prompt_slot=jnp.zeros((0,), jnp.int32),
                    truncated=jnp.zeros((0,), bool), peer_stats=stats, consumer=i)
        return rows, view
    pj = peers_of(i, N)
    flat = lambda x: jnp.swapaxes(x, 0, 1).reshape((S,) + x.shape[3:])      # [N-1, C, G] -> s = c*Kp + k
    arms = rnd.arms[pj]
    src_lp = jnp.take_along_axis(logp[pj], arms, -1) + sigma * rnd.noise[i, pj]
    view = View(completion_ids=flat(arms)[:, None], completion_mask=jnp.ones((S, 1), jnp.float32), dst_chunk=jnp.zeros((S, 1), jnp.int32),
                src_chunk_logp=jax.lax.stop_gradient(flat(src_lp))[:, None],
                chunk_valid=flat(rnd.valid[i, pj])[:, None], rewards=flat(rnd.rewards[pj]),
                source=flat(jnp.broadcast_to(pj[:, None, None], arms.shape)), row_kind=jnp.full((S,), P.PEER, jnp.int32),
                prompt_slot=jnp.repeat(jnp.arange(C, dtype=jnp.int32), Kp), truncated=jnp.zeros((S,), bool),
                peer_stats=stats, consumer=i)
    return R.concat(rows, R.peer_rows(view, prompts, pmask)), view


def rows_logp(logp_i: jax.Array, rows: P.Rows) -> jax.Array:
    """log pi_i of every row's arm, f32[R, 1] (grpo.token_logprobs on the rows' contexts)."""
    return grpo.token_logprobs(logp_i[rows.prompt_slot][:, None, :], rows.completion_ids)


def loss_and_metrics(env: E.Env, spec: LabProbe, probe: P.Probe, consumer: int, theta_i: jax.Array,
                     logp: jax.Array, rnd: Round, sigma, key: jax.Array):
    """(loss(theta_i), metrics) for consumer i on this round: the library's objective
    (``mrl_jax.objective.objective``, the learner's, with beta 0, loss_type "grpo", epsilon 0.2) on the
    bandit's rows; logp f32[N, C, K] at the current params (own rows' pi_old)."""
    rows, view = build_rows(env, consumer, logp, rnd, sigma, probe.needs_peers)
    cfg = GRPOConfig(num_generations=rows.num_generations, max_completion_length=1)

    def logp_fn(r):
        lp = rows_logp(E.log_probs(env, consumer, theta_i), r)
        return lp, jnp.zeros_like(lp)

    return objective(logp_fn, rows, view, key, probe, cfg)


def round_directions(env: E.Env, spec: LabProbe, params: jax.Array, rnd: Round, key: jax.Array, sigma=0.0,
                     probe: P.Probe | None = None):
    """Update directions u f32[N, C, D] (u_i = -grad_theta_i loss_i) of every policy from a GIVEN round, and
    the probe metrics (dict of f32[N]); key drives the probes' own randomness (SGT's draw)."""
    probe = spec.build() if probe is None else probe
    logp = jax.lax.stop_gradient(E.all_log_probs(env, params))

    def one(i, th):
        g, m = jax.grad(lambda t: loss_and_metrics(env, spec, probe, i, t, logp, rnd, sigma,
                                                   jax.random.fold_in(key, i)), has_aux=True)(th)
        return -g, m

    return jax.vmap(one)(jnp.arange(params.shape[0], dtype=jnp.int32), params)


def sampled_directions(env: E.Env, spec: LabProbe, params: jax.Array, key: jax.Array, G: int,
                       sigma=0.0, drop: float = 0.0, probe: P.Probe | None = None):
    """Update directions u f32[N, C, D] of every policy from ONE sampled round, and the probe metrics
    (dict of f32[N]). Pure; vmap over keys for Monte Carlo. params f32[N, C, D]."""
    logp = jax.lax.stop_gradient(E.all_log_probs(env, params))
    k_round, k_probe = jax.random.split(key)
    rnd = sample_round(env, logp, G, k_round, drop)
    return round_directions(env, spec, params, rnd, k_probe, sigma, probe)


def sgd_step(env: E.Env, spec: LabProbe, params, key, G: int, lr: float, sigma=0.0, drop: float = 0.0,
             probe: P.Probe | None = None):
    """All policies update concurrently from one shared round: theta_i += lr * u_i. Returns
    (params, directions, metrics)."""
    dirs, mets = sampled_directions(env, spec, params, key, G, sigma, drop, probe)
    return params + lr * dirs, dirs, mets
