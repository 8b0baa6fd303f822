"""Sampled (Monte Carlo) updates: one MRL round on the bandit, run through the library's probe code.

Each round every policy draws G arms per context from its min-p sampler; the verifier pays Bernoulli(q).
For consumer i the round becomes exactly what the LLM learner sees (``mrl_jax.probes.Rows``): own rows
(P = C prompts x G, one "token" = the arm) followed by a peer view with (N-1)*G slots per prompt holding
every peer's rollouts (kind PEER). THL is one chunk per row; its residual is modelled by corrupting the
source log-prob the consumer sees, ``src_chunk_logp = log pi_j(a) + sigma * xi`` (xi ~ N(0, 1), fresh per
consumer and row), and by dropping a row's only chunk with probability ``drop`` (chunk_valid False).
The update is the learner's: probe.extend -> GRPO group advantages -> probe.advantages -> GRPO policy
term (``grpo.policy_loss`` with the rows' weights, masks, row counts and LUFFY shaping) + the probe's
loss terms, each divided by its full-batch denominator; the direction is minus its gradient.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from mrl_jax import grpo
from mrl_jax import probes as P
from mrl_jax.bandit import env as E
from mrl_jax.bandit.lab_probes import LabProbe

TAU = 1.0


@struct.dataclass
class View:
    """The fields of ``mrl_jax.see.SeeView`` that the probes read (see there for shapes)."""
    ids: jax.Array
    mask: jax.Array
    dst_chunk: jax.Array
    src_chunk_logp: jax.Array
    chunk_valid: jax.Array
    rewards: jax.Array
    source: jax.Array
    kind: jax.Array
    prompt_slot: jax.Array
    truncated: jax.Array
    peer_stats: jax.Array
    consumer: jax.Array
    tau: jax.Array


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


def peer_stats(rewards: jax.Array, consumer: int) -> jax.Array:
    """GroupStats-style [C, N, 4] (count, sum r, sum r^2, successes) of this round, consumer column zero."""
    N, C, G = rewards.shape
    st = jnp.stack([jnp.full((N, C), float(G)), rewards.sum(-1), (rewards ** 2).sum(-1),
                    (rewards >= TAU).sum(-1).astype(jnp.float32)], axis=-1)          # [N, C, 4]
    st = st.at[consumer].set(0.0)
    return st.transpose(1, 0, 2)


def build_rows(env: E.Env, consumer: int, logp: jax.Array, rnd: Round, sigma, with_peers: bool):
    """(Batch, View) for consumer i: own rows and a view of every peer's rollouts on the same contexts."""
    N, C, G = rnd.arms.shape
    i = consumer
    own_arms = rnd.arms[i].reshape(C * G, 1)
    own_lp = jnp.take_along_axis(logp[i], rnd.arms[i], axis=-1).reshape(C * G, 1)
    batch = P.Batch(prompt_ids=jnp.arange(C, dtype=jnp.int32)[:, None], prompt_mask=jnp.ones((C, 1), bool),
                    completion_ids=own_arms, completion_mask=jnp.ones((C * G, 1), jnp.float32),
                    old_logp=jax.lax.stop_gradient(own_lp), ref_logp=jnp.zeros((C * G, 1), jnp.float32),
                    rewards=rnd.rewards[i].reshape(-1), truncated=jnp.zeros((C * G,), bool))
    peers = [j for j in range(N) if j != i]
    Kp = len(peers) * G
    if peers and with_peers:
        arms = jnp.stack([rnd.arms[j] for j in peers], 1).reshape(C * Kp)           # [C, N-1, G] -> s = c*Kp+k
        src_lp = jnp.stack([jnp.take_along_axis(logp[j], rnd.arms[j], -1) + sigma * rnd.noise[i, j]
                            for j in peers], 1).reshape(C * Kp, 1)
        valid = jnp.stack([rnd.valid[i, j] for j in peers], 1).reshape(C * Kp, 1)
        rew = jnp.stack([rnd.rewards[j] for j in peers], 1).reshape(C * Kp)
        src = jnp.broadcast_to(jnp.asarray(peers, jnp.int32)[None, :, None], (C, len(peers), G)).reshape(-1)
        S = C * Kp
        view = View(ids=arms[:, None], mask=jnp.ones((S, 1), jnp.float32), dst_chunk=jnp.zeros((S, 1), jnp.int32),
                    src_chunk_logp=jax.lax.stop_gradient(src_lp), chunk_valid=valid, rewards=rew, source=src,
                    kind=jnp.full((S,), P.PEER, jnp.int32),
                    prompt_slot=jnp.repeat(jnp.arange(C, dtype=jnp.int32), Kp), truncated=jnp.zeros((S,), bool),
                    peer_stats=peer_stats(rnd.rewards, i), consumer=jnp.int32(i), tau=jnp.float32(TAU))
    else:
        view = View(ids=jnp.zeros((0, 1), jnp.int32), mask=jnp.zeros((0, 1)), dst_chunk=jnp.zeros((0, 1), jnp.int32),
                    src_chunk_logp=jnp.zeros((0, 1)), chunk_valid=jnp.zeros((0, 1), bool), rewards=jnp.zeros((0,)),
                    source=jnp.zeros((0,), jnp.int32), kind=jnp.zeros((0,), jnp.int32),
                    prompt_slot=jnp.zeros((0,), jnp.int32), truncated=jnp.zeros((0,), bool),
                    peer_stats=peer_stats(rnd.rewards, i), consumer=jnp.int32(i), tau=jnp.float32(TAU))
    return batch, view


def rows_logp(logp_i: jax.Array, rows: P.Rows) -> jax.Array:
    """log pi_i of every row's arm, f32[R, 1] (grpo.token_logprobs on the rows' contexts)."""
    return grpo.token_logprobs(logp_i[rows.prompt_slot][:, None, :], rows.completion_ids)


def pg_term(logp: jax.Array, rows: P.Rows, gamma: float = 0.1):
    """The learner's GRPO policy term on the rows (``mrl_jax.learner.pg_term`` with beta = 0, loss_type
    "grpo"): clipped surrogate with PG weights/masks/row counts, LUFFY shaping on shaping rows."""
    C = rows.src_chunk_logp.shape[1]
    cl = P.chunk_sums(logp * rows.completion_mask, rows.dst_chunk, C)
    return grpo.policy_loss(logp, rows.old_logp, rows.advantages, rows.pg_mask, epsilon=0.2, loss_type="grpo",
                            weights=rows.pg_weight, row_valid=rows.pg_row,
                            shaping_mask=rows.shaping[:, None] & (rows.pg_mask > 0),
                            shaping_logratio=P.chunk_gather(cl - rows.src_chunk_logp, rows.dst_chunk),
                            shaping_gamma=gamma)


def prepare_rows(env: E.Env, spec: LabProbe, probe: P.Probe, consumer: int, logp: jax.Array, rnd: Round,
                 sigma, key: jax.Array) -> tuple[P.Rows, View]:
    """Rows after extend and advantages (what the learner differentiates), and the view."""
    batch, view = build_rows(env, consumer, logp, rnd, sigma, probe.needs_peers)
    rows = P.assemble_rows(batch, view if probe.needs_peers else None)
    n_own = batch.rewards.shape[0]
    R = rows.rewards.shape[0]
    if probe.needs_peers and probe.needs_peer_logp and R > n_own:
        lp = jax.lax.stop_gradient(rows_logp(logp[consumer], rows))
        rows = rows.replace(old_logp=rows.old_logp.at[n_own:].set(lp[n_own:]))
    rows = probe.extend(rows, view, key)
    C, G = batch.num_prompts, batch.num_generations
    adv0 = grpo.group_advantages(batch.rewards.reshape(C, G)).reshape(-1)
    adv = jnp.concatenate([adv0, jnp.zeros((R - n_own,), jnp.float32)])
    adv = probe.advantages(rows.rewards, rows, view, adv)
    return rows.replace(advantages=adv), view


def loss_and_metrics(env: E.Env, spec: LabProbe, probe: P.Probe, consumer: int, theta_i: jax.Array,
                     logp: jax.Array, rnd: Round, sigma, key: jax.Array):
    """(loss(theta_i), metrics) for consumer i on this round; logp f32[N, C, K] at the current params."""
    rows, _ = prepare_rows(env, spec, probe, consumer, logp, rnd, sigma, key)
    probe_metrics = rows.metrics
    rows = rows.replace(metrics={})
    _, pg_den, _ = pg_term(rows.old_logp, rows, spec.gamma)
    _, t_den, _ = probe.loss_terms(rows.old_logp, rows)
    pg_den = jax.lax.stop_gradient(jnp.maximum(pg_den, 1e-30))
    t_den = jax.lax.stop_gradient(jnp.maximum(t_den, 1e-30))
    lp = rows_logp(E.log_probs(env, consumer, theta_i), rows)
    s, _, _ = pg_term(lp, rows, spec.gamma)
    ts, _, _ = probe.loss_terms(lp, rows)
    loss = s / pg_den + jnp.sum(ts / t_den)
    return loss, grpo.reduce_metrics(probe_metrics)


def sampled_directions(env: E.Env, spec: LabProbe, params: Sequence[jax.Array], key: jax.Array, G: int,
                       sigma=0.0, drop: float = 0.0, probe: P.Probe | None = None):
    """Update directions u_i = -grad_theta_i loss_i for every policy from ONE sampled round, and metrics
    (a list of dicts, one per policy). Pure; vmap over keys for Monte Carlo."""
    probe = spec.build() if probe is None else probe
    logp = jax.lax.stop_gradient(E.all_log_probs(env, params))
    k_round, k_probe = jax.random.split(key)
    rnd = sample_round(env, logp, G, k_round, drop)
    dirs, mets = [], []
    for i, th in enumerate(params):
        g, m = jax.grad(lambda t: loss_and_metrics(env, spec, probe, i, t, logp, rnd, sigma,
                                                   jax.random.fold_in(k_probe, i)), has_aux=True)(th)
        dirs.append(-g)
        mets.append(m)
    return tuple(dirs), mets


def sgd_step(env: E.Env, spec: LabProbe, params, key, G: int, lr: float, sigma=0.0, drop: float = 0.0,
             probe: P.Probe | None = None):
    """All policies update concurrently from one shared round: theta_i += lr * u_i."""
    dirs, mets = sampled_directions(env, spec, params, key, G, sigma, drop, probe)
    return tuple(th + lr * u for th, u in zip(params, dirs)), mets
