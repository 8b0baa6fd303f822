"""mrl_jax.learner: micro-batch accumulation, NaN guard, GRPO learns a trivial task, SGT rescues prompts
the policy cannot solve alone. Uses mrl_jax.models.tiny_model (the model contract)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mrl_jax import see
from mrl_jax.configs import ConfigError
from mrl_jax.rows import own_rows
from mrl_jax.learner import GRPOConfig, iterate, make_grad_fn, make_logp_fn, make_optimizer, make_update_step
from mrl_jax.models import tiny_model

TP = 2


def _model(V, seed=0):
    return tiny_model("llama", V, seed=seed, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1)


@functools.lru_cache(maxsize=None)
def _sampler(graphdef, Tc):
    @jax.jit
    def sample(params, prompt, key):
        model = nnx.merge(graphdef, params)
        ids, lps = prompt, []
        for t in range(Tc):
            logits = model(ids)[:, -1].astype(jnp.float32)
            tok = jax.random.categorical(jax.random.fold_in(key, t), logits)
            lps.append(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, None], 1)[:, 0])
            ids = jnp.concatenate([ids, tok[:, None].astype(jnp.int32)], 1)
        return ids[:, prompt.shape[1]:], jnp.stack(lps, 1)
    return sample


def _batch(prompts, comp, lp, rewards):
    n, Tc = comp.shape
    return own_rows(prompt_ids=prompts, prompt_mask=jnp.ones(prompts.shape, bool), completion_ids=comp,
                 completion_mask=jnp.ones((n, Tc)), old_logp=lp, ref_logp=jnp.zeros((n, Tc)),
                 rewards=rewards.astype(jnp.float32), truncated=jnp.zeros((n,), bool))


def _peer_view(P, K, targets, Tc, N=2):
    """K peer slots per prompt; slot 0 holds the peer's verified success (the target), others empty."""
    S = P * K
    ids = np.zeros((S, Tc), np.int32)
    kind = np.full(S, see.EMPTY, np.int32)
    mask = np.zeros((S, Tc), np.float32)
    for p in range(P):
        ids[p * K], kind[p * K], mask[p * K] = targets[p], see.PEER, 1.0
    stats = np.zeros((P, N, 4), np.float32)
    stats[:, 1] = [1.0, 1.0, 1.0, 1.0]
    return see.empty_view(P, K, Tc, Tc, N).replace(
        completion_ids=jnp.asarray(ids), completion_mask=jnp.asarray(mask), row_kind=jnp.asarray(kind),
        dst_chunk=jnp.where(jnp.asarray(mask) > 0, jnp.arange(Tc)[None], -1).astype(jnp.int32),
        chunk_valid=jnp.asarray(mask) > 0, src_chunk_logp=jnp.asarray(mask) * -0.1,
        rewards=jnp.asarray((kind == see.PEER).astype(np.float32)),
        source=jnp.asarray(np.where(kind == see.PEER, 1, -1), jnp.int32), peer_stats=jnp.asarray(stats))


def test_config_validation():
    with pytest.raises(ConfigError, match="loss_type"):
        GRPOConfig(loss_type="sum")
    with pytest.raises(ConfigError, match="epsilon"):
        GRPOConfig(epsilon=1.5)
    with pytest.raises(ValueError, match="total_steps"):
        make_optimizer(1e-3, schedule="cosine")


def test_micro_batch_accumulation_equals_full_batch():
    V, P, G, Tc, K = 16, 3, 2, 3, 2
    graphdef, params = nnx.split(_model(V))
    rs = np.random.RandomState(0)
    prompts = jnp.asarray(rs.randint(3, V, (P, TP)), jnp.int32)
    comp = jnp.asarray(rs.randint(0, V, (P * G, Tc)), jnp.int32)
    batch = _batch(prompts, comp, jnp.asarray(rs.uniform(-3.5, -2.0, (P * G, Tc)), jnp.float32),
                   jnp.asarray([0, 1, 0, 0, 1, 1], jnp.float32))
    view = _peer_view(P, K, rs.randint(0, V, (P, Tc)), Tc)
    view = view.replace(row_kind=jnp.where(view.row_kind == see.EMPTY, see.PEER, view.row_kind),
                        completion_mask=jnp.ones_like(view.completion_mask), chunk_valid=jnp.ones_like(view.chunk_valid),
                        dst_chunk=jnp.tile(jnp.arange(Tc), (P * K, 1)))
    cfg = GRPOConfig(num_generations=G, max_completion_length=Tc, loss_type="grpo", beta=0.0)
    full = make_grad_fn(graphdef, "prp+sgt", cfg, 0, jit=True)(params, batch, view, jax.random.PRNGKey(1))
    micro = make_grad_fn(graphdef, "prp+sgt", cfg, 5, jit=True)(params, batch, view, jax.random.PRNGKey(1))
    np.testing.assert_allclose(float(micro[0]), float(full[0]), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6),
                 micro[1], full[1])
    for k in ("prp/ess", "sgt/rows_fired", "entropy", "clip_ratio/low_mean"):
        np.testing.assert_allclose(float(micro[2][k]), float(full[2][k]), rtol=1e-5, err_msg=k)
    assert float(full[2]["sgt/rows_fired"]) > 0 and float(full[2]["prp/rows"]) > 0


@pytest.mark.parametrize("micro", [0, 4])
def test_only_weighted_peer_slots_are_computed_and_the_gradient_equals_the_padded_layout(micro):
    """32 peer slots, one filled per prompt: the update computes the own rows and one chunk of peers, and its
    loss, gradient and metrics equal the full padded layout's (every row in one forward, no skipping)."""
    from mrl_jax import objective
    from mrl_jax.learner import assemble_rows, rows_logp
    V, P, G, Tc, K = 16, 4, 2, 3, 8
    graphdef, params = nnx.split(_model(V))
    rs = np.random.RandomState(1)
    prompts = jnp.asarray(rs.randint(3, V, (P, TP)), jnp.int32)
    batch = _batch(prompts, jnp.asarray(rs.randint(0, V, (P * G, Tc)), jnp.int32),
                   jnp.asarray(rs.uniform(-3.5, -2.0, (P * G, Tc)), jnp.float32),
                   jnp.asarray([0, 0, 1, 0, 0, 0, 1, 1], jnp.float32))
    view = _peer_view(P, K, rs.randint(0, V, (P, Tc)), Tc)
    cfg = GRPOConfig(num_generations=G, max_completion_length=Tc, loss_type="grpo", beta=0.0)
    key = jax.random.PRNGKey(2)
    loss, grads, m = make_grad_fn(graphdef, "prp+sgt", cfg, micro, jit=True)(params, batch, view, key)

    def padded(p):
        logp_fn = lambda r: rows_logp(nnx.merge(graphdef, p), r.prompt_ids, r.prompt_mask, r.completion_ids,
                                      r.completion_mask)
        rows = assemble_rows(batch, view)
        return objective.objective(logp_fn, rows, view, key, __import__("mrl_jax").probes.make_probe("prp+sgt"),
                                   cfg)
    (ref_loss, ref_m), ref_grads = jax.jit(jax.value_and_grad(padded, has_aux=True))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6),
                 grads, ref_grads)
    for k in ("prp/rows", "prp/ess", "sgt/rows_fired", "entropy"):
        np.testing.assert_allclose(float(m[k]), float(ref_m[k]), rtol=1e-5, err_msg=k)
    assert float(m["sgt/rows_fired"]) > 0 and float(m["prp/rows"]) > 0
    own, chunk = P * G, (micro or 8)
    own_computed = -(-own // micro) * micro if micro else own
    assert float(m["rows_computed"]) == own_computed + chunk < own + P * K


@functools.lru_cache(maxsize=None)
def _grpo_env(V=16, P=4, G=8, Tc=1):
    """One tiny policy + one compiled 'none' update shared by the NaN-guard and GRPO-learning tests."""
    graphdef, params = nnx.split(_model(V))
    cfg = GRPOConfig(num_generations=G, max_completion_length=Tc, loss_type="dapo")
    opt = make_optimizer(2e-2, max_grad_norm=1.0)
    return graphdef, params, opt, make_update_step(graphdef, opt, "none", cfg, donate=False)


def test_nan_guard_leaves_params_unchanged():
    V, P, G, Tc = 16, 4, 8, 1
    graphdef, params, opt, update = _grpo_env(V, P, G, Tc)
    prompts = jnp.full((P, TP), 3, jnp.int32)
    comp = jnp.full((P * G, Tc), 5, jnp.int32)
    r = jnp.asarray(np.arange(P * G) % 2, jnp.float32)
    bad = _batch(prompts, comp, jnp.full((P * G, Tc), -2.0), r.at[3].set(np.nan))
    state = opt.init(params)
    p1, s1, m = update(params, state, bad, see.empty_view(P, 1, Tc, 1, 1), jax.random.PRNGKey(0))
    assert float(m["skipped"]) == 1.0 and float(m["skipped_in_a_row"]) == 1.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), (p1, s1.inner_state),
                 (params, state.inner_state))
    _, s1, m = update(params, s1, bad, see.empty_view(P, 1, Tc, 1, 1), jax.random.PRNGKey(0))
    assert int(s1.notfinite_count) == 2 and int(s1.total_notfinite) == 2   # the count lives in the optimizer state
    p2, s2, m = update(params, s1, bad.replace(rewards=r), see.empty_view(P, 1, Tc, 1, 1), jax.random.PRNGKey(0))
    assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
    assert int(s2.notfinite_count) == 0 and int(s2.total_notfinite) == 2 and float(m["skipped_in_a_row"]) == 0.0
    with pytest.raises(TypeError, match="skip_non_finite"):   # an optimizer that cannot skip is refused
        make_update_step(graphdef, optax.adam(1e-3), "none", GRPOConfig(num_generations=G, max_completion_length=Tc),
                         jit=False)(params, optax.adam(1e-3).init(params), bad, see.empty_view(P, 1, Tc, 1, 1),
                                    jax.random.PRNGKey(0))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params)))


def test_iterate_is_the_loop_of_updates_with_the_reference_synced_between():
    """mu = 3 updates on the same rows in one jitted function equal 3 calls of the update with keys
    fold_in(key, it) and TRL's sync after update numbers divisible by 2 (updates 4..6 of the run: after 4 and 6);
    own rows keep pi_old; skipped counts every iteration."""
    V, P, G, Tc = 16, 2, 4, 2
    graphdef, params = nnx.split(_model(V))
    cfg = GRPOConfig(num_generations=G, max_completion_length=Tc, loss_type="dapo", beta=0.1)
    opt = make_optimizer(5e-2)
    update = make_update_step(graphdef, opt, "none", cfg, jit=False)
    prompts = jnp.asarray(np.arange(P * TP).reshape(P, TP) % V, jnp.int32)
    comp = jnp.asarray(np.arange(P * G * Tc).reshape(P * G, Tc) * 7 % V, jnp.int32)
    rows = _batch(prompts, comp, jnp.full((P * G, Tc), -2.5), jnp.asarray(np.arange(P * G) % 3, jnp.float32))
    view, key = see.empty_view(P, 1, Tc, 1, 1), jax.random.PRNGKey(3)
    ref = jax.tree.map(lambda x: x + 0.01, params)
    mix = lambda p, r: jax.tree.map(lambda a, b: 0.5 * a + 0.5 * b, p, r)  # noqa: E731
    sync = lambda p, r, step: jax.lax.cond(step % 2 == 0, lambda: mix(p, r), lambda: r)  # noqa: E731
    rows = rows.replace(ref_logp=make_logp_fn(graphdef, cfg)(ref, rows))

    p, s, r, loop = params, opt.init(params), ref, []
    one = jax.jit(update)
    for it in range(3):
        p, s, m = one(p, s, rows, view, jax.random.fold_in(key, it))
        r = mix(p, r) if (3 + it + 1) % 2 == 0 else r
        loop.append(m)
    epochs = jax.jit(iterate(update, 3, sync))
    got = epochs(params, opt.init(params), ref, rows, view, key, jnp.int32(3))
    for a, b in zip(jax.tree.leaves(got[:3]), jax.tree.leaves((p, s, r))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    assert len({float(m["loss"]) for m in loop}) == 3   # each iteration saw other params
    np.testing.assert_allclose(float(got[3]["loss"]), float(loop[-1]["loss"]), rtol=2e-5, atol=1e-7)
    assert float(got[3]["skipped"]) == 0.0
    # a non-finite batch (updates 6..8): every iteration skipped and counted, params unchanged
    bad = rows.replace(rewards=rows.rewards.at[0].set(np.nan))
    p3, _, r3, m3 = epochs(params, opt.init(params), ref, bad, view, key, jnp.int32(5))
    assert float(m3["skipped"]) == 3.0 and float(m3["skipped_in_a_row"]) == 3.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p3, params)
    # the reference still syncs after updates 6 and 8: twice toward the unchanged params
    twice = mix(params, mix(params, ref))
    for a, b in zip(jax.tree.leaves(r3), jax.tree.leaves(twice)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_grpo_learns_to_emit_a_fixed_token():
    V, P, G, Tc, TARGET = 16, 4, 8, 1, 5
    graphdef, params, opt, update = _grpo_env(V, P, G, Tc)
    sample = _sampler(graphdef, Tc)
    prompts = jnp.asarray(np.random.RandomState(0).randint(3, V, (P, TP)), jnp.int32)
    rep = jnp.repeat(prompts, G, axis=0)
    view = see.empty_view(P, 1, Tc, 1, 1)
    state, key, curve = opt.init(params), jax.random.PRNGKey(0), []
    for step in range(15):
        key, k1, k2 = jax.random.split(key, 3)
        comp, lp = sample(params, rep, k1)
        r = (comp[:, 0] == TARGET).astype(jnp.float32)
        params, state, m = update(params, state, _batch(prompts, comp, lp, r), view, k2)
        curve.append(float(m["reward_mean"]))
        assert float(m["skipped"]) == 0.0
    probs = jax.nn.softmax(nnx.merge(graphdef, params)(prompts)[:, -1])[:, TARGET]
    assert np.mean(curve[:3]) < 0.3 and float(jnp.min(probs)) > 0.8, (curve, probs)


@pytest.mark.parametrize("probe", ["none", "sgt"])
def test_only_sgt_learns_prompts_solved_by_a_peer(probe):
    V, P, G, Tc, K = 48, 3, 4, 3, 2
    graphdef, params = nnx.split(_model(V, seed=1))
    params0 = jax.tree.map(jnp.copy, params)
    cfg = GRPOConfig(num_generations=G, max_completion_length=Tc, loss_type="grpo")
    opt = make_optimizer(2e-2, max_grad_norm=1.0)
    update = make_update_step(graphdef, opt, probe, cfg)
    sample = _sampler(graphdef, Tc)
    rs = np.random.RandomState(1)
    prompts = jnp.asarray(rs.randint(3, V, (P, TP)), jnp.int32)
    targets = rs.randint(3, V, (P, Tc))
    view = _peer_view(P, K, targets, Tc)
    rep = jnp.repeat(prompts, G, axis=0)
    tgt = jnp.repeat(jnp.asarray(targets), G, axis=0)
    state, key, fired, rewards = opt.init(params), jax.random.PRNGKey(2), [], []
    for step in range(25):
        key, k1, k2 = jax.random.split(key, 3)
        comp, lp = sample(params, rep, k1)
        r = jnp.all(comp == tgt, axis=1).astype(jnp.float32)
        params, state, m = update(params, state, _batch(prompts, comp, lp, r), view, k2)
        rewards.append(float(m["reward_mean"]))
        fired.append(float(m.get("sgt/rows_fired", 0.0)))

    def p_target(prm):
        ids = jnp.concatenate([prompts, jnp.asarray(targets, jnp.int32)], 1)
        logp = jax.nn.log_softmax(nnx.merge(graphdef, prm)(ids)[:, TP - 1:-1])
        return jnp.exp(jnp.sum(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1)[..., 0], 1))

    if probe == "none":    # all-zero groups: GRPO has no gradient, the policy never moves
        assert max(rewards) == 0.0
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params0)
    else:
        assert fired[0] == P and float(jnp.min(p_target(params))) > 0.5, (p_target(params), rewards)
        assert float(jnp.max(p_target(params0))) < 1e-3
        assert rewards[-1] > 0.0
