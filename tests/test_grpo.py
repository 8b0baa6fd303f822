"""mrl_jax.grpo: advantages, surrogate gradients, clipping, aggregations, k3 KL, chunked log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mrl_jax import grpo

EPS = 1e-4


def test_group_advantages_hand_computed():
    r = jnp.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 0.0, 2.0]])
    adv = grpo.group_advantages(r)
    # group 0: mean .25, unbiased std sqrt((.75^2 + 3 * .25^2) / 3) = .5
    np.testing.assert_allclose(adv[0], np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + EPS), rtol=1e-6)
    np.testing.assert_allclose(adv[1], 0.0, atol=0)                      # zero std -> 0 / eps = 0
    s = np.sqrt(4 * 1.0 / 3)                                              # group 2: mean 1, deviations +-1
    np.testing.assert_allclose(adv[2], np.array([-1, 1, -1, 1]) / (s + EPS), rtol=1e-6)
    np.testing.assert_allclose(grpo.group_advantages(r, "none")[0], [0.75, -0.25, -0.25, -0.25], rtol=1e-6)
    bstd = np.std(np.asarray(r), ddof=1)
    np.testing.assert_allclose(grpo.group_advantages(r, "batch")[2], np.array([-1, 1, -1, 1]) / (bstd + EPS),
                               rtol=1e-6)
    np.testing.assert_allclose(grpo.group_advantages(jnp.array([[3.0], [1.0]])), 0.0)   # G = 1
    with pytest.raises(ValueError):
        grpo.group_advantages(r, "bogus")


def test_pooled_advantages_hand_computed_and_weights():
    r = jnp.array([[[1.0, 0.0]], [[0.0, 0.0]]])                            # N=2, P=1, G=2
    adv = grpo.pooled_advantages(r)                                       # mean .25, unbiased std .5
    np.testing.assert_allclose(adv[0, 0], np.array([0.75, -0.25]) / (0.5 + EPS), rtol=1e-6)
    np.testing.assert_allclose(adv[1, 0], np.array([-0.25, -0.25]) / (0.5 + EPS), rtol=1e-6)
    # peer weight 0 removes policy 1 from the baseline: policy 0 gets its own group advantages
    w = grpo.pooled_advantages(r, peer_weights=jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(w[0], grpo.group_advantages(r[0]), rtol=1e-6)
    cw = grpo.capability_weights(jnp.array([[[1.0, 1.0]], [[1.0, 0.0]]]), floor=0.0)
    np.testing.assert_allclose(cw, [1.0 / 0.75, 0.5 / 0.75], rtol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4), min_size=1, max_size=5))
def test_group_advantages_match_numpy_and_xgrpo_single_policy(rows):
    r = np.array(rows, np.float32)
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + EPS)
    np.testing.assert_allclose(grpo.group_advantages(jnp.asarray(r)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grpo.pooled_advantages(jnp.asarray(r)[None])[0], expected, rtol=1e-5, atol=1e-5)


def _setup(B=3, T=5, V=7, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    theta = jax.random.normal(k1, (B, T, V))
    targets = jax.random.randint(k2, (B, T), 0, V)
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]][:B], jnp.float32)
    return theta, targets, mask


def test_gradient_at_ratio_one_is_minus_a_grad_logp():
    theta, targets, mask = _setup()
    adv = jnp.array([1.0, -2.0, 0.5])
    old = grpo.token_logprobs(theta, targets)

    def loss(th, lt):
        lp = grpo.token_logprobs(th, targets)
        s, d, _ = grpo.policy_loss(lp, old, adv, mask, loss_type=lt)
        return s / d

    for lt, norm in [("grpo", lambda: mask.sum(1, keepdims=True) * 3), ("dapo", lambda: mask.sum())]:
        def explicit(th):
            lp = grpo.token_logprobs(th, targets)
            return -jnp.sum(adv[:, None] * lp * mask / norm())
        np.testing.assert_allclose(jax.jit(jax.grad(loss), static_argnums=1)(theta, lt),
                                   jax.jit(jax.grad(explicit))(theta), rtol=1e-5, atol=1e-7)


def test_clipping_zeroes_gradient_outside_trust_region():
    theta, targets, mask = _setup()
    lp0 = grpo.token_logprobs(theta, targets)
    m = jnp.ones_like(mask)

    def grad_with(shift, adv):
        old = lp0 - shift                     # ratio = exp(shift)

        def f(th):
            s, d, _ = grpo.policy_loss(grpo.token_logprobs(th, targets), old, adv, m, epsilon=0.2)
            return s / d
        return jax.jit(jax.grad(f))(theta)

    pos, neg = jnp.ones(3), -jnp.ones(3)
    assert float(jnp.abs(grad_with(0.5, pos)).max()) == 0.0        # ratio 1.65 > 1.2 with A > 0
    assert float(jnp.abs(grad_with(-0.5, neg)).max()) == 0.0       # ratio 0.61 < 0.8 with A < 0
    assert float(jnp.abs(grad_with(0.5, neg)).max()) > 0.0         # pessimistic side keeps the gradient
    assert float(jnp.abs(grad_with(0.1, pos)).max()) > 0.0         # inside the region
    # clip-higher: epsilon_high=0.7 lets ratio 1.65 through for A > 0
    old = lp0 - 0.5
    g = jax.grad(lambda th: grpo.policy_loss(grpo.token_logprobs(th, targets), old, pos, m,
                                             epsilon_high=0.7)[0])(theta)
    assert float(jnp.abs(g).max()) > 0.0
    _, _, met = grpo.policy_loss(lp0, old, pos, m)
    assert float(met["clip_ratio/high_mean"][0] / met["clip_ratio/high_mean"][1]) == 1.0


def test_aggregations_on_ragged_batch():
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)          # lengths 3 and 1, L = 4
    lp = jnp.zeros((2, 4))
    adv = jnp.array([1.0, -2.0])                                          # ratio 1: per-token loss = -A
    expect = {"grpo": (0.5, 2.0), "dapo": (-0.25, 4.0), "bnpo": (-0.25, 4.0), "dr_grpo": (-0.125, 8.0)}
    for lt, (val, den) in expect.items():
        s, d, _ = grpo.policy_loss(lp, lp, adv, mask, loss_type=lt, max_completion_length=4)
        assert float(d) == den, lt
        np.testing.assert_allclose(float(s / d), val, rtol=1e-6, err_msg=lt)
    # split into two micro-batches: summed sums / summed denominators == full value
    for lt in expect:
        parts = [grpo.policy_loss(lp[i:i + 1], lp[i:i + 1], adv[i:i + 1], mask[i:i + 1], loss_type=lt,
                                  max_completion_length=4) for i in range(2)]
        np.testing.assert_allclose(sum(float(p[0]) for p in parts) / sum(float(p[1]) for p in parts),
                                   expect[lt][0], rtol=1e-6)
    with pytest.raises(ValueError):
        grpo.policy_loss(lp, lp, adv, mask, loss_type="mean")


def test_kl_k3_formula_and_beta_term():
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    ref = jnp.array([[-1.5, -1.0, -0.5]])
    d = np.asarray(ref - lp)
    np.testing.assert_allclose(grpo.kl_k3(lp, ref), np.exp(d) - d - 1, rtol=1e-6)
    assert float(grpo.kl_k3(lp, lp).max()) == 0.0
    m = jnp.ones_like(lp)
    s0, d0, _ = grpo.policy_loss(lp, lp, jnp.zeros(1), m, loss_type="dapo")
    s1, d1, met = grpo.policy_loss(lp, lp, jnp.zeros(1), m, beta=0.1, ref_logp=ref, loss_type="dapo")
    np.testing.assert_allclose(float(s1 / d1 - s0 / d0), 0.1 * np.mean(np.exp(d) - d - 1), rtol=1e-6)
    np.testing.assert_allclose(float(met["kl"][0] / met["kl"][1]), np.mean(np.exp(d) - d - 1), rtol=1e-6)
    with pytest.raises(ValueError):
        grpo.policy_loss(lp, lp, jnp.zeros(1), m, beta=0.1)


def test_sequence_level_ratio_is_exp_mean_log_ratio():
    lp = jnp.array([[-1.0, -2.0, -3.0, 0.0]])
    old = jnp.array([[-1.2, -2.1, -2.9, 5.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    _, _, met = grpo.policy_loss(lp, old, jnp.ones(1), m, importance_sampling_level="sequence")
    np.testing.assert_allclose(float(met["ratio_mean"][0] / met["ratio_mean"][1]), np.exp(0.2 / 3), rtol=1e-5)


def test_chunked_logprobs_match_full_log_softmax():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    h = jax.random.normal(k1, (2, 11, 8))
    W = jax.random.normal(k2, (8, 50))
    t = jax.random.randint(k3, (2, 11), 0, 50)
    full = grpo.token_logprobs(h @ W, t)
    stats = jax.jit(grpo.chunked_token_stats, static_argnums=(1, 3))
    head = lambda x: x @ W
    for cs in (1, 4, 11, 128):
        lp, ent = stats(h, head, t, cs)
        np.testing.assert_allclose(lp, full, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ent, grpo.token_entropy(h @ W), rtol=1e-5, atol=1e-5)
    g_full = jax.jit(jax.grad(lambda w: jnp.sum(grpo.token_logprobs(h @ w, t))))(W)
    g_chunk = jax.jit(jax.grad(lambda w: jnp.sum(grpo.chunked_token_logprobs(h, lambda x: x @ w, t, 4))))(W)
    np.testing.assert_allclose(g_chunk, g_full, rtol=1e-4, atol=1e-5)


def test_chunked_logprobs_bound_the_logits_memory():
    B, T, D, V = 2, 256, 16, 4096                  # full f32 logits: 8 MiB; one 16-token chunk: 0.5 MiB
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    t = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def temp_bytes(cs):
        f = jax.grad(lambda w_, h_, t_: jnp.sum(grpo.chunked_token_logprobs(h_, lambda x: x @ w_, t_, cs)))
        mem = jax.jit(f).lower(w, h, t).compile().memory_analysis()
        if mem is None:
            pytest.skip("backend reports no memory analysis")
        return mem.temp_size_in_bytes

    full, chunked = temp_bytes(T), temp_bytes(16)
    assert full >= B * T * V * 4 and chunked < full / 4, (full, chunked)
