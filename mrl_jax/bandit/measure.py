"""Measurements: stochastic training over seeds (vmapped, jitted), the exact expected-update flow, and the
support / stability figures computed from them.

* ``train_mc``: S seeds x (residual levels) of concurrent SGD training of all N policies with sampled
  rounds; records the exact sampler success J[N, C] of every policy every ``record_every`` steps, the KL
  moved per step, the probe metrics (ESS, weight variance, rescues fired) and the first step's update
  directions (all seeds start at the same point, so their spread is the update variance there).
* ``train_exact``: theta <- theta + lr * E[u] with the closed-form expectation (deterministic).
* ``support_rate``: first-order rate of the log raw success mass on out-of-support contexts along E[u].
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax.bandit import env as E
from mrl_jax.bandit import exact as X
from mrl_jax.bandit import updates as U
from mrl_jax.bandit.lab_probes import LabProbe

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _jit(fn, fast_compile: bool, **kw):
    return jax.jit(fn, compiler_options=FAST_COMPILE if fast_compile else None, **kw)


def train_mc(env: E.Env, spec: LabProbe, *, G: int, lr: float, steps: int, seeds: int,
             sigmas: Sequence[float] = (0.0,), drop: float = 0.0, record_every: int = 5, seed: int = 0,
             fast_compile: bool = False) -> dict:
    """Stochastic training of every policy under ``spec``; arrays indexed [sigma, seed, ...].

    Returns numpy arrays: J [L, S, R, N, C] (R = steps // record_every + 1 records, the first at step 0),
    raw [L, S, R, N, C] raw success mass, kl [L, S, N] mean KL(pi_t || pi_t+1) per step over contexts,
    u0 [L, S, N, C, D] first-step directions, metrics {name: [L, S, N]} step-averaged probe metrics,
    steps_recorded [R]."""
    probe = spec.build()
    n_rec = steps // record_every

    def run_one(env, key, sigma):
        params0 = E.init_params(env)
        logp0 = E.all_log_probs(env, params0)

        def step(carry, k):
            params, logp = carry
            new, u, mets = U.sgd_step(env, spec, params, k, G, lr, sigma, drop, probe)
            new_logp = E.all_log_probs(env, new)
            kl = jnp.mean(E.kl(logp, new_logp), -1)                       # [N]
            return (new, new_logp), (kl, mets, u)

        def block(carry, k):
            ks = jax.random.split(k, record_every)
            carry, (kl, mets, u) = jax.lax.scan(step, carry, ks)
            logp = carry[1]
            rec = (E.success(env, logp), E.raw_success(env, logp))
            return carry, (rec, kl.sum(0), jax.tree.map(lambda m: m.sum(0), mets), u[0])

        keys = jax.random.split(key, n_rec)
        _, (recs, kls, mets, us) = jax.lax.scan(block, (params0, logp0), keys)
        J = jnp.concatenate([E.success(env, logp0)[None], recs[0]], 0)
        raw = jnp.concatenate([E.raw_success(env, logp0)[None], recs[1]], 0)
        total = float(n_rec * record_every)
        return dict(J=J, raw=raw, kl=kls.sum(0) / total, u0=us[0],
                    metrics=jax.tree.map(lambda m: m.sum(0) / total, mets))

    fn = jax.vmap(jax.vmap(run_one, in_axes=(None, 0, None)), in_axes=(None, None, 0))
    keys = jax.random.split(jax.random.PRNGKey(seed), seeds)
    out = _jit(fn, fast_compile)(env, keys, jnp.asarray(sigmas, jnp.float32))
    out = jax.tree.map(np.asarray, out)
    out["steps_recorded"] = np.arange(n_rec + 1) * record_every
    return out


def train_exact(env: E.Env, spec: LabProbe, *, G: int, lr: float, steps: int, sigmas: Sequence[float] = (0.0,),
                drop: float = 0.0, record_every: int = 5, fast_compile: bool = False) -> dict:
    """The expected-update flow theta <- theta + lr * E[u]; J/raw [L, R, N, C], kl [L, N], eu0 [L, N, C, D]
    (the exact expected first-step direction), rate0 [L, N] (``support_rate`` at the start), weights
    {mean, var, ess: [L, N]} (PRP's exact importance-weight moments at the start; empty otherwise)."""
    n_rec = steps // record_every

    def run_one(env, sigma):
        params0 = E.init_params(env)

        def step(params, _):
            eu, _ = X.expected_directions(env, spec, params, G, sigma, drop)
            new = params + lr * eu
            kl = jnp.mean(E.kl(E.all_log_probs(env, params), E.all_log_probs(env, new)), -1)
            return new, kl

        def block(params, _):
            params, kl = jax.lax.scan(step, params, None, length=record_every)
            logp = E.all_log_probs(env, params)
            return params, (E.success(env, logp), E.raw_success(env, logp), kl.sum(0))

        _, (J, raw, kls) = jax.lax.scan(block, params0, None, length=n_rec)
        logp0 = E.all_log_probs(env, params0)
        eu0, _ = X.expected_directions(env, spec, params0, G, sigma, drop)
        return dict(J=jnp.concatenate([E.success(env, logp0)[None], J], 0),
                    raw=jnp.concatenate([E.raw_success(env, logp0)[None], raw], 0),
                    kl=kls.sum(0) / float(max(n_rec * record_every, 1)), eu0=eu0,
                    rate0=support_rate(env, params0, eu0),
                    weights=X.weight_stats(env, spec, params0, G, sigma, drop))

    out = _jit(jax.vmap(run_one, in_axes=(None, 0)), fast_compile)(env, jnp.asarray(sigmas, jnp.float32))
    out = jax.tree.map(np.asarray, out)
    out["steps_recorded"] = np.arange(n_rec + 1) * record_every
    return out


def support_rate(env: E.Env, params: jax.Array, direction: jax.Array) -> jax.Array:
    """f32[N]: d/d eta of the mean over each policy's out-of-support contexts of log(raw success mass)
    along ``direction`` (nats per unit step): exactly 0 when the update never touches those contexts."""
    oos = (env.kinds == E.OOS).astype(jnp.float32)

    def f(eta):
        return jnp.log(jnp.maximum(E.raw_success(env, E.all_log_probs(env, params + eta * direction)), 1e-38))

    _, d = jax.jvp(f, (jnp.float32(0.0),), (jnp.float32(1.0),))
    return jnp.sum(d * oos, -1) / jnp.maximum(jnp.sum(oos, -1), 1.0)


# ----------------------------------------------------------------------------- figures from runs

def kind_means(env: E.Env, J: np.ndarray) -> dict:
    """Mean of J[..., N, C] over each policy's contexts of each kind -> {kind: [...]} (over N too)."""
    kinds = np.asarray(env.kinds)
    out = {}
    for k, name in enumerate(E.KINDS):
        m = (kinds == k).astype(np.float64)
        out[name] = (J * m).sum((-1, -2)) / max(m.sum(), 1.0)
    return out


def collapsed(env: E.Env, J: np.ndarray, min_initial: float = 0.1, keep: float = 0.5) -> np.ndarray:
    """bool[...]: a run collapses when some policy ends with less than ``keep`` x the success it started
    with on a context where it had at least ``min_initial``. J [..., R, N, C]."""
    J0, JT = J[..., 0, :, :], J[..., -1, :, :]
    had = J0 >= min_initial
    return np.any(had & (JT < keep * J0), axis=(-1, -2))


def mean_se(x: np.ndarray, axis: int = 0) -> tuple[float, float]:
    x = np.asarray(x, np.float64)
    n = x.shape[axis]
    return float(x.mean(axis)), float(x.std(axis, ddof=1) / np.sqrt(n)) if n > 1 else 0.0


def update_variance(u0: np.ndarray, exact_mean: Optional[np.ndarray] = None, batches: int = 8) -> dict:
    """Spread of the first-step update direction over seeds (all at the same parameters). u0 [S, N, C, D].
    var = E||u - E u||^2 (per policy, averaged over policies), its standard error over seed batches,
    noise_ratio = var / ||E u||^2 (E u exact when given), and direction_var = 1 - ||E[u/||u||]||^2 (the
    scale-free variance of the unit update direction: 0 = every seed moves the same way, 1 = isotropic)."""
    u = np.asarray(u0, np.float64).reshape(u0.shape[0], u0.shape[1], -1)
    mean = u.mean(0) if exact_mean is None else np.asarray(exact_mean, np.float64).reshape(u.shape[1], -1)
    sq = ((u - mean[None]) ** 2).sum(-1).mean(-1)                         # [S]
    S = sq.shape[0]
    b = max(1, min(batches, S // 2))
    parts = np.array_split(sq, b)
    bm = np.array([p.mean() for p in parts])
    var = float(sq.mean())
    signal = float((mean ** 2).sum(-1).mean())
    # variance of the unit direction u/|u|: 1 - |E u/|u||^2, with the unbiased estimate of |E .|^2
    unit = u / np.maximum(np.linalg.norm(u, axis=-1, keepdims=True), 1e-30)
    live = np.linalg.norm(u, axis=-1) > 0                                  # [S, N]
    dvar = []
    for n in range(u.shape[1]):
        un = unit[live[:, n], n]
        k = un.shape[0]
        if k < 2:
            continue
        m2 = (k * (un.mean(0) ** 2).sum() - 1.0) / (k - 1)
        dvar.append(1.0 - m2)
    return {"var": var, "var_se": float(bm.std(ddof=1) / np.sqrt(b)) if b > 1 else 0.0,
            "signal": signal, "noise_ratio": var / max(signal, 1e-30),
            "direction_var": float(np.mean(dvar)) if dvar else float("nan")}
