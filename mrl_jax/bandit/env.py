"""The heterogeneous contextual bandit: C contexts x K arms, N softmax policies with different parameterisations.

Environment. Each context has a small *correct set* (1 or 2 arms). A verified reward is Bernoulli:
r ~ Bernoulli(q[c, a]) with q = ``correct_prob`` (1.0 by default: deterministic 0/1 verification) on correct
arms and 0 elsewhere, so a success (r = 1) is always a correct arm.

Policies. Policy n is a softmax ``pi_n(a | c) = softmax(b_n[c] + Phi_n (mix_n theta_n)[c])`` with a fixed prior
``b_n`` (what pre-training gave it), trainable parameters ``theta_n`` (initialised at 0) and
a feature map ``Phi_n`` [K, D] — the bandit analogue of different architectures and tokenizers:
``tabular`` (Phi = [I, 0]: every arm moves alone), ``gaussian`` (random Gaussian features: a random
kernel Phi Phi^T couples arms), ``fourier`` (random Fourier features of a 1-D arm position: neighbouring
arms generalise to each other). All maps have D = feature_ratio * K columns (the tabular one is padded
with zero columns, which never move), so the N policies stack into one parameter array theta f32[N, C, D].
By default parameters are per context (an update only moves the context it was computed on);
``context_sharing`` > 0 mixes them across contexts (shared parameters: transfer and interference).

Sampling support. Rollouts are drawn from the min-p truncated policy (as LLM decoders truncate with
top-p / min-p): ``mu_n(a|c) ∝ pi_n(a|c) * [pi_n(a|c) >= min_p * max_b pi_n(b|c)]``. An arm below the threshold
has *exactly zero* probability of being sampled while its log-probability stays finite (a teacher-forced
log-likelihood can still raise it). Success is measured under the sampler: ``J_n(c) = sum_a mu_n(a|c) q[c, a]``.

Context kinds, per policy: ``easy`` (raw mass ``easy_mass`` on the correct set), ``hard`` (``hard_mass``: in
support but rarely sampled in a group), ``oos`` (out of support: every correct logit ``oos_margin`` nats below
the min-p threshold, so the sampler has exactly zero success). The context set is every kind tuple over
the N policies except all-``oos`` (``contexts_per_tuple`` copies each), so each policy's out-of-support
contexts are easy or hard for at least one peer.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mrl_jax.configs import check, field

KINDS = ("easy", "hard", "oos")
EASY, HARD, OOS = 0, 1, 2
FEATURE_KINDS = ("tabular", "gaussian", "fourier")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """The bandit and its policies (every field documented; loadable from YAML via mrl_jax.configs)."""

    num_arms: int = field(8, help="K: arms per context")
    policies: tuple[str, ...] = field(("tabular", "gaussian", "fourier"),
                            help="feature map of each policy (N = len): tabular | gaussian | fourier")
    contexts_per_tuple: int = field(1, help="contexts per kind tuple (C = (3^N - 1) * this)")
    two_correct_frac: float = field(0.3, help="fraction of contexts whose correct set has 2 arms (else 1)")
    correct_prob: float = field(1.0, help="Bernoulli success probability of a correct arm (1 = exact 0/1)")
    easy_mass: float = field(0.45, help="raw prior mass on the correct set of an easy context")
    hard_mass: float = field(0.05, help="raw prior mass on the correct set of a hard context")
    oos_margin: float = field(2.0, help="nats by which every correct logit sits below the min-p threshold "
                                        "on an out-of-support context (with min_p = 0: below the threshold "
                                        "min_p = 0.02 would set, so the raw mass is the same)")
    min_p: float = field(0.02, help="sampler keeps arms with pi >= min_p * max pi (0 = plain softmax)")
    prior_scale: float = field(1.0, help="std of the wrong arms' prior logits")
    feature_ratio: int = field(2, help="d = feature_ratio * K for the gaussian and fourier maps")
    context_sharing: float = field(0.0, help="s in [0, 1]: context c's parameters are ((1-s) I + s W_n) theta_n "
                                             "with W_n a random Gaussian C x C / sqrt(C) mixing per policy; 0 = "
                                             "separate per-context parameters (an update only moves its context)")
    seed: int = field(0, help="seed of the environment (correct sets, priors, feature maps)")

    def __post_init__(self):
        check(self.num_arms >= 3, "num_arms", f"must be >= 3, got {self.num_arms}")
        check(len(self.policies) >= 1, "policies", "needs at least one policy")
        for p in self.policies:
            check(p in FEATURE_KINDS, "policies", f"unknown feature map {p!r}; use one of {FEATURE_KINDS}")
        check(self.contexts_per_tuple >= 1, "contexts_per_tuple", "must be >= 1")
        check(0.0 <= self.two_correct_frac <= 1.0, "two_correct_frac", "must be in [0, 1]")
        check(0.0 < self.correct_prob <= 1.0, "correct_prob", "must be in (0, 1]")
        check(0.0 < self.hard_mass < self.easy_mass < 1.0, "easy_mass",
              f"need 0 < hard_mass < easy_mass < 1, got {self.hard_mass}, {self.easy_mass}")
        check(0.0 <= self.min_p < 1.0, "min_p", f"must be in [0, 1), got {self.min_p}")
        check(self.oos_margin > 0, "oos_margin", "must be > 0")
        check(self.feature_ratio >= 1, "feature_ratio", "must be >= 1")
        check(0.0 <= self.context_sharing <= 1.0, "context_sharing", "must be in [0, 1]")


@struct.dataclass
class Env:
    """A built bandit. q f32[C, K] success probability per arm; correct bool[C, K]; kinds int32[N, C]
    (EASY/HARD/OOS of each context for each policy); prior f32[N, C, K]; phis f32[N, K, D] feature maps;
    mix f32[N, C, C] context sharing (identity = separate parameters); min_p: sampler threshold."""
    q: jax.Array
    correct: jax.Array
    kinds: jax.Array
    prior: jax.Array
    phis: jax.Array
    mix: jax.Array
    min_p: float = struct.field(pytree_node=False, default=0.0)
    names: tuple = struct.field(pytree_node=False, default=())

    @property
    def num_policies(self) -> int:
        return self.prior.shape[0]

    @property
    def num_contexts(self) -> int:
        return self.q.shape[0]

    @property
    def num_arms(self) -> int:
        return self.q.shape[1]


def feature_map(kind: str, K: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """Phi f32[K, d] (tabular: the identity padded with zero columns; d >= K)."""
    if kind == "tabular":
        return np.eye(K, d, dtype=np.float32)
    if kind == "gaussian":
        return (rng.standard_normal((K, d)) / np.sqrt(d)).astype(np.float32)
    x = rng.permutation(K) / K                                     # arm positions on a circle
    w = rng.integers(1, 3, size=d)                                 # low frequencies: smooth kernel
    ph = rng.uniform(0, 2 * np.pi, size=d)
    return (np.sqrt(2.0 / d) * np.cos(2 * np.pi * x[:, None] * w[None, :] + ph[None, :])).astype(np.float32)


def _kind_tuples(N: int) -> list[tuple[int, ...]]:
    tuples = [t for t in itertools.product(range(3), repeat=N) if not all(k == OOS for k in t)]
    if N == 1:
        tuples.append((OOS,))
    return tuples


def make_env(cfg: EnvConfig, kind_tuples: Sequence[Sequence[int]] | None = None) -> Env:
    """Build the bandit of ``cfg`` (deterministic in cfg.seed). kind_tuples: optional explicit list of
    per-policy kinds for each context (default: every tuple except all-oos, contexts_per_tuple times)."""
    rng = np.random.default_rng(cfg.seed)
    N, K = len(cfg.policies), cfg.num_arms
    tuples = [tuple(t) for t in (kind_tuples if kind_tuples is not None else _kind_tuples(N))]
    tuples = [t for t in tuples for _ in range(cfg.contexts_per_tuple)]
    C = len(tuples)
    kinds = np.array(tuples, dtype=np.int32).T                    # [N, C]
    correct = np.zeros((C, K), bool)
    for c in range(C):
        n_corr = 2 if rng.random() < cfg.two_correct_frac else 1
        correct[c, rng.choice(K, n_corr, replace=False)] = True
    q = np.where(correct, cfg.correct_prob, 0.0).astype(np.float32)
    prior = np.zeros((N, C, K), np.float32)
    log_min_p = np.log(cfg.min_p if cfg.min_p > 0 else 0.02)
    for n in range(N):
        for c in range(C):
            wrong = rng.standard_normal(K) * cfg.prior_scale
            z = wrong.copy()
            m = correct[c]
            rest = np.exp(wrong[~m]).sum()
            if kinds[n, c] == OOS:
                z[m] = wrong[~m].max() + log_min_p - cfg.oos_margin + rng.uniform(-0.5, 0.0, m.sum())
            else:
                mass = cfg.easy_mass if kinds[n, c] == EASY else cfg.hard_mass
                x = np.log(mass * rest / (m.sum() * (1.0 - mass)))
                z[m] = x + rng.uniform(-0.1, 0.1, m.sum())
            prior[n, c] = z - z.max()
    phis = jnp.asarray(np.stack([feature_map(kind, K, K * cfg.feature_ratio, rng) for kind in cfg.policies]))
    eye = np.eye(C, dtype=np.float32)
    mix = np.stack([eye if cfg.context_sharing == 0 else
                    (1 - cfg.context_sharing) * eye + cfg.context_sharing * rng.standard_normal((C, C)) / np.sqrt(C)
                    for _ in cfg.policies]).astype(np.float32)
    return Env(q=jnp.asarray(q), correct=jnp.asarray(correct), kinds=jnp.asarray(kinds),
               prior=jnp.asarray(prior), phis=phis, mix=jnp.asarray(mix), min_p=float(cfg.min_p),
               names=tuple(cfg.policies))


# ----------------------------------------------------------------------------- policies

def init_params(env: Env) -> jax.Array:
    """theta f32[N, C, D] = 0 (every policy starts at its prior)."""
    return jnp.zeros((env.num_policies, env.num_contexts, env.phis.shape[2]), jnp.float32)


def logits(env: Env, n, theta: jax.Array) -> jax.Array:
    """Raw logits f32[C, K] of policy n (int or traced): prior + (mix_n theta_n) Phi_n^T. theta f32[C, D]."""
    return env.prior[n] + (env.mix[n] @ theta) @ env.phis[n].T


def log_probs(env: Env, n, theta: jax.Array) -> jax.Array:
    """log pi_n(a | c) f32[C, K] (raw, untruncated; what the losses differentiate). theta f32[C, D]."""
    return jax.nn.log_softmax(logits(env, n, theta), axis=-1)


def support_mask(logp: jax.Array, min_p: float) -> jax.Array:
    """bool[..., K]: arms the min-p sampler can draw (pi >= min_p * max pi). Not differentiated."""
    if min_p <= 0:
        return jnp.ones(logp.shape, bool)
    lp = jax.lax.stop_gradient(logp)
    return lp >= jnp.max(lp, axis=-1, keepdims=True) + jnp.log(min_p)


def sampler_logits(logp: jax.Array, min_p: float) -> jax.Array:
    """Logits of the sampling distribution mu (truncated arms at -inf)."""
    return jnp.where(support_mask(logp, min_p), jax.lax.stop_gradient(logp), -jnp.inf)


def sampler_probs(logp: jax.Array, min_p: float) -> jax.Array:
    """mu f32[..., K]: the min-p truncated, renormalised policy (exact zeros outside the support)."""
    return jax.nn.softmax(sampler_logits(logp, min_p), axis=-1)


def all_log_probs(env: Env, params: jax.Array) -> jax.Array:
    """f32[N, C, K] raw log-probs of every policy; params f32[N, C, D]."""
    eff = jnp.einsum("nce,ned->ncd", env.mix, params)
    return jax.nn.log_softmax(env.prior + jnp.einsum("ncd,nkd->nck", eff, env.phis), axis=-1)


def success(env: Env, logp: jax.Array) -> jax.Array:
    """Expected verified success under the sampler, J f32[..., C] = sum_a mu(a|c) q[c, a]."""
    return jnp.sum(sampler_probs(logp, env.min_p) * env.q, axis=-1)


def raw_success(env: Env, logp: jax.Array) -> jax.Array:
    """Raw (untruncated) mass on successes, f32[..., C] = sum_a pi(a|c) q[c, a]."""
    return jnp.sum(jnp.exp(logp) * env.q, axis=-1)


def kl(logp_a: jax.Array, logp_b: jax.Array) -> jax.Array:
    """KL(pi_a || pi_b) per context, f32[..., C]."""
    return jnp.sum(jnp.exp(logp_a) * (logp_a - logp_b), axis=-1)


def describe(env: Env) -> dict:
    """Counts of context kinds per policy and the initial success of each kind (for the report)."""
    logp = all_log_probs(env, init_params(env))
    J = np.asarray(success(env, logp))
    Jr = np.asarray(raw_success(env, logp))
    kinds = np.asarray(env.kinds)
    out = {"num_contexts": env.num_contexts, "num_arms": env.num_arms, "policies": list(env.names),
           "min_p": env.min_p, "kinds": {}}
    for k, name in enumerate(KINDS):
        sel = kinds == k
        out["kinds"][name] = {"count_per_policy": [int(s) for s in sel.sum(1)],
                              "initial_success": float(J[sel].mean()) if sel.any() else None,
                              "initial_raw_mass": float(Jr[sel].mean()) if sel.any() else None}
    return out
