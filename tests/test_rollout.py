"""mrl_jax.sampler.oracle (the static sampler): KV-cache sampler against a no-cache full forward of the same tiny models."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax import models
from mrl_jax.sampler import SamplingConfig, bucket_length, generate, left_pad
from mrl_jax.sampler import oracle as ro
from mrl_jax.sampler.sampling import nucleus_mask, row_uniforms, sample_step

VOCAB = 61
N_NEW = 7
PROMPTS = [[1, 5, 9, 14], [1, 22], [1, 3, 4, 5, 6, 7], [1, 40, 41]]


def _make(family):
    m = models.tiny_model(family, VOCAB, seed=3, hidden_size=32, intermediate_size=64)
    g, p = nnx.split(m)
    # random init (std 0.02) gives near-uniform logits; scale so distributions have some shape.
    p = jax.tree_util.tree_map(lambda x: x * 3.0, p)
    return g, p


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def fam(request):
    g, p = _make(request.param)
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    return request.param, g, p, jnp.asarray(ids), jnp.asarray(mask)


@pytest.fixture(scope="module")
def llama():
    g, p = _make("llama")
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    return g, p, jnp.asarray(ids), jnp.asarray(mask)


_full_fwd = jax.jit(lambda g, p, ids, mask: nnx.merge(g, p)(ids, attention_mask=mask), static_argnums=0)


def _full_logits(g, p, ids, mask, out):
    """f32[B, N, V]: full forward (no cache) logits predicting each generated token."""
    seq = jnp.concatenate([ids, out.tokens], axis=1)
    m = jnp.concatenate([mask, jnp.ones_like(out.mask)], axis=1)
    tp = ids.shape[1]
    return _full_fwd(g, p, seq, m)[:, tp - 1: tp - 1 + out.tokens.shape[1]]


def _greedy(g, p, ids, mask, **kw):
    cfg = SamplingConfig(max_new_tokens=N_NEW, greedy=True, pad_id=0, **kw)
    return generate(g, p, ids, mask, jax.random.key(0), cfg)


# ------------------------------------------------------------------------------------------ shapes
def test_bucket_length():
    assert bucket_length(1, (8, 16)) == 8
    assert bucket_length(8, (8, 16)) == 8
    assert bucket_length(9, (16, 8)) == 16
    assert bucket_length(17, (8, 16)) == 32  # multiples of the largest beyond it
    assert bucket_length(33, (8, 16)) == 48
    with pytest.raises(ValueError):
        bucket_length(-1)


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, buckets=(4, 8), batch_size=3)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], pad_id=0)


def test_config_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="logprobs_of"):
        SamplingConfig(max_new_tokens=4, logprobs_of="bogus")
    c = SamplingConfig(max_new_tokens=4, eos_id=[2, 3])
    assert c.eos_id == (2, 3) and hash(c) == hash(SamplingConfig(max_new_tokens=4, eos_id=(2, 3)))


# ------------------------------------------------------------------------------------------ per-step sampling
def test_nucleus_mask_matches_sorted_cumsum():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(32, 200)).astype(np.float32) * rng.uniform(0.5, 4, size=(32, 1)).astype(np.float32)
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
    f = jax.jit(nucleus_mask, static_argnums=1)
    for top_p in (1e-6, 0.3, 0.9, 0.999):
        got = np.asarray(f(jnp.asarray(probs), top_p))
        order = np.argsort(-probs, axis=-1)
        sp = np.take_along_axis(probs, order, -1)
        keep_sorted = (np.cumsum(sp, -1) - sp) < top_p
        keep_sorted[:, 0] = True
        want = np.zeros_like(keep_sorted)
        np.put_along_axis(want, order, keep_sorted, -1)
        np.testing.assert_array_equal(got, want, err_msg=f"top_p={top_p}")


def _sample_many(logits, configs, n, key=0):
    """Run sample_step for several configs in ONE jitted program (one compile): [(tok, lp)] numpy."""
    big = jnp.broadcast_to(jnp.asarray(logits), (n, logits.shape[-1]))

    @jax.jit
    def f(big, key):
        return [sample_step(big, jax.random.fold_in(key, i), c) for i, c in enumerate(configs)]

    return [(np.asarray(t), np.asarray(lp)) for t, lp in f(big, jax.random.key(key))]


def test_sample_step_distributions():
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.7], np.float32)
    t = 0.8
    n = 20000
    base = np.exp(logits / t) / np.exp(logits / t).sum()
    top3 = np.argsort(-logits)[:3]
    want_k = np.zeros_like(base)
    want_k[top3] = base[top3] / base[top3].sum()
    # top-p=0.75 (nucleus): tokens 0,1,2 (mass before token 2 = 0.70 < 0.75, before token 7 = 0.83)
    order = np.argsort(-base)
    keep = order[(np.cumsum(base[order]) - base[order]) < 0.75]
    want_p = np.zeros_like(base)
    want_p[keep] = base[keep] / base[keep].sum()
    raw = logits - np.log(np.exp(logits).sum())
    c = functools.partial(SamplingConfig, max_new_tokens=1, temperature=t)
    cases = [  # (config, expected frequencies, expected logprob table)
        (c(), base, np.log(base)),  # temperature only; "tempered" logprobs
        (c(top_k=3, logprobs_of="sampling"), want_k, np.log(np.maximum(want_k, 1e-30))),
        (c(top_p=0.75, logprobs_of="sampling"), want_p, np.log(np.maximum(want_p, 1e-30))),
        (c(top_p=0.75), want_p, np.log(base)),  # default "tempered" logprobs ignore the filter
        (c(top_p=0.75, logprobs_of="raw"), want_p, raw),  # "raw" ignores the temperature too
    ]
    outs = _sample_many(logits, [cfg for cfg, _, _ in cases], n)
    for (cfg, freq, table), (tok, lp) in zip(cases, outs):
        got = np.bincount(tok, minlength=logits.shape[-1]) / n
        np.testing.assert_allclose(got, freq, atol=0.015, err_msg=str(cfg))
        np.testing.assert_allclose(lp, table[tok], rtol=1e-5, err_msg=str(cfg))


def test_top_k1_and_tiny_top_p_equal_greedy():
    """The only place these configs differ is the per-step sampler: check it on many logit rows."""
    rows = jax.random.normal(jax.random.key(6), (512, VOCAB)) * 3.0
    configs = [SamplingConfig(max_new_tokens=1, greedy=True)] + [
        SamplingConfig(max_new_tokens=1, temperature=1.3, **kw)
        for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"top_k": 4, "top_p": 1e-6})]

    @jax.jit
    def f(rows, key):
        return [sample_step(rows, jax.random.fold_in(key, i), c)[0] for i, c in enumerate(configs)]

    toks = [np.asarray(t) for t in f(rows, jax.random.key(0))]
    np.testing.assert_array_equal(toks[0], np.asarray(jnp.argmax(rows, -1)))
    for cfg, tok in zip(configs[1:], toks[1:]):
        np.testing.assert_array_equal(tok, toks[0], err_msg=str(cfg))


# ------------------------------------------------------------------------------------------ against the full forward
def test_kv_cache_decode_equals_full_forward(fam):
    """Prefill + one-token decode steps (teacher forced) give the no-cache forward's logits, left padding."""
    name, g, p, ids, mask = fam
    b, tp = ids.shape
    steps = 4
    s = tp + steps
    follow = jax.random.randint(jax.random.key(1), (b, steps), 3, VOCAB)
    full = np.asarray(_full_fwd(g, p, jnp.concatenate([ids, follow], 1),
                                jnp.concatenate([mask, jnp.ones((b, steps), bool)], 1)))

    @jax.jit
    def run(p):
        model = nnx.merge(g, p)
        cache = model.init_cache(b, s)
        pos = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
        kvm = jnp.concatenate([mask, jnp.zeros((b, steps), bool)], 1)
        lg, cache = model.decode(ids, pos, cache, 0, kvm)
        outs = [lg[:, -1]]
        for i in range(steps - 1):
            kvm = kvm.at[:, tp + i].set(True)
            lg, cache = model.decode(follow[:, i:i + 1], pos[:, -1:] + 1 + i, cache, tp + i, kvm)
            outs.append(lg[:, 0])
        return jnp.stack(outs, 1)

    got = run(p)
    want = full[:, tp - 1: tp - 1 + steps]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-4, rtol=2e-4, err_msg=name)


def test_greedy_equals_full_forward_argmax(fam):
    name, g, p, ids, mask = fam
    out = _greedy(g, p, ids, mask)
    full = _full_logits(g, p, ids, mask, out)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(jnp.argmax(full, -1)), err_msg=name)
    assert bool(out.mask.all()) and bool(out.truncated.all())
    np.testing.assert_array_equal(np.asarray(out.lengths), N_NEW)
    # greedy logprobs: temperature-1 log-softmax of the recomputed forward
    lp = jnp.take_along_axis(jax.nn.log_softmax(full, -1), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(lp), atol=2e-4)


def test_logprobs_equal_recomputed_forward(llama):
    """Default convention ("tempered"): log_softmax(logits / T) of a no-cache forward, no filtering."""
    g, p, ids, mask = llama
    t = 0.7
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=t, pad_id=0)
    assert cfg.logprobs_of == "tempered"
    out = generate(g, p, ids, mask, jax.random.key(7), cfg)
    full = _full_logits(g, p, ids, mask, out)
    lp = jnp.take_along_axis(jax.nn.log_softmax(full / t, -1), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(lp), atol=2e-4)


def test_sampling_logprobs_with_top_k(llama):
    g, p, ids, mask = llama
    t, k = 0.9, 5
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=t, top_k=k, pad_id=0, logprobs_of="sampling")
    out = generate(g, p, ids, mask, jax.random.key(3), cfg)
    full = np.asarray(_full_logits(g, p, ids, mask, out)) / t
    tok = np.asarray(out.tokens)
    kth = np.sort(full, -1)[..., -k][..., None]
    filt = np.where(full >= kth, full, -np.inf)
    lse = np.log(np.sum(np.exp(filt - filt.max(-1, keepdims=True)), -1)) + filt.max(-1)
    want = np.take_along_axis(filt, tok[..., None], -1)[..., 0] - lse
    assert np.isfinite(want).all(), "a sampled token fell outside the top-k"
    np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=2e-4)
    np.testing.assert_array_equal(np.asarray(out.sampling_logprobs), np.asarray(out.logprobs))   # second output


def test_eos_stops_and_masks(llama):
    g, p, ids, mask = llama
    free = np.asarray(_greedy(g, p, ids, mask).tokens)
    eos = int(free[0, 2])
    out = _greedy(g, p, ids, mask, eos_id=eos)
    tok, m, lp = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.logprobs)
    for b in range(free.shape[0]):
        hits = np.flatnonzero(free[b] == eos)
        n = hits[0] + 1 if hits.size else N_NEW
        assert out.lengths[b] == n and bool(out.truncated[b]) == (hits.size == 0)
        np.testing.assert_array_equal(tok[b, :n], free[b, :n])  # identical up to and including EOS
        assert m[b, :n].all() and not m[b, n:].any()
        assert (tok[b, n:] == 0).all() and (lp[b, n:] == 0).all()
    assert out.lengths[0] <= 3
    # every token is an EOS: all rows stop after one token (early exit of the while_loop)
    out = _greedy(g, p, ids, mask, eos_id=tuple(range(VOCAB)))
    np.testing.assert_array_equal(np.asarray(out.lengths), 1)
    assert not bool(out.truncated.any()) and (np.asarray(out.tokens)[:, 1:] == 0).all()


def _check_eos_invariants(out, eos):
    tok, m, lp = np.asarray(out.tokens), np.asarray(out.mask), np.asarray(out.logprobs)
    for b in range(tok.shape[0]):
        hits = np.flatnonzero(tok[b] == eos)
        n = hits[0] + 1 if hits.size else tok.shape[1]
        assert out.lengths[b] == n and bool(out.truncated[b]) == (hits.size == 0)
        assert m[b, :n].all() and not m[b, n:].any() and (lp[b, n:] == 0).all()


def test_no_recompile_and_keys_differ(llama):
    g, p, ids, mask = llama
    # eos with the fixed-trip loop (stop_early=False): the other loop form
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=1.0, pad_id=0, eos_id=5, stop_early=False)
    a = generate(g, p, ids, mask, jax.random.key(100), cfg)
    n = ro.trace_count()
    b = generate(g, p, ids, mask, jax.random.key(101), cfg)
    c = generate(g, jax.tree_util.tree_map(lambda x: x + 0, p), ids + 0, mask, jax.random.key(100), cfg)
    assert ro.trace_count() == n, "same shapes and config must not retrace"
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)), "different keys, same samples"
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(c.tokens))  # same key: reproducible
    # steps use distinct keys: a row's tokens are not one repeated draw
    assert len({tuple(r) for r in np.asarray(a.tokens).T.tolist()}) > 1
    for out in (a, b):
        _check_eos_invariants(out, 5)


def _subjaxprs(eqn):
    """The jaxprs an equation holds (pjit, scan, while, cond ...)."""
    vals = [x for v in eqn.params.values() for x in (v if isinstance(v, (tuple, list)) else (v,))]
    return [v.jaxpr if hasattr(v, "consts") else v for v in vals if hasattr(v, "eqns") or hasattr(v, "consts")]


def _loop_bodies(jaxpr):
    """The bodies of every loop (``scan``: fixed-trip ``fori_loop``; ``while``) in ``jaxpr``, nested included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            body = eqn.params["jaxpr" if eqn.primitive.name == "scan" else "body_jaxpr"]
            out.append(body.jaxpr if hasattr(body, "consts") else body)
        for sub in _subjaxprs(eqn):
            out += _loop_bodies(sub)
    return out


def _primitives(jaxpr) -> set:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in _subjaxprs(eqn):
            names |= _primitives(sub)
    return names


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9, eos_id=5)])
def test_decode_steps_hold_no_prng_work(llama, kw):
    """Every step's uniforms are drawn once before the decode loops: no PRNG primitive (key derivation or
    bits; on CPU a rolled loop of tiny ops per use) inside a decode step."""
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=N_NEW, pad_id=0, **kw)
    jaxpr = jax.make_jaxpr(lambda p, i, m, k: generate(g, p, i, m, k, cfg))(p, ids, mask, jax.random.key(0)).jaxpr
    bodies = _loop_bodies(jaxpr)
    assert bodies, "the decode steps run in a loop"
    prng = {"random_bits", "random_fold_in", "random_split", "threefry2x32", "random_seed", "random_wrap"}
    assert prng & _primitives(jaxpr), "the uniforms are drawn somewhere"
    for body in bodies:
        assert not prng & _primitives(body), sorted(prng & _primitives(body))


# ------------------------------------------------------------------------------------------ prefill once, G samples
G_SAMPLES = 3


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(greedy=True),
                                dict(temperature=0.8, top_k=5, eos_id=7, cache_bucket=2)],  # 3 decode loops
                         ids=["sampled", "greedy", "topk_eos_buckets"])
def test_num_samples_equals_repeated_prompts(fam, kw):
    """generate(P prompts, num_samples=G) == generate(np.repeat(prompts, G)) row for row, same key."""
    name, g, p, ids, mask = fam
    cfg = SamplingConfig(max_new_tokens=N_NEW, pad_id=0, **kw)
    key = jax.random.key(11)
    shared = generate(g, p, ids, mask, key, cfg, num_samples=G_SAMPLES)
    rep = generate(g, p, jnp.repeat(ids, G_SAMPLES, 0), jnp.repeat(mask, G_SAMPLES, 0), key, cfg)
    assert shared.tokens.shape == (ids.shape[0] * G_SAMPLES, N_NEW)
    for field in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(shared, field)), np.asarray(getattr(rep, field)),
                                      err_msg=f"{name} {field}")
    np.testing.assert_allclose(np.asarray(shared.logprobs), np.asarray(rep.logprobs), atol=1e-5, rtol=1e-5)
    if "eos_id" in kw:
        _check_eos_invariants(shared, kw["eos_id"])
    if "greedy" not in kw:  # the G samples of a prompt differ (per-row keys), rows stay prompt-major
        toks = np.asarray(shared.tokens).reshape(ids.shape[0], G_SAMPLES, N_NEW)
        assert any(len({tuple(r) for r in t}) > 1 for t in toks)


@pytest.mark.parametrize("extra", [1, 3])
def test_padding_rows_do_not_change_the_real_rows(llama, extra):
    """Prompts appended after the real ones (the padding to a device multiple) leave every real row's tokens
    and log-probs unchanged: a row's noise is drawn from its own key, not from a [steps, rows] block."""
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=N_NEW, temperature=1.0, top_k=20, pad_id=0, eos_id=9)
    key, rows = jax.random.key(5), ids.shape[0] * G_SAMPLES
    base = generate(g, p, ids, mask, key, cfg, num_samples=G_SAMPLES)
    pad_ids = jnp.concatenate([ids, jnp.repeat(ids[::-1][:1], extra, 0)])
    pad_mask = jnp.concatenate([mask, jnp.repeat(mask[::-1][:1], extra, 0)])
    padded = generate(g, p, pad_ids, pad_mask, key, cfg, num_samples=G_SAMPLES)
    assert padded.tokens.shape[0] == rows + extra * G_SAMPLES
    for field in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(np.asarray(getattr(padded, field))[:rows], np.asarray(getattr(base, field)))
    # Log-probs to float32 rounding: another batch size changes XLA:CPU's matmul blocking, so the same row's
    # logits can differ in the last bits (seen: 1.4e-6 on a log-prob of -4.08); the tokens above are exact.
    np.testing.assert_allclose(np.asarray(padded.logprobs)[:rows], np.asarray(base.logprobs), atol=1e-5, rtol=1e-5)
    u = np.asarray(row_uniforms(key, rows + 2, N_NEW))
    np.testing.assert_array_equal(u[:rows], np.asarray(row_uniforms(key, rows, N_NEW)))
    np.testing.assert_array_equal(u[4], np.asarray(jax.random.uniform(jax.random.fold_in(key, 4), (N_NEW, 2))))


def test_gen_buckets_and_long_generation_equal_full_forward(llama):
    """Several length buckets of the generated cache (the cache grows between decode loops)."""
    assert ro.gen_buckets(1) == () and ro.gen_buckets(16) == (15,) and ro.gen_buckets(65) == (64,)
    assert ro.gen_buckets(64, 32) == (32, 63) and ro.gen_buckets(200) == (64, 128, 199)
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, temperature=1.0, pad_id=0, cache_bucket=8)  # buckets 8, 16, 32, 39
    out = generate(g, p, ids, mask, jax.random.key(5), cfg, num_samples=2)
    rep_ids, rep_mask = jnp.repeat(ids, 2, 0), jnp.repeat(mask, 2, 0)
    full = _full_logits(g, p, rep_ids, rep_mask, out)
    lp = jnp.take_along_axis(jax.nn.log_softmax(full, -1), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(lp), atol=2e-4)


def test_sliding_window_sampler_equals_full_forward():
    """mistral with a window shorter than prompt + generation: the window masks both cache parts."""
    m = models.tiny_model("mistral", VOCAB, seed=4, hidden_size=32, intermediate_size=64, sliding_window=3)
    g, p = nnx.split(m)
    p = jax.tree_util.tree_map(lambda x: x * 3.0, p)
    ids, mask = (jnp.asarray(a) for a in left_pad(PROMPTS, pad_id=0, length=8))
    out = generate(g, p, ids, mask, jax.random.key(2), SamplingConfig(max_new_tokens=N_NEW, pad_id=0),
                   num_samples=2)
    full = _full_logits(g, p, jnp.repeat(ids, 2, 0), jnp.repeat(mask, 2, 0), out)
    lp = jnp.take_along_axis(jax.nn.log_softmax(full, -1), out.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(lp), atol=2e-4)
