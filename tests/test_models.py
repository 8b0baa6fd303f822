"""mrl_jax.models without transformers: cached decode == full forward, dtypes, functional form, configs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax.models import CheckpointError, KVCache, ModelConfig, default_positions, tiny_config, tiny_model

V = 61
FAMILIES = {
    "llama": dict(),  # GQA 4/2, untied
    "qwen2": dict(),  # qkv bias, tied
    "mistral": dict(sliding_window=3, head_dim=32, num_kv_heads=1),  # window < sequence, explicit head_dim
    "gpt2": dict(),
    "qwen3": dict(),  # q/k norm, head_dim 24 != 64 / 4
    "phi3": dict(),  # fused qkv / gate_up, partial rotary
    "gemma3_text": dict(sliding_window=3),  # sliding + global layers (window < sequence), (1 + w) norms
}


def _batch(seed=0, B=3, T=10):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :4] = False  # left padding
    mask[2, :1] = False
    ids[~mask] = 0
    return ids, mask


def _randomize(model, seed):
    """Non-trivial biases / norm scales so that every parameter matters (host numpy: no compiles)."""
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(
        lambda x: jnp.asarray(np.asarray(x, np.float32) + 0.1 * rng.standard_normal(x.shape, np.float32), x.dtype),
        params)
    return nnx.merge(graphdef, params)


def _jit_forward(model):
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, ids, mask: nnx.merge(graphdef, p)(ids, attention_mask=mask))
    return lambda ids, mask: np.asarray(fwd(params, ids, mask))


def _jit_decode(model):
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(p, ids, pos, cache, index, kv_mask):
        return nnx.merge(graphdef, p).decode(ids, pos, cache, index, kv_mask)

    return lambda *a: step(params, *a)


def _decode_all(model, ids, mask, chunks, S):
    """Prefill chunks[0] tokens at index 0, then feed the rest in the given chunk sizes; kv_mask grows as
    slots are written (validity after writing). Returns logits [B, T, V] gathered from the decode calls."""
    B, T = ids.shape
    step = _jit_decode(model)
    pos = np.asarray(default_positions(jnp.asarray(ids), jnp.asarray(mask)))
    cache = model.init_cache(B, S)
    kv_mask = np.zeros((B, S), bool)
    out, start = [], 0
    for n in chunks:
        kv_mask[:, start:start + n] = mask[:, start:start + n]
        logits, cache = step(ids[:, start:start + n], pos[:, start:start + n], cache, jnp.int32(start),
                             jnp.asarray(kv_mask))
        out.append(np.asarray(logits))
        start += n
    assert start == T
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_matches_full_forward(family):
    model = _randomize(tiny_model(family, V, seed=1, **FAMILIES[family]), seed=2)
    ids, mask = _batch()
    full = _jit_forward(model)(ids, mask)
    # prefill 3, then a 3-token chunk at cache_index 3 (same compiled shape), then single steps
    got, cache = _decode_all(model, ids, mask, chunks=[3, 3, 1, 1, 1, 1], S=13)
    assert got.dtype == np.float32 and got.shape == (3, 10, V)
    np.testing.assert_allclose(got[mask], full[mask], atol=1e-5, rtol=1e-5)
    cfg = model.config
    assert isinstance(cache, KVCache) and cache.k.shape == (cfg.num_layers, 3, 13, cfg.num_kv_heads, cfg.head_dim)
    # a left-padded row gives the same logits as the same tokens without padding (row 1 has 4 pads)
    shifted_ids, shifted_mask = np.roll(ids, -4, axis=1), np.roll(mask, -4, axis=1)
    shifted_ids[1:, 6:], shifted_mask[1:, 6:] = 0, False  # now right-padded: causal mask hides the tail
    again = _jit_forward(model)(shifted_ids, shifted_mask)
    np.testing.assert_allclose(full[1, 4:], again[1, :6], atol=1e-5, rtol=1e-5)


def test_hidden_head_and_call_agree():
    model = tiny_model("qwen2", V)
    ids, mask = _batch(1)
    h = model.hidden(ids, attention_mask=mask)
    assert h.shape == (3, 10, 64)
    np.testing.assert_allclose(np.asarray(model.head(h)), np.asarray(model(ids, attention_mask=mask)), atol=1e-6)
    # explicit positions are honoured (shifting every position changes RoPE logits)
    pos = default_positions(jnp.asarray(ids), jnp.asarray(mask))
    assert not np.allclose(np.asarray(model(ids, positions=pos + 5, attention_mask=mask))[mask],
                           np.asarray(model(ids, positions=pos, attention_mask=mask))[mask])


def test_bfloat16_compute_and_cache():
    m32 = _randomize(tiny_model("llama", V, seed=3), seed=4)
    graphdef, params = nnx.split(m32)
    cfg16 = m32.config.replace(dtype="bfloat16", param_dtype="bfloat16")
    g16, _ = nnx.split(nnx.eval_shape(lambda: tiny_model("llama", V, dtype="bfloat16", param_dtype="bfloat16")))
    m16 = nnx.merge(g16, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params))
    assert m16.config == cfg16 and m16.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    ids, mask = _batch(2)
    full32, full16 = _jit_forward(m32)(ids, mask), _jit_forward(m16)(ids, mask)
    assert full16.dtype == np.float32
    err = np.abs(full16 - full32)[mask].max()
    assert err < 0.05 * np.abs(full32[mask]).max(), err
    dec16, cache = _decode_all(m16, ids, mask, chunks=[5, 5], S=10)
    assert cache.k.dtype == jnp.bfloat16
    assert np.abs(dec16 - full16)[mask].max() < 0.05 * np.abs(full32[mask]).max()
    # bf16 compute over float32 master params
    mixed = nnx.eval_shape(lambda: tiny_model("llama", V, dtype="bfloat16"))
    assert mixed.embed_tokens.embedding.dtype == jnp.float32
    assert mixed.init_cache(1, 4).k.dtype == jnp.bfloat16


def test_functional_form_gradients_reach_every_param():
    model = tiny_model("qwen2", V, num_layers=1)
    graphdef, params = nnx.split(model)
    ids, mask = _batch(3)

    @jax.jit
    def loss(p):
        logits = nnx.merge(graphdef, p)(ids[:, :-1], attention_mask=mask[:, :-1])
        lp = jax.nn.log_softmax(logits)
        tok = jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
        return -(tok * mask[:, 1:]).sum() / mask[:, 1:].sum()

    grads = jax.grad(loss)(params)
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0, path


def _paths(family, **kw):
    model = nnx.eval_shape(lambda: tiny_model(family, V, **kw))
    return {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_param_paths_are_readable():
    llama = _paths("llama")
    assert {"embed_tokens.embedding", "layers.0.self_attn.q_proj.kernel", "layers.1.mlp.down_proj.kernel",
            "norm.scale", "lm_head.kernel"} <= llama
    qwen = _paths("qwen2")
    assert "layers.0.self_attn.k_proj.bias" in qwen and "lm_head.kernel" not in qwen
    assert "layers.0.self_attn.o_proj.bias" not in qwen
    gpt2 = _paths("gpt2")
    assert {"wte.embedding", "wpe.embedding", "layers.0.attn.c_attn.kernel", "ln_f.bias"} <= gpt2
    assert {"layers.0.self_attn.q_norm.scale", "layers.0.self_attn.k_norm.scale"} <= _paths("qwen3")
    phi = _paths("phi3")
    assert {"layers.0.self_attn.qkv_proj.kernel", "layers.0.mlp.gate_up_proj.kernel"} <= phi
    assert "layers.0.self_attn.q_proj.kernel" not in phi and "layers.0.mlp.up_proj.kernel" not in phi
    assert {"layers.1.pre_feedforward_layernorm.scale", "layers.1.post_feedforward_layernorm.scale",
            "layers.1.self_attn.k_norm.scale"} <= _paths("gemma3_text")


def test_tiny_config_defaults_and_overrides():
    cfg = tiny_config("llama", 100)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert not cfg.tie_word_embeddings and tiny_config("qwen2", 100).tie_word_embeddings
    assert tiny_config("gpt2", 100).num_kv_heads == 4
    cfg = tiny_config("llama", 100, num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1)
    assert (cfg.num_layers, cfg.head_dim) == (3, 16)
    assert hash(cfg) == hash(tiny_config("llama", 100, num_layers=3, hidden_size=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="unknown tiny_model family"):
        tiny_config("bert", 100)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny_config("llama", 100, num_kv_heads=3)
    assert ModelConfig.from_hf(tiny_config("mistral", 100, sliding_window=8).to_hf()) == \
        tiny_config("mistral", 100, sliding_window=8)
    for family in FAMILIES:
        c = tiny_config(family, 100, **FAMILIES[family])
        model = nnx.eval_shape(lambda: tiny_model(family, 100, **FAMILIES[family]))
        assert c.num_params() == sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_from_hf_legacy_and_unsupported_configs():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    legacy = ModelConfig.from_hf(dict(base, model_type="llama", rope_theta=5e5, rope_scaling={"type": "linear",
                                                                                          "factor": 2.0}))
    assert legacy.rope_theta == 5e5 and legacy.rope_type == "linear" and legacy.num_kv_heads == 4
    qwen = ModelConfig.from_hf(dict(base, model_type="qwen2", use_sliding_window=False, sliding_window=4096,
                                    rope_scaling=None))
    assert qwen.sliding_window is None and qwen.qkv_bias and not qwen.o_bias and qwen.rope_type == "default"
    with pytest.raises(CheckpointError, match="x/config.json: rope_scaling type 'dynamic'"):
        ModelConfig.from_hf(dict(base, model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
                            source="x/config.json")
    with pytest.raises(CheckpointError, match="x/config.json.*'num_hidden_layers'"):
        ModelConfig.from_hf({k: v for k, v in dict(base, model_type="qwen2").items() if k != "num_hidden_layers"},
                            source="x/config.json")


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("gpt2", {}), ("mistral", {"sliding_window": 5}), ("qwen3", {}),
                                          ("phi3", {}), ("gemma3_text", {"sliding_window": 4})])
def test_hidden_prefix_equals_the_repeated_prompt_rows_with_gradients(family, extra):
    """Each prompt computed once for its M completions: hidden states and the gradient of a loss on them equal
    ``hidden`` on [prompt ++ completion] rows (left-padded prompts, ragged completions, sliding window)."""
    from flax import nnx
    model = tiny_model(family, 64, **extra)
    P, M, Tp, Tc = 3, 4, 6, 5
    rs = np.random.RandomState(0)
    pids = jnp.asarray(rs.randint(3, 64, (P, Tp)), jnp.int32)
    pm = jnp.asarray(np.arange(Tp)[None] >= np.array([[0], [2], [5]]))
    cids = jnp.asarray(rs.randint(3, 64, (P * M, Tc)), jnp.int32)
    cm = jnp.asarray((np.arange(Tc)[None] < rs.randint(1, Tc + 1, (P * M, 1))).astype(np.float32))
    w = jnp.asarray(rs.randn(P * M, Tc, model.config.hidden_size), jnp.float32) * cm[..., None]
    graphdef, params = nnx.split(model)

    def shared(p):
        hl, hc = nnx.merge(graphdef, p).hidden_prefix(pids, pm, cids, cm)
        return jnp.sum(hc * w) + jnp.sum(hl * w[::M, 0]), (hl, hc)

    def repeated(p):
        ids = jnp.concatenate([jnp.repeat(pids, M, 0), cids], 1)
        h = nnx.merge(graphdef, p).hidden(ids, attention_mask=jnp.concatenate([jnp.repeat(pm, M, 0), cm > 0], 1))
        return jnp.sum(h[:, Tp:] * w) + jnp.sum(h[::M, Tp - 1] * w[::M, 0]), (h[::M, Tp - 1], h[:, Tp:])

    (l1, (hl, hc)), g1 = jax.jit(jax.value_and_grad(shared, has_aux=True))(params)   # jitted: one program each
    (l2, (rl, rc)), g2 = jax.jit(jax.value_and_grad(repeated, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(hl), np.asarray(rl), atol=1e-5)
    np.testing.assert_allclose(np.asarray(hc * cm[..., None]), np.asarray(rc * cm[..., None]), atol=1e-5)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):   # 1e-5 of the leaf's scale (summation order)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
