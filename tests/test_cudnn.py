"""The GPU attention path (`mrl_jax.models.cudnn`: ``jax.nn.dot_product_attention``, cuDNN flash on a CUDA GPU)
equals ours, values and gradients, through the same call with ``implementation="xla"`` on the CPU: causal rows
left-padded (prefill), right-padded, both (the update's row: prompt ++ completion), with a hole, all padding;
the prompt-once-per-group layout; GQA ratios 1, 3 and 7; odd lengths; sliding windows. float32 within 2e-5 (the
sums run in another order); bfloat16 within 3e-2 of our float32. The cuDNN kernel itself runs only on a GPU
(``benchmarks/gpu_check.py``, section ``cudnn_attention``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax.models import resolve_attention, tiny_model
from mrl_jax.models import cudnn
from mrl_jax.models.attention import CausalMask, PrefixMask, attention

F32_TOL, BF16_TOL = 2e-5, 3e-2


def _qkv(rng, B, T, H, K, D, dtype=jnp.float32):
    return [jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32).astype(dtype) for n in (H, K, K)]


def _rows(T, hole=False):
    """bool[6, T]: full; left-padded by an odd count (a prompt); right-padded (a completion); both (the update's
    row); all padding; a hole in the middle when ``hole`` (else full again)."""
    valid = np.ones((6, T), bool)
    valid[1, : T // 3 | 1] = False
    valid[2, T - T // 4:] = False
    valid[3, :5], valid[3, T - 7:] = False, False
    valid[4] = False
    if hole:
        valid[5, T // 2: T // 2 + 3] = False
    return jnp.asarray(valid)


def _loss(impl, mask, w, valid, **kw):
    """sum(out * w) over the valid queries (padding queries' outputs are unspecified in the dense path)."""
    def f(q, k, v):
        out, _ = attention(q, k, v, mask, impl=impl, **kw)
        return jnp.sum(jnp.where(valid[..., None, None], out.astype(jnp.float32) * w, 0.0)), out
    return f


def _check(mask, q, k, v, valid, tol, refs=("blockwise", "dense"), **kw):
    """"cudnn"'s outputs (at the valid queries) and q/k/v gradients equal each of ``refs``' (in float32)."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)
    got = {}
    for impl in ("cudnn", *refs):
        args = [x if impl == "cudnn" else x.astype(jnp.float32) for x in (q, k, v)]
        (_, out), g = jax.jit(jax.value_and_grad(_loss(impl, mask, w, valid, **kw), argnums=(0, 1, 2),
                                                 has_aux=True))(*args)
        got[impl] = (np.asarray(out, np.float32), g)
    o_c, g_c = got["cudnn"]
    for ref in refs:
        o_r, g_r = got[ref]
        np.testing.assert_allclose(np.where(np.asarray(valid)[..., None, None], o_c, 0),
                                   np.where(np.asarray(valid)[..., None, None], o_r, 0), atol=tol, rtol=tol)
        for a, b in zip(g_c, g_r):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)
    return o_c


@pytest.mark.parametrize("T,H,K,window,hole", [
    (131, 4, 4, None, True),     # GQA 1, odd length past one block of ours, a row with a hole
    (37, 6, 2, None, True),      # GQA 3
    (40, 7, 1, None, False),     # GQA 7 (multi-query)
    (150, 6, 2, 37, False),      # sliding window over several of our blocks
])
def test_causal_equals_ours(T, H, K, window, hole):
    q, k, v = _qkv(np.random.default_rng(T), 6, T, H, K, 8)
    valid = _rows(T, hole)
    mask = CausalMask(kv_mask=valid, offset=0, num_queries=T, window=window)
    out = _check(mask, q, k, v, valid, F32_TOL, scale=8 ** -0.5)
    assert np.all(out[~np.asarray(valid)] == 0) and np.abs(out[0]).max() > 0.1   # padding queries give zero


def test_causal_bf16_close_to_f32():
    q, k, v = _qkv(np.random.default_rng(0), 6, 95, 6, 2, 16, jnp.bfloat16)
    valid = _rows(95)
    out = _check(CausalMask(kv_mask=valid, offset=0, num_queries=95), q, k, v, valid, BF16_TOL,
                 refs=("blockwise",), scale=0.25)
    assert out.dtype == np.float32 and np.isfinite(out).all()


@pytest.mark.parametrize("window", [None, 9])
def test_prefix_layout_equals_ours(window):
    """P = 2 prompts of 13 tokens (one left-padded by 5), M = 3 completions each of 11 tokens (right-padded,
    one all padding), GQA 3."""
    rng = np.random.default_rng(5)
    P, M, Tp, Tc, H, K, D = 2, 3, 13, 11, 6, 2, 8
    pm = np.ones((P, Tp), bool)
    pm[1, :5] = False
    cm = np.arange(Tc)[None, :] < np.array([11, 4, 0, 7, 1, 11])[:, None]
    q, k, v = _qkv(rng, 1, P * Tp + P * M * Tc, H, K, D)
    mask = PrefixMask.build(jnp.asarray(pm), jnp.asarray(cm), window)
    valid = jnp.concatenate([jnp.asarray(pm).reshape(-1), jnp.asarray(cm).reshape(-1)])[None]
    _check(mask, q, k, v, valid, F32_TOL, scale=D ** -0.5)


def test_prefill_into_its_cache_equals_ours():
    """The sampler's prefill: a KVCache of S = T slots filled from slot 0 (the path cuDNN takes), the cache
    written the same."""
    from mrl_jax.models.attention import KVCache

    q, k, v = _qkv(np.random.default_rng(2), 6, 21, 6, 2, 8)
    valid = _rows(21)
    mask = CausalMask(kv_mask=valid, offset=0, num_queries=21)
    outs = {}
    for impl in ("cudnn", "dense"):
        out, cache = attention(q, k, v, mask, scale=0.3, cache=KVCache.zeros(2, 6, 21, 2, 8), layer=1, impl=impl)
        outs[impl] = (np.where(np.asarray(valid)[..., None, None], out, 0), cache)
    np.testing.assert_allclose(outs["cudnn"][0], outs["dense"][0], atol=F32_TOL, rtol=F32_TOL)
    np.testing.assert_array_equal(outs["cudnn"][1].k, outs["dense"][1].k)


def test_outside_its_constraints_ours_runs():
    """Soft-capping (neither implementation has it): "cudnn" gives exactly ours; so does a decode step (one
    query at an offset). Where cuDNN's constraints hold, the CPU runs its XLA implementation."""
    q, k, v = _qkv(np.random.default_rng(3), 6, 19, 4, 2, 8)
    valid = _rows(19)
    mask = CausalMask(kv_mask=valid, offset=0, num_queries=19)
    got, ours = (attention(q, k, v, mask, scale=0.3, softcap=5.0, impl=i)[0] for i in ("cudnn", "auto"))
    np.testing.assert_array_equal(got, ours)
    step = CausalMask(kv_mask=valid, offset=18, num_queries=1)
    got, ours = (attention(q[:, :1], k, v, step, scale=0.3, impl=i)[0] for i in ("cudnn", "auto"))
    np.testing.assert_array_equal(got, ours)
    assert cudnn.implementation(jnp.float32, 8, None) == "xla"
    assert cudnn.implementation(jnp.bfloat16, 64, 50.0) is None


def test_auto_is_cudnn_on_gpu_only():
    assert [resolve_attention("auto", p) for p in ("gpu", "tpu", "cpu")] == ["cudnn", "splash", "auto"]
    assert resolve_attention("cudnn", "tpu") == "cudnn"
    with pytest.raises(ValueError, match=r"attention must be one of auto\|dense\|blockwise\|splash\|cudnn, got 'x'"):
        resolve_attention("x", "gpu")


def test_model_update_and_prefill_through_cudnn_equal_ours():
    """A tiny Qwen2 (GQA 2, qkv bias): logits of left-padded rows, the prompt-once-per-group hidden states of the
    update and every parameter gradient equal ours with ``attention="cudnn"``."""
    from flax import nnx

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, size=(2, 21)), jnp.int32)
    mask = jnp.asarray(np.arange(21)[None, :] >= np.array([[0], [6]]))
    pids, cids = (jnp.asarray(rng.integers(0, 64, size=s), jnp.int32) for s in ((2, 9), (4, 7)))
    pm = jnp.asarray(np.arange(9)[None, :] >= np.array([[0], [3]]))
    cm = jnp.asarray(np.arange(7)[None, :] < np.array([[7], [2], [0], [5]]))
    outs = {}
    for impl in ("cudnn", "auto"):
        graphdef, params = nnx.split(tiny_model("qwen2", 64, seed=3, num_heads=6, num_kv_heads=2, attention=impl))

        def loss(p):
            model = nnx.merge(graphdef, p)
            logits = model(ids, attention_mask=mask)
            last, hc = model.hidden_prefix(pids, pm, cids, cm)
            hc = jnp.where(cm[..., None], hc, 0.0)
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) + jnp.sum(hc ** 2) + jnp.sum(last), logits
        (_, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        outs[impl] = (np.where(np.asarray(mask)[..., None], logits, 0), jax.tree.leaves(g))
    np.testing.assert_allclose(outs["cudnn"][0], outs["auto"][0], atol=2e-5, rtol=2e-5)
    for a, b in zip(outs["cudnn"][1], outs["auto"][1]):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_on_a_cuda_gpu_cudnn_where_its_constraints_hold(monkeypatch):
    """The GPU branch of the choice, with the device faked: cuDNN for bf16 / fp16 and head dims that are multiples
    of 8 within its limit (128 before Hopper), ours for the rest -- float32 included, which then runs exactly ours."""
    monkeypatch.setattr(cudnn, "_on_cuda", lambda: True)
    monkeypatch.setattr(cudnn, "_cuda_head_dim_max", lambda: 128)
    choose = cudnn.implementation
    assert [choose(jnp.bfloat16, 64, None), choose(jnp.float16, 128, None)] == ["cudnn", "cudnn"]
    assert [choose(jnp.float32, 64, None), choose(jnp.bfloat16, 12, None), choose(jnp.bfloat16, 256, None),
            choose(jnp.bfloat16, 64, 30.0)] == [None] * 4
    q, k, v = _qkv(np.random.default_rng(4), 6, 23, 6, 2, 8)
    mask = CausalMask(kv_mask=_rows(23), offset=0, num_queries=23)
    got, ours = (attention(q, k, v, mask, scale=0.3, impl=i)[0] for i in ("cudnn", "auto"))
    np.testing.assert_array_equal(got, ours)
