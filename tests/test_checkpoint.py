"""HF parity of mrl_jax.models: load transformers checkpoints, save ours back, sharding, clear errors."""
import json

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mrl_jax.models import (CheckpointError, ModelConfig, check_tokenizer_fits, from_pretrained, save_pretrained,
                            tiny_config, tiny_model)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V = 97
ATOL = 1e-4

HF_CONFIGS = {
    # GQA 4 q heads / 2 kv heads, untied, llama3 rope scaling (smoothing active for head_dim 16)
    "llama": dict(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=64,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # q/k/v bias, tied head
    "qwen2": dict(model_type="qwen2", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=64),
    # explicit head_dim (!= hidden / heads), sliding window shorter than the sequence
    "mistral": dict(model_type="mistral", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=4,
                    tie_word_embeddings=False, max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def _hf_model(family, seed=0):
    kw = dict(HF_CONFIGS[family])
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():  # randomise everything (HF zero-inits biases, ones norms): every tensor must map
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.08) + (1.0 if "norm" in name or "ln" in name else 0.0))
    return model.eval()


def _batch(seed=0, B=3, T=9):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = np.ones((B, T), bool)
    mask[1, :3] = False  # left padding
    mask[2, :1] = False
    ids[~mask] = 0
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    return ids, mask, pos


def _ours(model, ids, mask):
    """Our logits with default positions (cumsum(mask) - 1), jitted (one compile instead of op-by-op)."""
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
    ids, mask, pos = _batch()
    return family, model, path, (ids, mask, pos), _hf_logits(model, ids, mask, pos)


def test_from_pretrained_matches_transformers(hf_ckpt):
    family, _, path, (ids, mask, pos), ref = hf_ckpt
    model = from_pretrained(path)
    assert model.config.model_type == family
    got = _ours(model, ids, mask)  # default positions = cumsum(mask) - 1
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_allclose(got[mask], ref[mask], atol=ATOL, rtol=ATOL)
    if family == "llama":  # eager, no mask at all (row 0 has no padding)
        np.testing.assert_allclose(np.asarray(model(ids[:1]))[0], ref[0], atol=ATOL, rtol=ATOL)


def test_save_pretrained_round_trips_through_transformers(hf_ckpt, tmp_path):
    family, _, path, (ids, mask, pos), ref = hf_ckpt
    save_pretrained(from_pretrained(path), tmp_path / "ours")
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert ("lm_head.weight" in saved) == (not json.loads((tmp_path / "ours" / "config.json").read_text())
                                           ["tie_word_embeddings"])
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(hf2).__name__ == type(hf_ckpt[1]).__name__
    np.testing.assert_allclose(_hf_logits(hf2, ids, mask, pos)[mask], ref[mask], atol=ATOL, rtol=ATOL)
    again = from_pretrained(tmp_path / "ours")
    np.testing.assert_allclose(_ours(again, ids, mask)[mask], ref[mask], atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharded_checkpoints(family, tmp_path):
    model = _hf_model(family, seed=1)
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    ids, mask, pos = _batch(1)
    ref = _hf_logits(model, ids, mask, pos)
    ours = from_pretrained(tmp_path / "hf")
    np.testing.assert_allclose(_ours(ours, ids, mask)[mask], ref[mask], atol=ATOL, rtol=ATOL)
    save_pretrained(ours, tmp_path / "ours", max_shard_bytes=30_000)  # our sharded writer, read by transformers
    assert len(list((tmp_path / "ours").glob("model-*.safetensors"))) > 1
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(hf2, ids, mask, pos)[mask], ref[mask], atol=ATOL, rtol=ATOL)


def test_gpt2_without_transformer_prefix_and_with_buffers(tmp_path):
    """Original GPT-2 checkpoints: no 'transformer.' prefix, causal-mask buffers h.N.attn.bias present."""
    model = _hf_model("gpt2", seed=2)
    model.save_pretrained(tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    t = {k.removeprefix("transformer."): v for k, v in t.items()}
    t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids, mask, pos = _batch(2)
    ref = _hf_logits(model, ids, mask, pos)
    np.testing.assert_allclose(_ours(from_pretrained(tmp_path), ids, mask)[mask], ref[mask],
                               atol=ATOL, rtol=ATOL)


def test_param_dtype_from_bf16_checkpoint(tmp_path):
    model = _hf_model("qwen2", seed=3).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    m32 = from_pretrained(tmp_path)  # default: float32 params whatever the file holds
    assert m32.config.param_dtype == "float32" and m32.embed_tokens.embedding[...].dtype == np.float32
    mbf = from_pretrained(tmp_path, param_dtype="bfloat16")
    assert mbf.config.dtype == "bfloat16" and str(mbf.embed_tokens.embedding[...].dtype) == "bfloat16"
    ids, mask, _ = _batch(3)
    a, b = _ours(m32, ids, mask), _ours(mbf, ids, mask)
    assert b.dtype == np.float32 and np.isfinite(b).all()
    assert np.abs(a - b)[mask].mean() < 0.1 * np.abs(a[mask]).mean()


# ------------------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def _tiny_llama():
    return tiny_model("llama", 50, num_layers=2, hidden_size=32, intermediate_size=48)


@pytest.fixture
def saved_tiny(tmp_path, _tiny_llama):
    return save_pretrained(_tiny_llama, tmp_path / "ck")


def _edit_config(path, **kw):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(kw)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def test_error_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="nope.*does not exist"):
        from_pretrained(tmp_path / "nope")


def test_error_missing_config(saved_tiny):
    (saved_tiny / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        from_pretrained(saved_tiny)


def test_error_missing_weights(saved_tiny):
    (saved_tiny / "model.safetensors").rename(saved_tiny / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no weights found.*model\.safetensors.*pytorch_model\.bin"):
        from_pretrained(saved_tiny)


def test_error_unknown_model_type(saved_tiny):
    _edit_config(saved_tiny, model_type="bert")
    supported = r"\['gemma3_text', 'gpt2', 'llama', 'mistral', 'phi3', 'qwen2', 'qwen3'\]"
    with pytest.raises(CheckpointError, match=r"config\.json.*'bert'.*" + supported):
        from_pretrained(saved_tiny)


def test_error_missing_tensor(saved_tiny):
    _edit_tensors(saved_tiny, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(saved_tiny)


def test_error_unexpected_tensor(saved_tiny):
    _edit_tensors(saved_tiny, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.0\.extra\.weight"):
        from_pretrained(saved_tiny)


def test_error_shape_mismatch(saved_tiny):
    _edit_config(saved_tiny, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' "
                                              r"has shape \[32, 48\] .* implies \[32, 64\]"):
        from_pretrained(saved_tiny)


def test_error_untied_config_without_lm_head(saved_tiny):
    _edit_config(saved_tiny, tie_word_embeddings=True)
    assert from_pretrained(saved_tiny).config.tie_word_embeddings  # extra lm_head is ignored when tied
    _edit_tensors(saved_tiny, lambda t: t.pop("lm_head.weight"))
    _edit_config(saved_tiny, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lm_head.weight.*tie_word_embeddings"):
        from_pretrained(saved_tiny)


def test_error_shard_missing(saved_tiny):
    (saved_tiny / "model.safetensors").rename(saved_tiny / "model-00001-of-00001.safetensors")
    (saved_tiny / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"index\.json lists shard.*model-00001-of-00002"):
        from_pretrained(saved_tiny)


def test_check_tokenizer_fits():
    cfg = tiny_config("gpt2", 100)
    check_tokenizer_fits(cfg, 100, "tok/tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tok/tokenizer\.json: tokenizer has 101 ids.* 100 rows"):
        check_tokenizer_fits(cfg, 101, "tok/tokenizer.json")
    assert issubclass(CheckpointError, ValueError)


def test_config_round_trip():
    for fam, kw in HF_CONFIGS.items():
        hf_cfg = transformers.AutoConfig.for_model(**kw).to_dict()
        cfg = ModelConfig.from_hf(hf_cfg)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg, fam
        again = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.to_hf().items() if k != "architectures"})
        assert ModelConfig.from_hf(again.to_dict()) == cfg, fam
        hash(cfg)
