"""The Pallas TPU splash-attention path (`mrl_jax.models.splash`) equals ours, values and gradients, in Pallas
interpret mode on the CPU: every mask the models use (left / right padding, a row all padding, sliding windows,
soft-capping, the prompt-once-per-group layout), GQA ratios 1 and 7, lengths that are not a multiple of the
kernel's 128-lane block. Tolerances: float32 2e-5 on outputs and gradients (the kernel sums in another order);
bfloat16 3e-2 against our float32 result (q is scaled before its bf16 cast)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax.models import tiny_model
from mrl_jax.models.attention import CausalMask, PrefixMask, attention

F32_TOL, BF16_TOL = 2e-5, 3e-2


def _qkv(rng, B, T, H, K, D, dtype=jnp.float32):
    return [jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32).astype(dtype) for n in (H, K, K)]


def _left_padded(rng, B, T):
    """bool[B, T]: row 0 full, row 1 left-padded by an odd count, a last row all padding when B > 2."""
    valid = np.ones((B, T), bool)
    if B > 1:
        valid[1, : T // 3 | 1] = False
    if B > 2:
        valid[-1] = False
    return jnp.asarray(valid)


def _loss(impl, mask, w, valid, **kw):
    """sum(out * w) over the valid queries (padding queries' outputs are unspecified in the dense path)."""
    def f(q, k, v):
        out, _ = attention(q, k, v, mask, impl=impl, **kw)
        return jnp.sum(jnp.where(valid[..., None, None], out.astype(jnp.float32) * w, 0.0)), out
    return f


def _check(mask, q, k, v, valid, tol, refs=("blockwise",), **kw):
    """splash's outputs (at the valid queries) and q/k/v gradients equal each of ``refs``' within ``tol``."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    got = {}
    for impl in ("splash", *refs):
        (loss, out), g = jax.jit(jax.value_and_grad(_loss(impl, mask, w, valid, **kw), argnums=(0, 1, 2),
                                                    has_aux=True))(
            *[x.astype(jnp.float32) if impl != "splash" else x for x in (q, k, v)])
        got[impl] = (np.where(np.asarray(valid)[..., None, None], np.asarray(out, np.float32), 0), g)
    o_s, g_s = got["splash"]
    for ref in refs:
        o_r, g_r = got[ref]
        np.testing.assert_allclose(o_s, o_r, atol=tol, rtol=tol)
        for a, b in zip(g_s, g_r):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)
    return o_s


@pytest.mark.parametrize("T,H,K,window,softcap", [
    (131, 4, 4, None, None),     # GQA 1, T past one block, left padding, a row all padding
    (40, 7, 1, None, 30.0),      # GQA 7, soft-capping
    (150, 4, 2, 37, None),       # Gemma-style sliding window over two blocks
])
def test_causal_equals_ours(T, H, K, window, softcap):
    rng = np.random.default_rng(T)
    B = 3
    q, k, v = _qkv(rng, B, T, H, K, 8)
    valid = _left_padded(rng, B, T)
    mask = CausalMask(kv_mask=valid, offset=0, num_queries=T, window=window)
    out = _check(mask, q, k, v, valid, F32_TOL, refs=("blockwise", "dense"), scale=8 ** -0.5, softcap=softcap)
    assert np.all(out[-1] == 0) and np.abs(out[0]).max() > 0.1   # the all-padding row is zero; the others not


def test_causal_bf16_close_to_f32():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, 96, 4, 2, 16, jnp.bfloat16)
    valid = _left_padded(rng, 2, 96)
    _check(CausalMask(kv_mask=valid, offset=0, num_queries=96), q, k, v, valid, BF16_TOL, scale=0.25)


@pytest.mark.parametrize("window", [None, 9])
def test_prefix_layout_equals_ours(window):
    """P = 2 prompts of 13 tokens (one left-padded), M = 3 completions each of 11 tokens (right-padded, one
    all padding), GQA 2."""
    rng = np.random.default_rng(5)
    P, M, Tp, Tc, H, K, D = 2, 3, 13, 11, 4, 2, 8
    pm = np.ones((P, Tp), bool)
    pm[1, :5] = False
    lengths = np.array([11, 4, 0, 7, 1, 11])
    cm = np.arange(Tc)[None, :] < lengths[:, None]
    N = P * Tp + P * M * Tc
    q, k, v = _qkv(rng, 1, N, H, K, D)
    mask = PrefixMask.build(jnp.asarray(pm), jnp.asarray(cm), window)
    valid = jnp.concatenate([jnp.asarray(pm).reshape(-1), jnp.asarray(cm).reshape(-1)])[None]
    _check(mask, q, k, v, valid, F32_TOL, scale=D ** -0.5)


def test_gemma3_model_logits_and_grads_with_splash():
    """A tiny Gemma 3 (sliding + global layers, q/k norm) gives the same logits and parameter gradients with
    ``attention="splash"`` as with ours, on a left-padded batch."""
    from flax import nnx

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 21)), jnp.int32)
    mask = jnp.asarray(np.arange(21)[None, :] >= np.array([[0], [6]]))
    outs = {}
    for impl in ("splash", "auto"):
        model = tiny_model("gemma3_text", 64, seed=3, sliding_window=5, attention=impl)
        graphdef, params = nnx.split(model)

        def loss(p):
            logits = nnx.merge(graphdef, p)(ids, attention_mask=mask)
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2), logits
        (_, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        outs[impl] = (np.where(np.asarray(mask)[..., None], logits, 0), jax.tree.leaves(g))
    np.testing.assert_allclose(outs["splash"][0], outs["auto"][0], atol=2e-5, rtol=2e-5)
    for a, b in zip(outs["splash"][1], outs["auto"][1]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
