"""The attention kernels of models/attention.py against a float64 numpy softmax over the concatenated key slots.

The prompt-shared layouts (update: ``PrefixMask``; sampler: ``SampleCache``) split the keys into a prompt block
and a completion block and merge the two softmaxes by their maxima; these tests drive the cases where that merge
can go wrong: blocks whose maxima are far apart, a block masked out entirely (padding, sliding window), rows
with no visible key at all (uniform over every slot, as the single-softmax path gives).
"""
import importlib

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

A = importlib.import_module("mrl_jax.models.attention")


def _softmax_attend(q, keys, values, visible):
    """q [H, D], keys/values [S, K, D], visible bool[S] -> [H, D]: float64, masked slots at -1e30."""
    H, K = q.shape[0], keys.shape[1]
    out = np.zeros(q.shape)
    for h in range(H):
        kv = h // (H // K)
        s = np.where(visible, keys[:, kv] @ q[h] * SCALE, -1e30)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ values[:, kv]
    return out


SCALE = 0.5
# Two layouts (each op compiles once per shape); masks, window, score scale and data vary per example.
LAYOUTS = [dict(P=3, M=2, Tp=4, Tc=3, heads=(4, 2)), dict(P=1, M=3, Tp=2, Tc=5, heads=(2, 1))]
shapes = st.builds(lambda layout, window, q_scale, seed: dict(layout, window=window, q_scale=q_scale, seed=seed),
                   st.sampled_from(LAYOUTS), st.one_of(st.none(), st.integers(1, 6)),
                   st.sampled_from([0.3, 5.0, 40.0]), st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(shapes)
def test_prompt_shared_update_attention_equals_one_softmax_over_prompt_and_completion(c):
    P, M, Tp, Tc, (H, K), w = c["P"], c["M"], c["Tp"], c["Tc"], c["heads"], c["window"]
    B, D, rs = P * M, 4, np.random.RandomState(c["seed"])
    pm = rs.rand(P, Tp) < 0.7
    if P > 1:
        pm[0] = False                                               # one prompt all padding
    cm = (np.arange(Tc)[None] < rs.randint(0, Tc + 1, (B, 1))).astype(np.float32)   # ragged, some empty
    n = P * Tp + B * Tc
    q = rs.randn(1, n, H, D) * c["q_scale"]
    k, v = rs.randn(1, n, K, D), rs.randn(1, n, K, D)
    mask = A.PrefixMask.build(jnp.asarray(pm), jnp.asarray(cm), w)
    got = np.asarray(A._attend_prefix(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), mask, SCALE))[0]

    want = np.zeros((n, H, D))
    pk, pv, pq = (x[0, :P * Tp].reshape(P, Tp, -1, D) for x in (k, v, q))
    ck, cv, cq = (x[0, P * Tp:].reshape(B, Tc, -1, D) for x in (k, v, q))
    for p in range(P):
        for t in range(Tp):
            vis = pm[p] & (np.arange(Tp) <= t) & ((np.arange(Tp) > t - w) if w else True)
            want[p * Tp + t] = _softmax_attend(pq[p, t], pk[p], pv[p], vis)
    for b in range(B):
        p = b // M
        for t in range(Tc):
            slot = np.arange(Tp + Tc)
            vis = np.concatenate([pm[p], cm[b] > 0]) & (slot <= Tp + t) & ((slot > Tp + t - w) if w else True)
            want[P * Tp + b * Tc + t] = _softmax_attend(cq[b, t], np.concatenate([pk[p], ck[b]]),
                                                        np.concatenate([pv[p], cv[b]]), vis)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(shapes, st.integers(0, 4))
def test_sampler_decode_step_equals_one_softmax_over_prompt_and_generated_slots(c, j):
    P, G, Tp, (H, K), w = c["P"], c["M"], c["Tp"], c["heads"], c["window"]
    B, D, Lg, rs = P * G, 4, 5, np.random.RandomState(c["seed"])
    pm = rs.rand(P, Tp) < 0.7
    if P > 1:
        pm[0] = False
    pk, pv = rs.randn(P, K, D, Tp), rs.randn(P, K, Tp, D)
    gk, gv = rs.randn(B, K, D, Lg), rs.randn(B, K, Lg, D)
    q, k, v = rs.randn(B, 1, H, D) * c["q_scale"], rs.randn(B, 1, K, D), rs.randn(B, 1, K, D)
    f32 = lambda x: jnp.asarray(x, jnp.float32)   # noqa: E731
    cache = A.SampleCache(pk=(f32(pk),), pv=(f32(pv),), gk=(f32(gk),), gv=(f32(gv),), pmask=jnp.asarray(pm))
    out, new = A.attention(f32(q), f32(k), f32(v), cache.step_masks(j, w), scale=SCALE, cache=cache, layer=0,
                           cache_index=j)
    gk[:, :, :, j], gv[:, :, j] = k[:, 0], v[:, 0]                  # the step writes its token at slot j
    np.testing.assert_allclose(np.asarray(new.gk[0]), gk, atol=1e-6)
    slot = np.arange(Tp + Lg)
    for b in range(B):
        p = b // G
        vis = np.concatenate([pm[p], np.arange(Lg) <= j]) & ((slot > Tp + j - w) if w else True)
        keys = np.concatenate([pk[p].transpose(2, 0, 1), gk[b].transpose(2, 0, 1)])
        vals = np.concatenate([pv[p].transpose(1, 0, 2), gv[b].transpose(1, 0, 2)])
        np.testing.assert_allclose(np.asarray(out[b, 0]), _softmax_attend(q[b, 0], keys, vals, vis),
                                   atol=2e-4, rtol=1e-4)
