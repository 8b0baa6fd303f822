"""min-p and the sampler's second output (log-probs of the filtered distribution), against a numpy reference
of ``transformers``' warper chain (temperature -> top-k -> top-p -> min-p); PRP's peer density uses it."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax import see as see_lib
from mrl_jax.sampler import SamplingConfig, sample_rows
from mrl_jax.trainer import round as round_mod


def filtered_np(logits: np.ndarray, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """f64[B, V] the distribution sampled from, as transformers' warpers build it (sorted, per row)."""
    x = logits.astype(np.float64) / t
    out = np.zeros_like(x)
    for b, row in enumerate(x):
        order = np.argsort(-row, kind="stable")
        keep = np.ones(row.shape, bool)
        if 0 < top_k < row.size:
            keep[order[top_k:]] = False
        p = np.where(keep, np.exp(row - row.max()), 0.0)
        p /= p.sum()
        if top_p < 1.0:
            ps = p[order]
            drop = (np.cumsum(ps) - ps) >= top_p
            drop[0] = False
            keep[order[drop]] = False
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        if min_p > 0.0:
            keep &= p >= min_p * p.max()
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        out[b] = p
    return out


CASES = [dict(min_p=0.1), dict(min_p=0.3, top_k=7), dict(min_p=0.2, top_p=0.95), dict(top_k=5, top_p=0.7, min_p=0.2),
         dict(top_k=9), dict(top_p=0.6), dict()]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "+".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_filtered_logprobs_match_the_numpy_distribution(kw):
    """Over 96 random rows (V = 61, not a multiple of the 128-token block): every drawn token lies in the
    filtered support, its second log-prob is log of the filtered probability, the first stays the tempered one."""
    t = 0.7
    logits = np.asarray(jax.random.normal(jax.random.key(1), (96, 61)) * 2.5)
    u = jax.random.uniform(jax.random.key(2), (2, 96, 1))
    cfg = SamplingConfig(max_new_tokens=1, temperature=t, **kw)
    tok, lp, slp = (np.asarray(x) for x in jax.jit(lambda x, u: sample_rows(x, u, cfg))(jnp.asarray(logits), u))
    want = filtered_np(logits, t, **kw)
    p_tok = want[np.arange(96), tok]
    assert (p_tok > 0).all(), "a token outside the filtered support was drawn"
    np.testing.assert_allclose(slp, np.log(p_tok), atol=2e-5)
    tempered = logits / t - np.log(np.exp(logits / t).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, tempered[np.arange(96), tok], atol=2e-5)
    if kw.get("min_p"):   # min-p really cuts: some rows keep fewer tokens than without it
        rest = {k: v for k, v in kw.items() if k != "min_p"}
        assert ((want > 0).sum(-1) < (filtered_np(logits, t, **rest) > 0).sum(-1)).any()


def test_min_p_frequencies():
    """20000 draws of one row follow the numpy min-p (+ top-k) distribution."""
    logits = np.array([[2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, 0.7, 1.9]], np.float32)
    n = 20000
    u = jax.random.uniform(jax.random.key(3), (2, n, 1))
    for kw in (dict(min_p=0.25), dict(min_p=0.1, top_k=4)):
        cfg = SamplingConfig(max_new_tokens=1, temperature=0.8, **kw)
        tok, _, slp = sample_rows(jnp.broadcast_to(jnp.asarray(logits), (n, 9)), u, cfg)
        want = filtered_np(logits, 0.8, **kw)[0]
        np.testing.assert_allclose(np.bincount(np.asarray(tok), minlength=9) / n, want, atol=0.012, err_msg=str(kw))
        np.testing.assert_allclose(np.asarray(slp), np.log(want[np.asarray(tok)]), atol=2e-5)


def test_greedy_and_config_checks():
    x = jnp.asarray([[0.1, 3.0, -1.0]])
    tok, lp, slp = sample_rows(x, None, SamplingConfig(max_new_tokens=1, greedy=True, min_p=0.5))
    assert int(tok[0]) == 1 and float(slp[0]) == 0.0 and float(lp[0]) < 0.0
    with pytest.raises(ValueError, match="min_p"):
        SamplingConfig(max_new_tokens=1, min_p=1.0)
    assert not SamplingConfig(max_new_tokens=1).filters and SamplingConfig(max_new_tokens=1, min_p=0.1).filters
    assert not SamplingConfig(max_new_tokens=1, top_k=3, greedy=True).filters


@pytest.mark.parametrize("filtering", [True, False])
def test_peer_behaviour_logprobs_in_see_are_the_filtered_ones(filtering):
    """The round stores the sampler's filtered log-probs as the behaviour density SEE hands to PRP when a
    filter is on, the reported (tempered) ones otherwise."""
    sampling = SamplingConfig(max_new_tokens=3, temperature=0.9, top_k=4 if filtering else 0)
    B = 2
    out = types.SimpleNamespace(logprobs=np.full((B, 3), -1.0, np.float32),
                                sampling_logprobs=np.full((B, 3), -0.25, np.float32), truncated=np.zeros(B, bool))
    pol = types.SimpleNamespace(sampling=sampling, num_generations=2, index=0)
    sampled = round_mod.Sampled(prompt_ids=None, prompt_mask=None, rollout=out, texts=["ab", "c"],
                                content=[[5, 6], [7]],
                                score=types.SimpleNamespace(rewards=np.array([1.0, 0.0], np.float32)))
    see = see_lib.init(capacity=8, max_bytes=8, max_src_tokens=3, num_policies=1, num_prompts=4)
    inputs = types.SimpleNamespace(dense_ids=np.array([1], np.int32), index=0)
    see, _ = round_mod._add_experience(see, [pol], [sampled], inputs)
    got = np.asarray(see.rollouts.src_logp)[:2]
    want = -0.25 if filtering else -1.0
    np.testing.assert_array_equal(got, [[want, want, 0.0], [want, 0.0, 0.0]])


def test_run_config_min_p():
    """``sampling.min_p`` reaches the policy's SamplingConfig; a bad value is a one-line config error."""
    import support
    from mrl_jax.configs import ConfigError

    from mrl_jax.trainer.loop import Run

    run = Run(support.to_run_config(support.tiny_config(**{"policies.0.sampling": {"max_new_tokens": 6, "min_p": 0.1}})))
    assert run.policies[0].sampling.min_p == 0.1 and run.policies[0].sampling.filters
    with pytest.raises(ConfigError, match="min_p"):
        support.to_run_config(support.tiny_config(**{"policies.0.sampling": {"max_new_tokens": 6, "min_p": 1.5}}))


@pytest.mark.parametrize("kw", [dict(), dict(top_k=5), dict(top_p=0.8), dict(greedy=True)],
                         ids=["plain", "top_k", "top_p", "greedy"])
def test_ids_beyond_the_tokenizer_are_never_chosen(kw):
    """A model with more embedding rows than its tokenizer has tokens (released Phi-3, Qwen2.5): with
    ``vocab_size`` set, no id >= vocab_size is drawn even where those rows hold most of the mass; the "sampling"
    log-prob is that of the distribution renormalised over the tokenizer's ids, the tempered one keeps the full
    vocabulary (what the learner scores)."""
    V, real, t = 40, 29, 0.9
    logits = np.array(jax.random.normal(jax.random.key(4), (64, V)))
    logits[:, real:] += 4.0   # the rows past the tokenizer dominate
    u = jax.random.uniform(jax.random.key(5), (2, 64, 1))
    cfg = SamplingConfig(max_new_tokens=1, temperature=t, vocab_size=real, **kw)
    assert cfg.filters == (not kw.get("greedy"))
    tok, lp, slp = (np.asarray(x) for x in sample_rows(jnp.asarray(logits), None if kw.get("greedy") else u, cfg))
    assert (tok < real).all()
    if kw.get("greedy"):
        np.testing.assert_array_equal(tok, logits[:, :real].argmax(-1))
        return
    want = filtered_np(logits[:, :real], t, **kw)
    np.testing.assert_allclose(slp, np.log(want[np.arange(64), tok]), atol=2e-5)
    tempered = logits / t - np.log(np.exp(logits / t).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, tempered[np.arange(64), tok], atol=2e-5)
    free = np.asarray(sample_rows(jnp.asarray(logits), u, SamplingConfig(max_new_tokens=1, temperature=t, **kw))[0])
    assert (free >= real).any()   # without the cut those rows are drawn
