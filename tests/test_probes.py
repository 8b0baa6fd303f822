"""mrl_jax.probes: helpers, identities (XGRPO = GRPO for one policy, PRP with self-peer = pooled GRPO, SGT
gradient and gate, chain = sum of parts) on a tiny bigram LM that follows the model contract."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from mrl_jax import grpo, probes, see
from mrl_jax.rows import own_rows
from mrl_jax.learner import GRPOConfig, assemble_rows, make_grad_fn, rows_logp

V, P, G, TP, TC = 11, 2, 3, 2, 4


class BigramLM(nnx.Module):
    """hidden = embedding of the current token, head = linear (the learner's .hidden/.hidden_prefix/.head
    contract, compiles fast)."""

    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(V, 8, rngs=rngs)
        self.out = nnx.Linear(8, V, rngs=rngs)

    def hidden(self, ids, *, positions=None, attention_mask=None):
        return self.embed(ids)

    def hidden_prefix(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return self.embed(prompt_ids[:, -1]), self.embed(completion_ids)

    def head(self, h):
        return self.out(h)


MODEL = BigramLM()
GRAPHDEF, PARAMS = nnx.split(MODEL)
CFG = GRPOConfig(num_generations=G, max_completion_length=TC)
KEY = jax.random.PRNGKey(0)


@jax.jit
def _logp(prompt_ids, comp, mask):
    return rows_logp(MODEL, prompt_ids, jnp.ones(prompt_ids.shape, bool), comp, mask)[0]


def _make(own_r, peer_r, peer_kind=None, seed=0):
    """Own rows (own old_logp = current logp, ratio 1) and a view whose K = G peer rows come from the same
    model with identity alignment (src_chunk_logp = the model's own token log-probs), source 1."""
    rs = np.random.RandomState(seed)
    prompt = jnp.asarray(rs.randint(3, V, (P, TP)), jnp.int32)
    comp = jnp.asarray(rs.randint(0, V, (2 * P * G, TC)), jnp.int32)
    lens = rs.randint(1, TC + 1, 2 * P * G)
    mask = jnp.asarray(np.arange(TC)[None] < lens[:, None], jnp.float32)
    slot = np.repeat(np.arange(P), G)
    lp = _logp(prompt[np.concatenate([slot, slot])], comp, mask)
    n = P * G
    own_r, peer_r = np.asarray(own_r, np.float32).reshape(-1), np.asarray(peer_r, np.float32).reshape(-1)
    batch = own_rows(prompt_ids=prompt, prompt_mask=jnp.ones((P, TP), bool), completion_ids=comp[:n],
                  completion_mask=mask[:n], old_logp=lp[:n], ref_logp=jnp.zeros((n, TC)),
                  rewards=jnp.asarray(own_r), truncated=jnp.zeros((n,), bool))
    stats = np.zeros((P, 2, 4), np.float32)
    pr = peer_r.reshape(P, G)
    stats[:, 1] = np.stack([np.full(P, G), pr.sum(1), (pr ** 2).sum(1), (pr >= 1).sum(1)], -1)
    chunk = jnp.where(mask[n:] > 0, jnp.arange(TC)[None], -1)
    view = see.SeeView(completion_ids=comp[n:], completion_mask=mask[n:], dst_chunk=chunk.astype(jnp.int32),
                       src_chunk_logp=lp[n:] * mask[n:], chunk_valid=mask[n:] > 0, rewards=jnp.asarray(peer_r),
                       source=jnp.ones((n,), jnp.int32),
                       row_kind=jnp.asarray(np.full(n, see.PEER) if peer_kind is None else peer_kind, jnp.int32),
                       prompt_slot=jnp.asarray(slot, jnp.int32), truncated=jnp.zeros((n,), bool),
                       peer_stats=jnp.asarray(stats), consumer=jnp.int32(0))
    return batch, view, lp, mask, comp, slot


_FNS = {}


def _grads(spec, batch, view, cfg=CFG, mb=0, probe_index=0):
    key = (spec if isinstance(spec, str) else spec.name, cfg, mb)
    if key not in _FNS:
        _FNS[key] = make_grad_fn(GRAPHDEF, spec, cfg, mb, jit=True)
    loss, g, m = _FNS[key](PARAMS, batch, view, KEY, probe_index)
    return loss, g, m


def _close(a, b, **kw):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw), a, b)


# ----------------------------------------------------------------------------- helpers

def test_helpers():
    w = probes.importance_weights(jnp.array([0.0, 1.0, -1.0]), jnp.zeros(3))
    np.testing.assert_allclose(w, [1.0, 1.0, np.exp(-1)], rtol=1e-6)
    np.testing.assert_allclose(probes.importance_weights(jnp.array([2.0]), jnp.zeros(1), truncate=2.0, mode="clip"),
                               [2.0], rtol=1e-6)
    np.testing.assert_allclose(probes.importance_weights(jnp.array([np.log(3.0)]), jnp.zeros(1), mode="shaping",
                                                         gamma=0.1), [3 / 3.1], rtol=1e-6)
    np.testing.assert_allclose(probes.policy_shaping(jnp.array(3.0), 0.1), 3 / 3.1, rtol=1e-6)
    assert float(probes.effective_sample_size(jnp.ones(5))) == 1.0
    np.testing.assert_allclose(probes.effective_sample_size(jnp.array([1.0, 0.0, 0.0, 0.0])), 0.25)
    np.testing.assert_allclose(probes.effective_sample_size(jnp.array([1.0, 0.0]), normalize=False), 1.0)
    s = probes.compatibility_score(jnp.array([-1.0, -3.0]), jnp.array([-1.5, -1.0]))
    admit, wt = probes.compatibility_gate(s, 0.8)
    assert list(np.asarray(admit)) == [True, False]
    np.testing.assert_allclose(wt, [1.0, 0.0])
    with pytest.raises(ValueError):
        probes.importance_weights(jnp.zeros(1), jnp.zeros(1), mode="bogus")
    assert probes.make_probe("xgrpo+sgt:lam=0.3").name == "xgrpo+sgt"
    with pytest.raises(ValueError, match="unknown probe"):
        probes.make_probe("sft")


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=3 * P * G, max_size=3 * P * G), st.booleans())
def test_pooled_row_advantages_equal_grpo_pooled(flat, cw):
    r = np.asarray(flat, np.float32).reshape(3, P, G)                 # policy 0 = consumer, 1 and 2 peers
    batch = own_rows(prompt_ids=jnp.zeros((P, TP), jnp.int32), prompt_mask=jnp.ones((P, TP), bool),
                  completion_ids=jnp.zeros((P * G, TC), jnp.int32), completion_mask=jnp.ones((P * G, TC)),
                  old_logp=jnp.zeros((P * G, TC)), ref_logp=jnp.zeros((P * G, TC)),
                  rewards=jnp.asarray(r[0].reshape(-1)), truncated=jnp.zeros((P * G,), bool))
    stats = np.stack([np.full((P, 3), G), r.sum(2).T, (r ** 2).sum(2).T, (r >= 1).sum(2).T], -1).astype(np.float32)
    stats[:, 0] = 0
    view = see.empty_view(P, 1, TC, 1, 3).replace(peer_stats=jnp.asarray(stats))
    got, expect, alone, grpo_adv = _pooled_check(batch, view, jnp.asarray(r), cw)
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
    # one policy (no peer stats): XGRPO advantages == GRPO group advantages
    np.testing.assert_allclose(alone, grpo_adv, rtol=1e-5, atol=1e-6)


@jax.jit
def _pooled_check(batch, view, r, cw):
    rows = assemble_rows(batch)
    got_cw = probes.pooled_row_advantages(rows, view, capability_weighted=True)
    got = probes.pooled_row_advantages(rows, view)
    expect_cw = grpo.pooled_advantages(r, peer_weights=grpo.capability_weights(r, threshold=1.0))[0].reshape(-1)
    expect = grpo.pooled_advantages(r)[0].reshape(-1)
    alone = probes.xgrpo().advantages(rows.rewards, rows, view.replace(peer_stats=0 * view.peer_stats),
                                      jnp.zeros(P * G))
    return (jnp.where(cw, got_cw, got), jnp.where(cw, expect_cw, expect), alone,
            grpo.group_advantages(r[0]).reshape(-1))


# ----------------------------------------------------------------------------- identities through the learner

def test_xgrpo_with_one_policy_equals_grpo():
    batch, view, *_ = _make([[1, 0, 0], [0, 1, 1]], np.zeros((P, G)))
    view = view.replace(peer_stats=jnp.zeros_like(view.peer_stats))
    l0, g0, _ = _grads("none", batch, view)
    l1, g1, _ = _grads("xgrpo", batch, view)
    _close(g1, g0, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_prp_with_self_peer_equals_grpo_on_pooled_group(loss_type):
    own_r, peer_r = [[1, 0, 0], [0, 0, 0]], [[1, 1, 0], [1, 0, 0]]
    batch, view, lp, mask, comp, slot = _make(own_r, peer_r)
    cfg = GRPOConfig(num_generations=G, max_completion_length=TC, loss_type=loss_type)
    loss, g, m = _grads("prp", batch, view, cfg)
    np.testing.assert_allclose(float(m["prp/ess"]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(float(m["prp/weight_mean"]), 1.0, rtol=1e-5)
    assert float(m["prp/rows"]) == P * G
    adv = grpo.pooled_advantages(jnp.asarray([own_r, peer_r], jnp.float32))        # [2, P, G]
    adv = jnp.concatenate([adv[0].reshape(-1), adv[1].reshape(-1)])
    prompt = batch.prompt_ids[::G][np.concatenate([slot, slot])]

    def ref_loss(params):
        lpp = rows_logp(nnx.merge(GRAPHDEF, params), prompt, jnp.ones(prompt.shape, bool), comp, mask)[0]
        s, d, _ = grpo.policy_loss(lpp, jax.lax.stop_gradient(lpp), adv, mask, loss_type=loss_type,
                                   max_completion_length=TC)
        return s / d

    el, eg = jax.jit(jax.value_and_grad(ref_loss))(PARAMS)
    np.testing.assert_allclose(float(loss), float(el), rtol=1e-5, atol=1e-6)
    _close(g, eg, rtol=1e-4, atol=1e-6)


def _sgt_term_grad(probe, batch, view):
    """Gradient of the SGT loss term alone (sum / denominator) through the model."""

    @jax.jit
    def run(params, batch, view):
        rows, _ = probe.extend(assemble_rows(batch, view), view, KEY)

        def term(p):
            lpp = rows_logp(nnx.merge(GRAPHDEF, p), rows.prompt_ids, rows.prompt_mask, rows.completion_ids,
                            rows.completion_mask)[0]
            s, d, _ = probe.loss_terms(lpp, rows)
            return jnp.sum(s / jnp.maximum(d, 1e-30))

        return jax.grad(term)(params), rows

    return run(PARAMS, batch, view)


def test_sgt_gradient_is_lambda_mean_grad_logp_when_gate_open():
    own_r = [[0, 0, 0], [1, 0, 0]]                                  # prompt 0 failed, prompt 1 solved
    peer_r = [[0, 1, 0], [1, 1, 1]]                                 # one success on prompt 0
    batch, view, lp, mask, comp, slot = _make(own_r, peer_r)
    probe = probes.sgt(lam=0.1)
    g, rows = _sgt_term_grad(probe, batch, view)
    fired = np.nonzero(np.asarray(rows.sft_weight))[0]
    assert list(fired) == [P * G + 1]                               # peer row (p=0, k=1) only
    r = fired[0]
    y, m_y, pr = comp[r:r + 1], mask[r:r + 1], batch.prompt_ids[0:1]

    def mean_logp(params):
        lpp = rows_logp(nnx.merge(GRAPHDEF, params), pr, jnp.ones(pr.shape, bool), y, m_y)[0]
        return jnp.sum(lpp * m_y) / jnp.sum(m_y)

    expect = jax.tree.map(lambda x: -0.1 * x, jax.jit(jax.grad(mean_logp))(PARAMS))     # loss grad = -lam grad mean logp
    _close(g, expect, rtol=1e-5, atol=1e-7)
    # through the learner: grads(sgt) - grads(none) is the same rescue direction
    _, g_sgt, m = _grads("sgt", batch, view)
    _, g_none, _ = _grads("none", batch, view)
    _close(jax.tree.map(jnp.subtract, g_sgt, g_none), expect, rtol=1e-4, atol=1e-6)
    assert float(m["sgt/rows_fired"]) == 1.0 and float(m["sgt/prompts_failed"]) == 0.5


def test_sgt_is_exactly_zero_with_own_success_and_draws_one_rescue():
    batch, view, *_ = _make([[1, 0, 0], [0, 1, 0]], [[1, 1, 1], [1, 1, 1]])
    g, rows = _sgt_term_grad(probes.sgt(), batch, view)
    assert float(jnp.sum(rows.sft_weight)) == 0.0
    jax.tree.map(lambda x: np.testing.assert_array_equal(np.asarray(x), 0.0), g)
    # all own rows failed, three peer successes per prompt: exactly one drawn per prompt, key-dependent
    batch, view, *_ = _make(np.zeros((P, G)), np.ones((P, G)))
    picks = set()
    ext = jax.jit(lambda b, v, k: probes.sgt().extend(assemble_rows(b, v), v, k)[0])
    for k in range(6):
        rows = ext(batch, view, jax.random.PRNGKey(k))
        sel = np.nonzero(np.asarray(rows.sft_weight))[0]
        assert len(sel) == P and sorted(np.asarray(rows.prompt_slot)[sel]) == list(range(P))
        picks.add(tuple(sel))
    assert len(picks) > 1
    rows, _ = probes.sgt(gate="always", rescues_per_prompt=2).extend(assemble_rows(batch, view), view, KEY)
    assert float(jnp.sum(rows.sft_weight > 0)) == 2 * P


def test_chain_xgrpo_sgt_equals_sum_of_parts():
    batch, view, *_ = _make([[0, 0, 0], [1, 0, 1]], [[0, 1, 0], [1, 1, 0]])
    l_n, g_n, _ = _grads("none", batch, view)
    l_x, g_x, _ = _grads("xgrpo", batch, view)
    l_s, g_s, _ = _grads("sgt", batch, view)
    l_c, g_c, m = _grads(probes.chain(probes.xgrpo(), probes.sgt()), batch, view)
    np.testing.assert_allclose(float(l_c), float(l_x + l_s - l_n), rtol=1e-5, atol=1e-6)
    _close(g_c, jax.tree.map(lambda a, b, c: a + b - c, g_x, g_s, g_n), rtol=1e-4, atol=1e-6)
    assert "xgrpo/adv_on_peer_solved" in m and "sgt/rows_fired" in m


def test_prp_masks_residual_chunks_and_truncates_weights():
    batch, view, *_ = _make([[1, 0, 0], [0, 1, 0]], [[1, 0, 1], [0, 1, 0]])
    cv = view.chunk_valid.at[:, 0].set(False)                       # first chunk of each peer row is residual
    view = view.replace(chunk_valid=cv, src_chunk_logp=view.src_chunk_logp - 1.0)   # peer less likely: w = e
    rows = assemble_rows(batch, view)
    rows = rows.replace(old_logp=rows.old_logp.at[P * G:].set(view.src_chunk_logp + 1.0))
    out, om = probes.prp(truncate=1.0).extend(rows, view, KEY)
    peer = slice(P * G, None)
    assert float(jnp.max(out.pg_weight[peer])) <= 1.0 + 1e-6      # truncated at 1
    assert float(jnp.sum(out.pg_mask[peer][:, 0])) == 0.0           # residual chunk masked
    np.testing.assert_allclose(out.pg_mask[peer][:, 1:], view.completion_mask[:, 1:])
    assert float(om["prp/residual_frac"][0]) == float(jnp.sum(view.completion_mask[:, 0]))
    shaped, _ = probes.prp(mode="shaping").extend(rows, view, KEY)
    np.testing.assert_array_equal(np.asarray(shaped.aux_weight[peer] > 0), np.asarray(shaped.pg_mask[peer] > 0))
    assert not bool((shaped.aux_weight[:P * G] > 0).any())
    assert float(jnp.abs(shaped.pg_weight[peer]).sum()) == 0.0       # LUFFY rows: PRP's own term, not the PG one


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_prp_shaping_term_is_luffy_on_the_shaped_tokens(loss_type):
    """PRP's LUFFY term against numpy: -f(rho_c) A w per shaped token, rho_c = exp(chunk logp - source chunk
    logp), f(x) = x / (x + gamma), aggregated as the PG term (loss_type) over the PG denominator."""
    batch, view, *_ = _make([[1, 0, 0], [0, 1, 0]], [[1, 0, 1], [0, 1, 0]])
    view = view.replace(src_chunk_logp=view.src_chunk_logp - 0.7)
    gamma = 0.3
    probe = probes.prp(mode="shaping", gamma=gamma,
                       options=probes.RunOptions(loss_type=loss_type, max_completion_length=TC + 2))
    rows = assemble_rows(batch, view)
    rows, _ = probe.extend(rows, view, KEY)
    rows = rows.replace(advantages=jnp.asarray(np.random.RandomState(1).randn(rows.num_rows), jnp.float32))
    logp = jnp.asarray(np.random.RandomState(2).randn(*rows.completion_ids.shape) * 0.5 - 1.0, jnp.float32)
    s, d, _ = probe.loss_terms(logp, rows)
    r = jax.tree.map(np.asarray, rows)
    on = r.aux_weight > 0
    assert on.any()
    chunk_lp = np.zeros(r.src_chunk_logp.shape)
    for i, t in zip(*np.nonzero(r.dst_chunk >= 0)):
        chunk_lp[i, r.dst_chunk[i, t]] += float(logp[i, t]) * r.completion_mask[i, t]
    rho = np.exp(np.take_along_axis(chunk_lp - r.src_chunk_logp, np.maximum(r.dst_chunk, 0), 1))
    tok = np.where(on, -(rho / (rho + gamma)) * r.advantages[:, None] * r.aux_weight, 0.0)
    m, rv = r.pg_mask, on.any(1)
    if loss_type == "grpo":
        want_s, want_d = np.sum(rv * (tok * m).sum(1) / np.maximum(m.sum(1), 1)), r.pg_row.sum()
    elif loss_type == "dapo":
        want_s, want_d = np.sum(tok * m * rv[:, None]), np.sum(m * r.pg_row[:, None])
    else:
        want_s, want_d = np.sum(tok * m * rv[:, None]), r.pg_row.sum() * (TC + 2)
    np.testing.assert_allclose(float(s[0]), want_s, rtol=1e-5)
    np.testing.assert_allclose(float(d[0]), want_d, rtol=1e-6)


def test_switch_one_compile_serves_every_chain():
    batch, view, *_ = _make([[0, 0, 0], [1, 0, 1]], [[0, 1, 0], [1, 1, 0]])
    spec = "none|xgrpo|prp|sgt"
    fn = make_grad_fn(GRAPHDEF, spec, CFG, 0, jit=True)
    for i, name in enumerate(spec.split("|")):
        l_s, g_s, m_s = fn(PARAMS, batch, view, KEY, i)
        l_i, g_i, m_i = _grads(name, batch, view)
        np.testing.assert_allclose(float(l_s), float(l_i), rtol=1e-5, atol=1e-7, err_msg=name)
        _close(g_s, g_i, rtol=1e-4, atol=1e-6)
        for k, v in m_i.items():
            np.testing.assert_allclose(float(m_s[k]), float(v), rtol=1e-4, atol=1e-6, err_msg=f"{name} {k}")
    assert fn._cache_size() == 1
