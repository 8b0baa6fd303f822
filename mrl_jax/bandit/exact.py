"""Exact expected updates of the probes on the bandit, by enumerating reward patterns and arms.

The update of consumer i is linear in its rows: -grad loss = sum_rows c_r grad log pi_i(a_r | c_r), so its
expectation is ``sum_{c,a} M[c, a] grad log pi_i(a | c)`` with the *expected arm coefficients*
``M[c, a] = sum_rows E[c_r 1{a_r = a}]``. Each row's coefficient depends on (i) its arm (probability mu(a),
reward Bernoulli(q[c, a]), importance weight / gate / shaping factor of that arm), (ii) the number of
successes among the other rows that share its baseline (Poisson-binomial: G-1 of its own group, G of
every other group), and (iii) for SGT, which peer success is drawn and how many prompts of the batch
fired (Poisson-binomial over the other contexts). Those are enumerated exactly; advantages come from
``mrl_jax.grpo`` (group_advantages / pooled_advantages on every reward pattern), weights from
``mrl_jax.probes`` (importance_weights, compatibility_score/gate) and the LUFFY factor from
``grpo.policy_shaping``; the THL residual noise xi ~ N(0, 1) is integrated by a fine quadrature
(``QUAD_NODES`` points; exact when sigma = 0). At the current parameters every PPO ratio is 1, so clipping
never binds (num_iterations = 1). Denominators: the learner's "grpo" aggregation counts rows (C*G own,
plus C*(N-1)*G peer rows under PRP) and SGT divides by the number of rescues in the batch.
The gated PRP (random admitted-row count in the denominator) is not covered: use Monte Carlo.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax import grpo
from mrl_jax import probes as P
from mrl_jax.bandit import env as E
from mrl_jax.bandit.lab_probes import LabProbe
from mrl_jax.bandit.updates import peers_of

QUAD_NODES = 201


@functools.lru_cache(maxsize=None)
def _quad(n: int = QUAD_NODES):
    z = np.linspace(-8.0, 8.0, n)
    w = np.exp(-0.5 * z * z)
    return z.astype(np.float32), (w / w.sum()).astype(np.float32)


def noise_expectation(fn, x: jax.Array, sigma) -> jax.Array:
    """E_xi[fn(x + sigma * xi)] for xi ~ N(0, 1), elementwise over x (quadrature; exact at sigma = 0)."""
    z, w = _quad()
    vals = fn(x[..., None] + sigma * jnp.asarray(z))
    return jnp.sum(vals * jnp.asarray(w), axis=-1)


def poisson_binomial(p: jax.Array) -> jax.Array:
    """pmf f32[..., M+1] of the number of successes of M independent Bernoulli(p[..., m])."""
    M = p.shape[-1]
    pmf0 = jnp.zeros(p.shape[:-1] + (M + 1,), jnp.float32).at[..., 0].set(1.0)

    def body(pmf, pm):
        shifted = jnp.concatenate([jnp.zeros_like(pmf[..., :1]), pmf[..., :-1]], -1)
        return pmf * (1.0 - pm[..., None]) + shifted * pm[..., None], None

    pmf, _ = jax.lax.scan(body, pmf0, jnp.moveaxis(p, -1, 0))
    return pmf


def advantage_table(N: int, G: int, pooled: bool) -> jax.Array:
    """T f32[2, N*G] (pooled) or f32[2, G] (group): advantage of a row with reward r when s of the other rows
    sharing its baseline succeed, computed by ``grpo.pooled_advantages`` / ``grpo.group_advantages``."""
    n = N * G if pooled else G
    r = np.zeros((2, n, n), np.float32)                         # [r, s, flat rewards]
    for rv in (0, 1):
        for s in range(n):
            r[rv, s, 0] = rv
            r[rv, s, 1:1 + s] = 1.0
    flat = jnp.asarray(r.reshape(2 * n, n))
    if pooled:
        rew = flat.reshape(2 * n, N, G).transpose(1, 0, 2)     # [N, P, G]
        adv = grpo.pooled_advantages(rew)[0, :, 0]
    else:
        adv = grpo.group_advantages(flat)[:, 0]
    return adv.reshape(2, n)


def _mean_adv(table: jax.Array, probs_others: jax.Array, q: jax.Array) -> jax.Array:
    """E[A | arm] f32[C, K]: table [2, M+1], probs_others [C, M] success probs of the other rows, q [C, K]."""
    pmf = poisson_binomial(probs_others)                         # [C, M+1]
    a0, a1 = pmf @ table[0], pmf @ table[1]                      # [C]
    return q * a1[:, None] + (1.0 - q) * a0[:, None]


def _others(p: jax.Array, n, G: int) -> jax.Array:
    """Success probs f32[C, N*G-1] of the rows sharing the baseline of a row in group n (G-1 of n, G of others)."""
    N, C = p.shape
    reps = jnp.full((N,), G) - (jnp.arange(N) == n)
    idx = np.concatenate([np.full(G, m) for m in range(N)])      # [N*G]
    keep = jnp.arange(N * G) % G < reps[idx]                     # drop one slot of group n
    order = jnp.argsort(~keep, stable=True)[: N * G - 1]
    return p[jnp.asarray(idx)[order]].T


def ratio_factors(spec: LabProbe, logp_i: jax.Array, logp_j: jax.Array, sigma, drop: float):
    """Per arm f32[C, K] expectations over the THL residual: kappa (PRP's gradient factor: the importance
    weight, or the LUFFY derivative f'(rho) rho), w1/w2 (first/second moments of the reported weight over
    valid rows), alpha (P[compatibility gate admits]) and omega (E[gate weight]). Dropped rows (prob
    ``drop``) have no valid chunk: PRP masks them; the gate scores them s = exp(0) = 1."""
    x = logp_i - logp_j                                          # log rho at sigma = 0

    def weight(lr):
        return P.importance_weights(jnp.zeros_like(lr), -lr, truncate=spec.truncate, mode=spec.prp_mode,
                                    gamma=spec.gamma)

    def kappa(lr):
        if spec.prp_mode == "shaping":
            f = lambda t: grpo.policy_shaping(jnp.exp(t), spec.gamma)
            return jax.vmap(jax.grad(f))(lr.reshape(-1)).reshape(lr.shape)
        return weight(lr)

    def gate(lr):
        s = P.compatibility_score(lr, jnp.zeros_like(lr))
        return P.compatibility_gate(s, spec.delta)

    admit_p = noise_expectation(lambda t: gate(t)[0].astype(jnp.float32), x, sigma)
    omega = noise_expectation(lambda t: gate(t)[1], x, sigma)
    return dict(kappa=(1.0 - drop) * noise_expectation(kappa, x, sigma),
                w1=noise_expectation(weight, x, sigma), w2=noise_expectation(lambda t: weight(t) ** 2, x, sigma),
                alpha=(1.0 - drop) * admit_p + drop, omega=(1.0 - drop) * omega + drop)


def expected_coefficients(env: E.Env, spec: LabProbe, logp: jax.Array, consumer, G: int, sigma=0.0,
                          drop: float = 0.0) -> tuple[jax.Array, dict]:
    """(M f32[C, K], info): expected ascent coefficient of log pi_i(a | c) in consumer i's update, so that
    E[u_i] = grad_theta sum_{c,a} M[c, a] log pi_i(a | c). logp f32[N, C, K] at the current parameters."""
    if not spec.exact:
        raise ValueError(f"probe {spec.name!r} has no closed-form expectation; use Monte Carlo")
    N, C, K = logp.shape
    i = jnp.asarray(consumer, jnp.int32)
    mu = E.sampler_probs(logp, env.min_p)                        # [N, C, K]
    q = env.q
    p = jnp.sum(mu * q, -1)                                      # [N, C]
    pooled = spec.pooled and N > 1
    pg_den = C * G * (N if (spec.prp and N > 1) else 1)
    if pooled:
        table = advantage_table(N, G, True)
        abar = lambda n: _mean_adv(table, _others(p, n, G), q)
    else:
        table = advantage_table(1, G, False)
        abar = lambda n: _mean_adv(table, jnp.repeat(p[n][:, None], G - 1, 1), q)
    M = G * mu[i] * abar(i) / pg_den
    info = {}
    pj = peers_of(i, N) if N > 1 else jnp.zeros((0,), jnp.int32)
    if N > 1 and (spec.prp or spec.sgt):
        fac = jax.vmap(lambda j: ratio_factors(spec, logp[i], logp[j], sigma, drop))(pj)   # each [N-1, C, K]
        if spec.prp:
            A_peer = jax.vmap(abar)(pj)                                                     # [N-1, C, K]
            M = M + jnp.sum(G * mu[pj] * A_peer * fac["kappa"], 0) / pg_den
            w1 = jnp.sum(mu[pj] * fac["w1"], -1)                                            # [N-1, C]
            w2 = jnp.sum(mu[pj] * fac["w2"], -1)
            info["weight_mean"], info["weight_sq"] = jnp.mean(w1), jnp.mean(w2)
        if spec.sgt:
            alpha = fac["alpha"] if spec.sgt_gate else jnp.ones_like(fac["alpha"])
            omega = fac["omega"] if spec.sgt_gate else jnp.ones_like(fac["omega"])
            beta = jnp.sum(mu[pj] * q * alpha, -1)                                          # [N-1, C]
            fail = jnp.ones((C,)) if spec.sgt_always else (1.0 - p[i]) ** G
            Np = N - 1
            # other candidate rows of row r in peer group j: G-1 of j, G of the other peers
            bflat = jnp.repeat(beta, G, axis=0)                                             # [Np*G, C]
            grp = jnp.repeat(jnp.arange(Np), G)

            def inv_count(j):
                keep = jnp.argsort(~((grp != j) | (jnp.arange(Np * G) % G != 0)), stable=True)[: Np * G - 1]
                pmf = poisson_binomial(bflat[keep].T)                                        # [C, Np*G]
                return pmf @ (1.0 / (1.0 + jnp.arange(Np * G)))

            inv = jax.vmap(inv_count)(jnp.arange(Np))                                       # [Np, C]
            R = jnp.sum(G * mu[pj] * q * omega * inv[..., None], 0)                         # [C, K]
            fire = fail * (1.0 - jnp.prod((1.0 - beta) ** G, 0))                            # [C]
            others = jnp.where(jnp.eye(C, dtype=bool), 0.0, fire[None, :])                   # [C, C]
            H = poisson_binomial(others) @ (1.0 / (1.0 + jnp.arange(C + 1)))                # [C]
            M = M + spec.lam * (fail * H)[:, None] * R
            info["fire"] = fire
    return M, info


def expected_directions(env: E.Env, spec: LabProbe, params: jax.Array, G: int, sigma=0.0, drop: float = 0.0):
    """E[u] f32[N, C, D] for every policy (the exact expectation of ``updates.sampled_directions``) and the
    coefficients M f32[N, C, K]."""
    logp = jax.lax.stop_gradient(E.all_log_probs(env, params))
    N = params.shape[0]

    def one(i, th):
        M, _ = expected_coefficients(env, spec, logp, i, G, sigma, drop)
        M = jax.lax.stop_gradient(M)
        return jax.grad(lambda t: jnp.sum(M * E.log_probs(env, i, t)))(th), M

    return jax.vmap(one)(jnp.arange(N, dtype=jnp.int32), params)


def weight_stats(env: E.Env, spec: LabProbe, params: jax.Array, G: int, sigma=0.0, drop: float = 0.0) -> dict:
    """Exact population moments of PRP's reported importance weights over valid peer rows, per policy:
    mean, variance and Kish ESS fraction (E w)^2 / E w^2 (empty dict unless the probe is PRP)."""
    if not spec.prp or spec.prp_gate or params.shape[0] < 2:
        return {}
    logp = E.all_log_probs(env, params)
    N = params.shape[0]
    out = jax.vmap(lambda i: expected_coefficients(env, spec, logp, i, G, sigma, drop)[1])(jnp.arange(N))
    m1, m2 = out["weight_mean"], out["weight_sq"]
    return {"mean": m1, "var": m2 - m1 ** 2, "ess": m1 ** 2 / jnp.maximum(m2, 1e-30)}
