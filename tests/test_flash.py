"""Blockwise attention (models/flash.py) and per-layer remat against today's dense attention and the
no-remat update: values and gradients, over every mask the models use (causal with left / right padding,
a cache offset, sliding windows, a logit soft-cap, the prompt-shared layout), with lengths no block divides.

Rows whose query sees no key (left-padding positions) are compared on neither side: the dense path gives them
a uniform average, the blockwise one zeros; no real token reads them (they are masked as keys everywhere).
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax import learner, see
from mrl_jax.models import tiny_model
from mrl_jax.rows import own_rows

A = importlib.import_module("mrl_jax.models.attention")
flash = importlib.import_module("mrl_jax.models.flash")
layers = importlib.import_module("mrl_jax.models.layers")
SCALE = 0.35


def _grads(f, args, w):
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2)))(*args)   # one program, not one per op


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, np.abs(a).max()), rtol=tol)


def _dense_capped(q, k, v, mask, cap):
    """numpy-free reference with a soft-cap: repeated kv heads, -1e30 on masked scores, one softmax."""
    g = q.shape[2] // k.shape[2]
    s = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, g, 2)) * SCALE
    s = jnp.where(mask[:, None], cap * jnp.tanh(s / cap), -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), jnp.repeat(v, g, 2))


@pytest.mark.parametrize("T,S,offset,window,cap,blocks", [
    (13, 13, 0, None, None, (4, 5)),       # causal, left padding, blocks that do not divide
    (13, 13, 0, 4, None, (4, 3)),          # sliding window (whole key blocks skipped)
    (9, 21, 12, None, 5.0, (4, 8)),        # queries at a cache offset over a longer cache, soft-cap
    (7, 7, 0, 3, 2.0, (16, 16)),           # one block each, window and cap
])
def test_blockwise_equals_dense_attention_values_and_gradients(T, S, offset, window, cap, blocks):
    B, H, K, D = 3, 4, 2, 8
    rs = np.random.RandomState(T * 100 + S)
    q = jnp.asarray(rs.randn(B, T, H, D) * 2, jnp.float32)
    k, v = (jnp.asarray(rs.randn(B, S, K, D), jnp.float32) for _ in range(2))
    kv = np.arange(S)[None] >= np.array([0, 3, 6])[:, None]                     # left padding
    kv[2, S - 2:] = False                                                       # and right padding
    cm = A.CausalMask(kv_mask=jnp.asarray(kv), offset=jnp.int32(offset), num_queries=T, window=window)
    dense_mask = cm.dense()
    live = dense_mask.any(-1)[:, :, None, None]
    w = jnp.asarray(rs.randn(B, T, H, D), jnp.float32) * live

    def dense(q, k, v):
        return A._attend(q, k, v, dense_mask, SCALE) if cap is None else _dense_capped(q, k, v, dense_mask, cap)

    def block(q, k, v):
        return flash.blockwise_attention(q, k, v, cm.q_slot, jnp.arange(S), cm.kv_mask, scale=SCALE,
                                         window=window, softcap=cap, block_q=blocks[0], block_k=blocks[1])

    _close(dense(q, k, v) * live, block(q, k, v) * live)
    for a, b in zip(_grads(dense, (q, k, v), w), _grads(block, (q, k, v), w)):
        _close(a, b)


@pytest.mark.parametrize("window", [None, 3])
def test_prompt_shared_layout_blockwise_equals_dense(window, monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", 4)                                    # several blocks per axis
    P, M, Tp, Tc, H, K, D = 2, 3, 5, 7, 4, 2, 8
    B, rs = P * M, np.random.RandomState(window or 0)
    pm = np.arange(Tp)[None] >= np.array([0, 2])[:, None]
    cm = (np.arange(Tc)[None] < rs.randint(1, Tc + 1, (B, 1))).astype(np.float32)
    n = P * Tp + B * Tc
    q = jnp.asarray(rs.randn(1, n, H, D), jnp.float32)
    k, v = (jnp.asarray(rs.randn(1, n, K, D), jnp.float32) for _ in range(2))
    mask = A.PrefixMask.build(jnp.asarray(pm), jnp.asarray(cm), window)
    sees_prompt = np.broadcast_to(np.asarray(mask.to_prompt), (P, 1, Tc, Tp)).any(-1)
    sees = np.asarray(mask.completion).any(-1).reshape(P, M, Tc) | sees_prompt
    live = jnp.asarray(np.concatenate([np.asarray(mask.prompt).any(-1).reshape(-1), sees.reshape(-1)]))
    live = live[None, :, None, None]
    w = jnp.asarray(rs.randn(1, n, H, D), jnp.float32) * live

    def run(impl):
        return lambda q, k, v: A.attention(q, k, v, mask, scale=SCALE, impl=impl)[0]

    _close(jax.jit(run("dense"))(q, k, v) * live, jax.jit(run("blockwise"))(q, k, v) * live)
    for a, b in zip(_grads(run("dense"), (q, k, v), w), _grads(run("blockwise"), (q, k, v), w)):
        _close(a, b)


def _update_grads(model, Tp=5, Tc=7, P=2, G=2):
    """Loss and gradients of the GRPO update's objective (probe none) on a left-padded, ragged batch."""
    graphdef, params = nnx.split(model)
    V, n, rs = model.config.vocab_size, P * G, np.random.RandomState(0)
    batch = own_rows(
        prompt_ids=jnp.asarray(rs.randint(3, V, (P, Tp)), jnp.int32),
        prompt_mask=jnp.asarray(np.arange(Tp)[None] >= np.array([0, 2])[:, None]),
        completion_ids=jnp.asarray(rs.randint(3, V, (n, Tc)), jnp.int32),
        completion_mask=jnp.asarray(np.arange(Tc)[None] < rs.randint(2, Tc + 1, (n, 1)), jnp.float32),
        old_logp=jnp.asarray(rs.uniform(-6, -4, (n, Tc)), jnp.float32), ref_logp=jnp.zeros((n, Tc)),
        rewards=jnp.asarray(rs.rand(n), jnp.float32), truncated=jnp.zeros((n,), bool))
    cfg = learner.GRPOConfig(num_generations=G, max_completion_length=Tc, beta=0.0)
    grads = learner.make_grad_fn(graphdef, "none", cfg, jit=True)
    loss, g, _ = grads(params, batch, see.empty_view(P, 1, Tc, 1, 1), jax.random.PRNGKey(0))
    return loss, g


def _rel_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert np.abs(x - y).max() <= tol * max(np.abs(x).max(), 1e-12), np.abs(x - y).max()


@pytest.mark.parametrize("remat", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_update_gradients_equal_no_remat(remat):
    kw = dict(vocab_size=61, num_layers=2, sliding_window=4)
    loss0, g0 = _update_grads(tiny_model("mistral", **kw))
    loss1, g1 = _update_grads(tiny_model("mistral", remat=remat, **kw))
    assert float(loss0) == pytest.approx(float(loss1), rel=1e-6)
    _rel_close(g0, g1, 1e-6)


def test_blockwise_model_update_gradients_equal_dense(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", 4)
    kw = dict(vocab_size=61, num_layers=2, sliding_window=4, remat="full")
    loss0, g0 = _update_grads(tiny_model("mistral", attention="dense", **kw))
    loss1, g1 = _update_grads(tiny_model("mistral", attention="blockwise", **kw))
    assert float(loss0) == pytest.approx(float(loss1), rel=1e-5)
    _rel_close(g0, g1, 1e-5)


def test_bad_remat_and_attention_names_are_one_line_errors():
    with pytest.raises(ValueError, match="remat must be one of"):
        tiny_model("llama", 32, remat="some")
    with pytest.raises(ValueError, match="attention must be"):
        tiny_model("llama", 32, attention="fast")


@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2"])
def test_row_chunked_mlp_update_gradients_equal_unchunked(family, monkeypatch):
    """The MLP computed 5 rows at a time (28 completion rows, 10 prompt rows: chunks that do not divide) gives
    the unchunked update's loss and gradients."""
    kw = dict(vocab_size=61, num_layers=2, remat="full")
    monkeypatch.setattr(layers, "MLP_CHUNK_ROWS", 0)
    loss0, g0 = _update_grads(tiny_model(family, **kw))
    monkeypatch.setattr(layers, "MLP_CHUNK_ROWS", 5)
    model = tiny_model(family, **kw)
    assert layers.mlp_chunk(model.config) == 5
    loss1, g1 = _update_grads(model)
    assert float(loss0) == pytest.approx(float(loss1), rel=1e-6)
    _rel_close(g0, g1, 1e-6)


def test_row_chunked_equals_the_function_and_is_off_without_remat():
    x = jnp.asarray(np.random.RandomState(1).randn(11, 3), jnp.float32)
    w = jnp.asarray(np.random.RandomState(2).randn(3, 4), jnp.float32)
    f = lambda r: jnp.tanh(r @ w)  # noqa: E731
    np.testing.assert_allclose(np.asarray(layers.row_chunked(f, x, 4)), np.asarray(f(x)), rtol=1e-6, atol=1e-7)
    assert layers.row_chunked(f, x, 0).shape == (11, 4)
    assert layers.mlp_chunk(tiny_model("llama", 32).config) == 0
