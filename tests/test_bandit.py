"""The contextual-bandit lab: exact expectations vs Monte Carlo and brute-force enumeration, the probe
identities, and the structural out-of-support fact (GRPO/XGRPO gain exactly zero, SGT gains)."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax import grpo
from mrl_jax.bandit import env as E
from mrl_jax.bandit import exact as X
from mrl_jax.bandit import lab
from mrl_jax.bandit import lab_probes as LP
from mrl_jax.bandit import measure as M
from mrl_jax.bandit import updates as U

FAST = {"xla_backend_optimization_level": 0}
CLOSED_FORM = [n for n in LP.DEFAULT_PROBES if LP.LAB_PROBES[n].exact] + ["prp_raw"]


def _jit(f, **kw):
    return jax.jit(f, compiler_options=FAST, **kw)


@pytest.fixture(scope="module")
def small():
    """2 heterogeneous policies, 5 arms, every kind pair, Bernoulli(0.8) rewards, perturbed parameters."""
    cfg = E.EnvConfig(num_arms=5, policies=("tabular", "gaussian"), correct_prob=0.8, seed=1)
    env = E.make_env(cfg)
    params = E.init_params(env) + 0.3 * jax.random.normal(jax.random.PRNGKey(5), E.init_params(env).shape)
    return env, params


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_exact_expectation_equals_monte_carlo_mean(small, name):
    env, params = small
    spec = LP.get(name)
    G, sigma, drop, S = 3, 0.7, 0.2, 4096
    mc = _jit(jax.vmap(lambda e, p, k, s: U.sampled_directions(e, spec, p, k, G, s, drop)[0],
                       in_axes=(None, None, 0, None)))
    d = np.asarray(mc(env, params, jax.random.split(jax.random.PRNGKey(0), S), sigma), np.float64)
    ex = np.asarray(_jit(lambda e, p, s: X.expected_directions(e, spec, p, G, s, drop)[0])(env, params, sigma))
    mean, se = d.mean(0), d.std(0, ddof=1) / np.sqrt(S)
    err = np.abs(mean - ex)
    assert np.all(err <= 4.5 * se + 1e-5), f"{name}: max |z| {np.max(err / np.maximum(se, 1e-12)):.2f}"
    live = se > 1e-5                                       # (padded tabular features never move)
    z = (mean - ex)[live] / se[live]
    assert live.sum() > 30 and 0.35 < np.mean(z ** 2) < 2.0, f"{name}: mean z^2 {np.mean(z ** 2):.2f} (expect ~1)"
    assert np.abs(ex).sum() > 0.05


def _all_rounds(env, params, G):
    """Every joint arm outcome of a round (deterministic 0/1 rewards, no residual) with its probability."""
    logp = E.all_log_probs(env, params)
    mu = np.asarray(E.sampler_probs(logp, env.min_p))           # [N, C, K]
    N, C, K = mu.shape
    outs = np.array(list(itertools.product(range(K), repeat=N * C * G)), np.int32).reshape(-1, N, C, G)
    prob = np.prod(np.take_along_axis(np.broadcast_to(mu[None, :, :, None, :], outs.shape + (K,)),
                                      outs[..., None], -1)[..., 0], axis=(1, 2, 3))
    q = np.asarray(env.q)
    rew = q[np.arange(C)[None, None, :, None], outs].astype(np.float32)
    keep = prob > 0
    return outs[keep], rew[keep], prob[keep]


@pytest.mark.parametrize("name,G", [("none", 2), ("xgrpo", 2), ("prp", 2), ("prp_shaping", 2), ("sgt", 1),
                                    ("sgt_gate", 1), ("xgrpo_sgt", 1)])
def test_exact_expectation_equals_brute_force_enumeration(name, G):
    """Enumerate all K^(N*C*G) joint outcomes of a round (G=1 for SGT so its draw is deterministic)."""
    env = E.make_env(E.EnvConfig(num_arms=3, policies=("tabular", "fourier"), min_p=0.0, seed=3),
                     kind_tuples=[(0, 1), (1, 0)])
    params = 0.5 * jax.random.normal(jax.random.PRNGKey(2), E.init_params(env).shape)
    spec = LP.get(name, delta=0.5)
    arms, rew, prob = _all_rounds(env, params, G)
    N = arms.shape[1]

    def one(e, p, a, r):
        rnd = U.Round(a, r, jnp.zeros((N, N) + a.shape[1:]), jnp.ones((N, N) + a.shape[1:], bool))
        return U.round_directions(e, spec, p, rnd, jax.random.PRNGKey(0))[0]

    d = np.asarray(_jit(jax.vmap(one, in_axes=(None, None, 0, 0)))(env, params, arms, rew), np.float64)
    brute = np.tensordot(prob, d, axes=1) / prob.sum()
    ex = np.asarray(_jit(lambda e, p: X.expected_directions(e, spec, p, G)[0])(env, params))
    np.testing.assert_allclose(ex, brute, atol=2e-5, rtol=1e-4)


def test_xgrpo_with_one_policy_is_grpo():
    env = E.make_env(E.EnvConfig(policies=("gaussian",), seed=2))
    params = 0.3 * jax.random.normal(jax.random.PRNGKey(1), E.init_params(env).shape)
    keys = jax.random.split(jax.random.PRNGKey(3), 32)
    f = lambda spec: _jit(jax.vmap(lambda e, p, k: U.sampled_directions(e, spec, p, k, 4)[0],
                                   in_axes=(None, None, 0)))(env, params, keys)
    np.testing.assert_allclose(f(LP.get("xgrpo")), f(LP.get("none")), atol=1e-6)
    g = lambda spec: _jit(lambda e, p: X.expected_directions(e, spec, p, 4)[0])(env, params)
    np.testing.assert_allclose(g(LP.get("xgrpo")), g(LP.get("none")), atol=1e-7)


def test_sgt_without_peer_success_is_grpo():
    """The peer (policy 1) is out of support everywhere: it never succeeds, so SGT never fires for policy 0."""
    env = E.make_env(E.EnvConfig(num_arms=6, policies=("tabular", "gaussian"), seed=4),
                     kind_tuples=[(0, 2), (1, 2), (2, 2), (0, 2)])
    params = E.init_params(env)
    keys = jax.random.split(jax.random.PRNGKey(7), 32)
    f = lambda spec: np.asarray(_jit(jax.vmap(lambda e, p, k: U.sampled_directions(e, spec, p, k, 4)[0],
                                              in_axes=(None, None, 0)))(env, params, keys))[:, 0]
    np.testing.assert_array_equal(f(LP.get("sgt")), f(LP.get("none")))
    ex = lambda n: np.asarray(_jit(lambda e, p: X.expected_directions(e, LP.get(n), p, 4)[0])(env, params))[0]
    np.testing.assert_allclose(ex("sgt"), ex("none"), atol=1e-7)


def test_prp_with_identical_peer_is_grpo_on_the_pooled_group():
    env = E.make_env(E.EnvConfig(num_arms=6, policies=("gaussian", "tabular"), correct_prob=0.7, seed=5))
    env = env.replace(prior=env.prior.at[1].set(env.prior[0]), phis=env.phis.at[1].set(env.phis[0]))
    params = E.init_params(env) + 0.2 * jax.random.normal(jax.random.PRNGKey(0), E.init_params(env).shape)
    params = params.at[1].set(params[0])
    spec, G = LP.get("prp"), 3

    def both(e, p, k):
        logp = E.all_log_probs(e, p)
        rnd = U.sample_round(e, logp, G, k)
        prp = U.round_directions(e, spec, p, rnd, k, 0.0)[0][0]
        arms = jnp.concatenate([rnd.arms[0], rnd.arms[1]], -1)              # the pooled group [C, 2G]
        rew = jnp.concatenate([rnd.rewards[0], rnd.rewards[1]], -1)
        adv = grpo.group_advantages(rew).reshape(-1)

        def loss(th):
            lp = jnp.take_along_axis(E.log_probs(e, 0, th), arms, -1).reshape(-1, 1)
            s, d, _ = grpo.policy_loss(lp, jax.lax.stop_gradient(lp), adv, jnp.ones_like(lp))
            return s / d

        return prp, -jax.grad(loss)(p[0])

    a, b = _jit(jax.vmap(both, in_axes=(None, None, 0)))(env, params, jax.random.split(jax.random.PRNGKey(1), 16))
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_out_of_support_grpo_and_xgrpo_gain_exactly_zero_sgt_gains():
    """Policy 0 (tabular) has exactly zero sampler mass on the correct arms of its oos contexts; the peer
    solves them. Expected GRPO update there is exactly 0; GRPO and XGRPO keep exactly zero success under
    the exact expected flow and in every Monte Carlo seed; SGT's rescue gains success."""
    env = E.make_env(E.EnvConfig(num_arms=6, policies=("tabular", "tabular"), seed=6),
                     kind_tuples=[(2, 0), (2, 1), (0, 0), (1, 2)])
    oos = np.asarray(env.kinds[0]) == E.OOS
    params = E.init_params(env)
    assert np.all(np.asarray(E.success(env, E.all_log_probs(env, params)))[0, oos] == 0.0)
    eu = np.asarray(_jit(lambda e, p: X.expected_directions(e, LP.get("none"), p, 4)[0])(env, params))
    assert np.all(eu[0, oos] == 0.0)
    res = {}
    for name in ("none", "xgrpo", "sgt"):
        spec = LP.get(name)
        ex = M.train_exact(env, spec, G=4, lr=4.0, steps=40, record_every=40, fast_compile=True)
        mc = M.train_mc(env, spec, G=4, lr=4.0, steps=40, seeds=16, record_every=40, fast_compile=True)
        res[name] = (ex["J"][0, -1, 0, oos], mc["J"][0, :, -1, 0][:, oos], ex["rate0"][0, 0])
    for name in ("none", "xgrpo"):
        assert np.all(res[name][0] == 0.0) and np.all(res[name][1] == 0.0), name
    assert res["none"][2] == 0.0
    assert res["sgt"][0].mean() > 0.2 and res["sgt"][1].mean() > 0.2
    assert res["sgt"][2] > 100 * abs(res["xgrpo"][2])


def test_poisson_binomial_and_tables():
    p = jnp.array([[0.2, 0.5, 0.9]])
    pmf = np.asarray(X.poisson_binomial(p))[0]
    brute = np.zeros(4)
    for bits in itertools.product([0, 1], repeat=3):
        brute[sum(bits)] += np.prod([pi if b else 1 - pi for pi, b in zip([0.2, 0.5, 0.9], bits)])
    np.testing.assert_allclose(pmf, brute, atol=1e-6)
    t = np.asarray(X.advantage_table(1, 4, False))
    np.testing.assert_allclose(t[1, 0], np.asarray(grpo.group_advantages(jnp.array([[1.0, 0, 0, 0]])))[0, 0])
    assert t[0, 0] == 0.0 and t[1, 3] == 0.0                     # all-equal groups give zero advantage


def test_env_kinds_and_support():
    env = E.make_env(E.EnvConfig())
    d = E.describe(env)
    assert d["num_contexts"] == 26 and d["kinds"]["oos"]["initial_success"] == 0.0
    assert 0.0 < d["kinds"]["oos"]["initial_raw_mass"] < 0.01
    assert abs(d["kinds"]["easy"]["initial_success"] - 0.45) < 0.02
    kinds = np.asarray(env.kinds)
    assert np.all((kinds != E.OOS).any(0))                        # every context: some policy has mass


def test_run_writes_outputs(tmp_path):
    cfg = lab.LabConfig(probes=("none", "sgt"), group_sizes=(2,), sigmas=(0.0,), headline_G=2, headline_sigma=0.0,
                        steps=10, seeds=2, record_every=5, compile_mode="fast",
                        env=E.EnvConfig(num_arms=4, policies=("tabular", "fourier")))
    s = lab.run(str(tmp_path), config=cfg, verbose=False)
    data = json.loads((tmp_path / "summary.json").read_text())
    assert set(data["probes"]) == {"none", "sgt"}
    for p in data["probes"].values():
        assert {"support", "stability", "final_reward"} <= set(p)
        assert {"update_var", "kl_per_step", "collapse_frac"} <= set(p["stability"])
    assert data["probes"]["none"]["support"] == 0.0
    for f in ("summary.md", "plane.png", "curves.png"):
        assert (tmp_path / f).stat().st_size > 100
    assert s["settings"]["headline"] == {"G": 2, "sigma": 0.0}


def test_yaml_configs_load():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "experiments" / "bandit"
    for name in ("full.yaml", "quick.yaml"):
        cfg = lab.load_config(str(root / name))
        assert isinstance(cfg, lab.LabConfig)
    assert lab.load_config(str(root / "full.yaml")) == lab.default_config(False)
    assert lab.load_config(str(root / "quick.yaml")) == lab.default_config(True)
