"""The GRPO-with-probes objective written once (mrl_jax.objective): estimator, composition, normalisation,
aggregation and metric definitions, against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax import objective, probes, see
from mrl_jax.learner import GRPOConfig, make_grad_fn
from mrl_jax.models import tiny_model
from mrl_jax.rows import concat, own_rows, peer_rows

KEY = jax.random.key(0)


# ----------------------------------------------------------------------------- PRP's estimator on a toy

def _toy(level: str):
    """Two tokens, R = 1 iff both are 1; consumer pi_i = 0.5 per token (logits 0), peer pi_j = 0.9 per token.
    The peer's 100 rows are its sequence distribution exactly (81 x (1,1), 9 x (1,0), 9 x (0,1), 1 x (0,0)).
    Returns (-d loss / d theta[0, 1], the pooled scale s + eps, the PG denominator)."""
    seqs = [(1, 1)] * 81 + [(1, 0)] * 9 + [(0, 1)] * 9 + [(0, 0)]
    ids = jnp.asarray(seqs, jnp.int32)
    S = ids.shape[0]
    r = jnp.asarray([float(a == b == 1) for a, b in seqs])
    lpj = jnp.where(ids == 1, jnp.log(0.9), jnp.log(0.1))
    stats = jnp.zeros((1, 2, 4)).at[0, 1].set(jnp.asarray([S, r.sum(), (r * r).sum(), r.sum()]))
    view = see.SeeView(completion_ids=ids, completion_mask=jnp.ones((S, 2)), dst_chunk=jnp.tile(jnp.arange(2), (S, 1)),
                       src_chunk_logp=lpj, chunk_valid=jnp.ones((S, 2), bool), rewards=r,
                       source=jnp.ones((S,), jnp.int32), row_kind=jnp.full((S,), probes.PEER, jnp.int32),
                       prompt_slot=jnp.zeros((S,), jnp.int32), truncated=jnp.zeros((S,), bool), peer_stats=stats,
                       consumer=jnp.int32(0))
    own = own_rows(jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool), jnp.zeros((1, 2), jnp.int32),
                   jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.zeros((1,)), jnp.zeros((1,), bool),
                   consumer=0)                                          # one own row: reward 0, no tokens
    rows = concat(own, peer_rows(view, own.prompt_ids[:1], own.prompt_mask[:1]))
    cfg = GRPOConfig(num_generations=1, max_completion_length=2)
    probe = probes.prp(level=level, mode="none")

    def loss(theta):
        def logp_fn(rw):
            lp = jnp.take_along_axis(jax.nn.log_softmax(theta)[None], rw.completion_ids[..., None], -1)[..., 0]
            return lp, jnp.zeros_like(lp)
        return objective.objective(logp_fn, rows, view, KEY, probe, cfg)[0]

    g = -jax.jit(jax.grad(loss))(jnp.zeros((2, 2)))
    allr = np.concatenate([[0.0], np.asarray(r)])
    return float(g[0, 1]), float(np.std(allr, ddof=1) + 1e-4), float(S + 1)


@pytest.mark.parametrize("level,true_grad", [("sequence", 0.125), ("chunk", 0.225)])
def test_prp_estimator_on_the_two_token_toy(level, true_grad):
    """Sequence-level weights give E_i[R grad log pi_i] = 0.125 exactly (the baseline cancels); per-chunk
    weights give 0.225 (each chunk's ratio ignores the other token)."""
    g, scale, den = _toy(level)
    # -grad = (1/den) * sum_rows (1/|y|) w A dlogpi/dtheta[0,1] = 100 * E_j[w (R - b) g] / (2 * den * scale)
    np.testing.assert_allclose(g * 2 * den * scale / 100, true_grad, rtol=1e-4)


# ----------------------------------------------------------------------------- composition

def _pooled_setup():
    P, G = 2, 3
    own = jnp.asarray([1, 0, 0, 0, 1, 1], jnp.float32)
    own_r = own_rows(jnp.zeros((P, 1), jnp.int32), jnp.ones((P, 1), bool), jnp.ones((P * G, 2), jnp.int32),
                     jnp.ones((P * G, 2)), jnp.zeros((P * G, 2)), jnp.zeros((P * G, 2)), own,
                     jnp.zeros((P * G,), bool), consumer=0)
    view = see.empty_view(P, 2, 2, 2, 2)
    # the peer (policy 1) succeeds on 6 of 8 samples, the consumer on 3 of 6: capability weights differ from 1
    stats = jnp.zeros((P, 2, 4)).at[:, 1].set(jnp.asarray([[4, 4, 4, 4], [4, 2, 2, 2]], jnp.float32))
    view = view.replace(peer_stats=stats, completion_ids=jnp.ones((P * 2, 2), jnp.int32),
                        completion_mask=jnp.ones((P * 2, 2)),
                        dst_chunk=jnp.tile(jnp.arange(2), (P * 2, 1)), chunk_valid=jnp.ones((P * 2, 2), bool),
                        rewards=jnp.asarray([1, 1, 0, 0], jnp.float32), source=jnp.ones((P * 2,), jnp.int32),
                        row_kind=jnp.full((P * 2,), probes.PEER, jnp.int32))
    return concat(own_r, peer_rows(view, own_r.prompt_ids[::G], own_r.prompt_mask[::G])), view


def test_pooling_probes_commute_and_keep_hacpo_weights():
    rows, view = _pooled_setup()
    cfg = GRPOConfig(num_generations=3, max_completion_length=2)
    adv = lambda p: objective.prepare(rows, view, KEY, probes.make_probe(p), cfg,
                                      lambda r: jnp.zeros(r.completion_ids.shape))[0].advantages
    a1 = adv([probes.xgrpo(capability_weighted=True), probes.prp()])
    a2 = adv([probes.prp(), probes.xgrpo(capability_weighted=True)])
    np.testing.assert_allclose(a1, a2, rtol=1e-6)
    hacpo = probes.pooled_row_advantages(rows, view, "group", 1e-4, capability_weighted=True)
    plain = probes.pooled_row_advantages(rows, view, "group", 1e-4)
    np.testing.assert_allclose(a1[:6], hacpo[:6], rtol=1e-6)           # HACPO survives the chain
    assert np.abs(np.asarray(hacpo[:6] - plain[:6])).max() > 1e-3      # ... and it matters here
    np.testing.assert_allclose(adv("xgrpo+prp")[:6], plain[:6], rtol=1e-6)


def test_a_chain_pools_its_group_baselines_once(monkeypatch):
    """xgrpo + prp (+ the worked-example hedge) read one pooled baseline: the pooled statistic is traced once per
    chain (it was computed in every member's extend and advantages, with and without capability weights), the
    advantages leave the rows with the baseline dropped, and HACPO asked by the last member still applies to all."""
    from experiments.probes.hedge import hedge
    from mrl_jax.probes import _pooling

    rows, view = _pooled_setup()
    cfg = GRPOConfig(num_generations=3, max_completion_length=2)
    calls = []
    real = _pooling.grpo.pooled_advantages_from_stats
    monkeypatch.setattr(_pooling.grpo, "pooled_advantages_from_stats",
                        lambda *a, **k: calls.append(k["capability_weighted"]) or real(*a, **k))
    chain = probes.chain(probes.xgrpo(), probes.prp(), hedge(probes.RunOptions(), lam=0.5),
                         probes.xgrpo(capability_weighted=True))
    out, _ = objective.prepare(rows, view, KEY, chain, cfg, lambda r: jnp.zeros(r.completion_ids.shape))
    assert calls == [True] and out.pooled_advantages is None
    hacpo = probes.pooled_row_advantages(rows, view, capability_weighted=True)
    np.testing.assert_allclose(out.advantages[:6], hacpo[:6], rtol=1e-6)   # xgrpo last: the pooled baseline
    with pytest.raises(ValueError, match="success thresholds differ"):
        probes.chain(probes.xgrpo(capability_weighted=True), probes.prp(options=probes.RunOptions(tau=0.5)))


# ----------------------------------------------------------------------------- SGT normalisation

@pytest.mark.parametrize("normalize,den", [("rescues", 1.0), ("prompts", 2.0)])
def test_sgt_normalize(normalize, den):
    rows, view = _pooled_setup()
    rows = rows.replace(rewards=rows.rewards.at[:3].set(0.0))          # prompt 0: own failure, peer successes
    probe = probes.sgt(lam=0.5, normalize=normalize)
    rows2, m = probe.extend(rows, view, KEY)
    assert float(m["sgt/rows_fired"][0]) == 1.0
    logp = jnp.full(rows.completion_ids.shape, -2.0)
    s, d, _ = probe.loss_terms(logp, rows2)
    np.testing.assert_allclose(float(s[0] / d[0]), -0.5 * -2.0 / den, rtol=1e-6)


# ----------------------------------------------------------------------------- learner: bnpo and metrics

@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", 40, seed=0, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    return nnx.split(model)


def _batch(P=2, G=4, T=4, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((P * G, T), np.float32)
    mask[:4, 2:] = 0.0                                                  # first micro-batch has fewer tokens
    return own_rows(prompt_ids=jnp.asarray(rng.integers(1, 40, (P, 3)), jnp.int32), prompt_mask=jnp.ones((P, 3), bool),
                 completion_ids=jnp.asarray(rng.integers(1, 40, (P * G, T)), jnp.int32),
                 completion_mask=jnp.asarray(mask), old_logp=jnp.asarray(rng.normal(-3.7, 0.3, (P * G, T)), jnp.float32),
                 ref_logp=jnp.asarray(rng.normal(-3.6, 0.3, (P * G, T)), jnp.float32),
                 rewards=jnp.asarray([1, 0, 0, 1, 0.5, 0, 0, 1], jnp.float32), truncated=jnp.zeros((P * G,), bool))


def test_bnpo_is_trls_local_token_mean(tiny):
    gd, params = tiny
    batch, view = _batch(), see.empty_view(2, 1, 4, 4, 2)
    cfg = lambda lt: GRPOConfig(num_generations=4, max_completion_length=4, loss_type=lt)
    grads = lambda lt, mb: make_grad_fn(gd, "none", cfg(lt), mb, jit=True)(params, batch, view, KEY)[1]
    close = lambda a, b: jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), a, b)
    close(grads("bnpo", 0), grads("dapo", 0))                           # one micro-batch: the same
    # two micro-batches (4 rows each, 8 vs 16 tokens): mean of the per-micro-batch token means
    one_prompt = make_grad_fn(gd, "none", cfg("dapo"), jit=True)
    parts = [one_prompt(params, batch.take(a, a + 4).replace(num_prompts=1), see.empty_view(1, 1, 4, 4, 2), KEY)[1]
             for a in (0, 4)]
    bnpo = grads("bnpo", 4)
    close(bnpo, jax.tree.map(lambda a, b: (a + b) / 2, *parts))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(bnpo), jax.tree.leaves(grads("dapo", 4))))
    assert diff > 1e-6                                                  # not dapo any more


def test_trl_named_metrics_cover_own_tokens_only(tiny):
    gd, params = tiny
    batch = _batch()
    P, G, T, K = 2, 4, 4, 2
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 40, (P * K, T)), jnp.int32)
    view = see.empty_view(P, K, T, T, 2).replace(
        completion_ids=ids, completion_mask=jnp.ones((P * K, T)), dst_chunk=jnp.tile(jnp.arange(T), (P * K, 1)),
        chunk_valid=jnp.ones((P * K, T), bool), src_chunk_logp=jnp.full((P * K, T), -3.0),
        rewards=jnp.asarray([1, 0, 1, 1], jnp.float32), source=jnp.ones((P * K,), jnp.int32),
        row_kind=jnp.full((P * K,), probes.PEER, jnp.int32),
        peer_stats=jnp.zeros((P, 2, 4)).at[:, 1].set(jnp.asarray([[2, 1, 1, 1], [2, 2, 2, 2]], jnp.float32)))
    cfg = GRPOConfig(num_generations=G, max_completion_length=T, beta=0.1)
    m_none = make_grad_fn(gd, "none", cfg, jit=True)(params, batch, view, KEY)[2]
    m_prp = make_grad_fn(gd, "prp", cfg, jit=True)(params, batch, view, KEY)[2]
    assert float(m_prp["prp/rows"]) == P * K
    for k in ("kl", "ratio_mean", "entropy"):     # clip ratios differ: PRP pools the own advantages
        np.testing.assert_allclose(float(m_prp[k]), float(m_none[k]), rtol=1e-5, atol=1e-7, err_msg=k)
    r = np.asarray(batch.rewards).reshape(P, G)
    np.testing.assert_allclose(float(m_none["reward_std"]), np.std(r, axis=1, ddof=1).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m_none["reward_std_batch"]), np.std(r), rtol=1e-5)
