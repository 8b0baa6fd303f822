"""Qwen3 / Phi-3 / Gemma 3 text and the yarn / longrope RoPE: logits parity with transformers on random tiny
configs that exercise each family's distinctive parts, checkpoint round trips, clear config errors."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

from mrl_jax.models import CheckpointError, ModelConfig, from_pretrained, save_pretrained

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 89
ATOL = 1e-4
_BASE = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)

HF_CONFIGS = {
    # q/k norm, head_dim 20 != 48 / 4, tied head, yarn scaling (attention factor != 1)
    "qwen3": dict(_BASE, model_type="qwen3", num_key_value_heads=2, head_dim=20, tie_word_embeddings=True,
                  max_position_embeddings=64,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 16}),
    # fused qkv / gate_up, partial rotary 0.5, longrope: short factors up to 8 positions, long beyond
    "phi3": dict(_BASE, model_type="phi3", num_key_value_heads=2, partial_rotary_factor=0.5,
                 tie_word_embeddings=False, max_position_embeddings=64, original_max_position_embeddings=8,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7], "long_factor": [1.0, 2.5, 7.0]},
                 pad_token_id=0, eos_token_id=2, bos_token_id=1),
    # (1 + w) norms x4, q/k norm, head_dim 32, query_pre_attn_scalar, window 3 < sequence, local / global RoPE
    "gemma3_text": dict(_BASE, model_type="gemma3_text", num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                        query_pre_attn_scalar=24, sliding_window=3, rope_theta=1e6, rope_local_base_freq=100.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        final_logit_softcapping=5.0, max_position_embeddings=64),
    # a Qwen2.5-style long-context config: yarn routes the qwen2 family through the decoder with cos/sin scaled
    "qwen2": dict(_BASE, model_type="qwen2", num_key_value_heads=2, max_position_embeddings=64,
                  rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32},
                  rope_theta=1e4),
}


def _hf_model(family, seed=0):
    kw = dict(HF_CONFIGS[family])
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # every tensor random: a norm weight left at its init would hide a missing (1 + w)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.08) + (1.0 if "norm" in name else 0.0))
    return model.eval()


def _batch(T, seed=0, B=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :3] = False  # left padding
    mask[2, :1] = False
    ids[~mask] = 0
    return ids, mask, np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)


def _ours(model, ids, mask):
    graphdef, params = nnx.split(model)
    return np.asarray(jax.jit(lambda p, i, m: nnx.merge(graphdef, p)(i, attention_mask=m))(params, ids, mask))


def _hf_logits(model, ids, mask, pos):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_ckpt(request, tmp_path_factory):
    family = request.param
    model = _hf_model(family)
    path = tmp_path_factory.mktemp(f"hf_{family}")
    model.save_pretrained(path)
    return family, model, path


def _max_diff(family, model, hf, T):
    ids, mask, pos = _batch(T)
    got, ref = _ours(model, ids, mask), _hf_logits(hf, ids, mask, pos)
    assert got.dtype == np.float32 and got.shape == ref.shape
    return float(np.max(np.abs(got[mask] - ref[mask])))


def test_from_pretrained_matches_transformers(hf_ckpt):
    family, hf, path = hf_ckpt
    model = from_pretrained(path)
    assert model.config.model_type == family
    # 13 tokens: past gemma's window and phi3's longrope original length (the long factors); 6: short factors
    for T in (13, 6):
        diff = _max_diff(family, model, hf, T)
        print(f"{family} T={T} max|diff| {diff:.2e}")
        assert diff < ATOL


def test_save_pretrained_round_trips_through_transformers(hf_ckpt, tmp_path):
    family, hf, path = hf_ckpt
    save_pretrained(from_pretrained(path), tmp_path / "ours")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(hf2).__name__ == type(hf).__name__
    sd, sd2 = hf.state_dict(), hf2.state_dict()
    assert sorted(sd) == sorted(sd2)
    for k in sd:
        np.testing.assert_array_equal(sd[k].numpy(), sd2[k].numpy(), err_msg=k)
    ids, mask, pos = _batch(13)
    np.testing.assert_allclose(_hf_logits(hf2, ids, mask, pos)[mask], _hf_logits(hf, ids, mask, pos)[mask],
                               atol=ATOL, rtol=ATOL)


def test_num_params_counts_every_weight(hf_ckpt):
    family, hf, path = hf_ckpt
    model = from_pretrained(path)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert model.config.num_params() == n == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("edit,match", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"config\.json: layer_types entry 'chunked_attention' is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     r"config\.json: rope_scaling type 'dynamic' is not supported"),
    ({"attn_logit_softcapping": 50.0}, r"config\.json: attn_logit_softcapping"),
])
def test_bad_config_is_one_line_naming_file_and_field(edit, match):
    hf = transformers.AutoConfig.for_model(**HF_CONFIGS["gemma3_text"]).to_dict()
    hf.update(edit)
    with pytest.raises(CheckpointError, match=match) as e:
        ModelConfig.from_hf(hf, source="dir/config.json")
    assert "\n" not in str(e.value)


def test_config_round_trip():
    for family, kw in HF_CONFIGS.items():
        hf_cfg = transformers.AutoConfig.for_model(**kw).to_dict()
        cfg = ModelConfig.from_hf(hf_cfg)
        again = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
        assert ModelConfig.from_hf(again.to_dict()) == cfg, family
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg, family


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3_text"])
def test_sampler_cache_equals_full_forward(family):
    """generate (prompt-shared cache, G = 2) logprobs == the full forward's; gemma's window 3 is shorter than
    prompt + completion, so both the sliding and the global layer's masks are exercised."""
    from mrl_jax import models
    from mrl_jax.sampler import SamplingConfig, generate, left_pad

    extra = {"sliding_window": 3} if family == "gemma3_text" else {}
    g, p = nnx.split(models.tiny_model(family, 61, seed=3, hidden_size=32, intermediate_size=64, **extra))
    rng = np.random.default_rng(0)
    p = jax.tree_util.tree_map(lambda x: x * 3.0 + 0.2 * rng.standard_normal(x.shape).astype(np.float32), p)
    ids, mask = (jax.numpy.asarray(a) for a in left_pad([[1, 5, 9, 14], [1, 22], [1, 3, 4, 5, 6, 7]], 0, length=7))
    out = generate(g, p, ids, mask, jax.random.key(2), SamplingConfig(max_new_tokens=6, pad_id=0), num_samples=2)
    rids, rmask = np.repeat(np.asarray(ids), 2, 0), np.repeat(np.asarray(mask), 2, 0)
    seq = np.concatenate([rids, np.asarray(out.tokens)], 1)
    forward = jax.jit(lambda p, seq, m: nnx.merge(g, p)(seq, attention_mask=m))   # one program, not one per op
    full = np.asarray(forward(p, seq, np.concatenate([rmask, np.ones_like(out.mask)], 1)))
    lp = jax.nn.log_softmax(full[:, 6:6 + out.tokens.shape[1]], -1)
    lp = np.take_along_axis(np.asarray(lp), np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), lp, atol=2e-4)


def test_fsdp_rules_shard_fused_kernels_and_replicate_norms():
    from jax.sharding import PartitionSpec as P

    from mrl_jax import models, mwra

    class Mesh8:
        shape, axis_names = {"data": 8}, ("data",)

    for family in ("qwen3", "phi3", "gemma3_text"):
        state = nnx.state(nnx.eval_shape(lambda: models.tiny_model(family, 128)), nnx.Param)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            s = mwra.path_str(path)
            spec = mwra.spec_for(s, leaf.shape, Mesh8(), min_size=0)
            if s.endswith("scale"):   # q_norm / k_norm and gemma's four norms: replicated
                assert spec == P(), s
            elif s.endswith("kernel"):   # sharded along the larger dim (fused qkv [64, 128], gate_up [64, 256])
                assert spec == (P("data") if leaf.shape[0] >= leaf.shape[1] else P(None, "data")), s
            if "qkv_proj" in s or "gate_up_proj" in s:
                assert spec == P(None, "data"), s


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma3_text"])
def test_tiny_init_policies_of_the_new_families(family):
    from mrl_jax.configs import from_dict
    from mrl_jax.tokenization import train_tokenizer
    from mrl_jax.trainer.config import PolicySpec
    from mrl_jax.trainer.policy import build_model

    spec = from_dict(PolicySpec, {"name": "p", "model": {"family": family, "num_layers": 3, "num_kv_heads": 1}})
    tok = train_tokenizer("char", ["abc 123", "def 456"], 300)
    model = build_model(spec, tok, seed=0)
    cfg = model.config
    assert (cfg.model_type, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (family, 3, 1, tok.vocab_size)
    if family == "gemma3_text":
        assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg.replace(remat="none")   # remat is a run option, not HF's
