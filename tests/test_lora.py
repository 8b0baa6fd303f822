"""LoRA policies (mrl_jax.models.lora on nnx.LoRA): PEFT parity, merge, frozen base, KL reference = base with the
adapters off, config errors, and the trainable-parameter / compiled-update memory figure (rank 8 vs full FT)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mrl_jax import models, see
from mrl_jax.configs import ConfigError, from_dict
from mrl_jax.rows import own_rows
from mrl_jax.learner import make_logp_fn, make_optimizer, make_update_step
from mrl_jax.models import lora as lora_lib
from mrl_jax.trainer.config import PolicySpec, RunConfig
from mrl_jax.trainer.policy import add_lora, trainable_param_count
from support import one_device_policy
from mrl_jax.tokenization import train_tokenizer

V = 61
ATOL = 1e-4
KW = {"llama": dict(num_kv_heads=2), "gpt2": dict()}


def _model(family, seed=0, **kw):
    return models.tiny_model(family, V, hidden_size=32, num_heads=4, num_layers=2, intermediate_size=48, seed=seed,
                             **KW[family], **kw)


def _randomize_adapters(model, seed=3):
    for k, (_, m) in enumerate(lora_lib.lora_modules(model)):
        key = jax.random.fold_in(jax.random.key(seed), k)
        m.lora_b[...] = 0.3 * jax.random.normal(key, m.lora_b.shape)
    return model


def _ids(B=2, T=7, seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_loads_our_adapters_with_our_logits_and_merge_matches(family, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = _model(family)
    ids = _ids()
    base_logits = np.asarray(model(ids))
    targets = ("q_proj", "v_proj", "down_proj") if family == "llama" else ("c_attn", "mlp.c_proj")
    lora_lib.apply_lora(model, rank=4, alpha=8.0, targets=targets, seed=1)
    np.testing.assert_array_equal(np.asarray(model(ids)), base_logits)  # B starts at zero
    ours = np.asarray(_randomize_adapters(model)(ids))
    assert np.abs(ours - base_logits).max() > 1e-2
    models.save_pretrained(lora_lib.base_model(model), tmp_path / "base")
    lora_lib.save_adapters(model, tmp_path / "ad", base_model_name_or_path=str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    with torch.no_grad():
        got = pm(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, ours, atol=ATOL, rtol=ATOL)
    n_wrapped = sum(1 for n, _ in pm.named_modules() if n.endswith(".lora_A.default"))
    assert n_wrapped == len(lora_lib.lora_modules(model)) == 2 * (3 if family == "llama" else 2)
    # merged into the kernels: a plain checkpoint transformers loads with the same logits
    models.save_pretrained(lora_lib.merge(model), tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        got_merged = merged(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got_merged, ours, atol=ATOL, rtol=ATOL)
    # and back: the saved adapters loaded onto a fresh LoRA model of the same base
    fresh = lora_lib.apply_lora(models.from_pretrained(tmp_path / "base"), rank=4, alpha=8.0,
                                targets=lora_lib.targets_from_peft(
                                    lora_lib.read_adapter_config(tmp_path / "ad")["target_modules"]), seed=9)
    np.testing.assert_allclose(np.asarray(lora_lib.load_adapters(fresh, tmp_path / "ad")(ids)), ours, atol=1e-6)


def test_bf16_base_keeps_f32_adapters_and_adapters_off_is_the_base():
    model = _model("llama", dtype="bfloat16", param_dtype="bfloat16")
    ids = _ids()
    base_logits = np.asarray(model(ids))
    lora_lib.apply_lora(model, rank=4, alpha=8.0, targets=("q_proj", "o_proj"), seed=1)
    _randomize_adapters(model)
    g, state = nnx.split(model)
    adapters, frozen = lora_lib.split_adapters(state)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert np.abs(np.asarray(model(ids)) - base_logits).max() > 1e-2
    off = nnx.merge(g, lora_lib.adapters_off(adapters), frozen)
    np.testing.assert_array_equal(np.asarray(off(ids)), base_logits)  # the KL reference: no second base copy


def _spec(**lora):
    return from_dict(PolicySpec, {"name": "p", "lora": lora})


@pytest.mark.parametrize("lora, key, match", [
    ({"rank": 2, "target_modules": ["q_proj", "qproj"]}, "lora.target_modules", r"'qproj' matches no linear"),
    ({"rank": 2, "target_modules": ["lm_head"]}, "lora.target_modules", "lm_head cannot be adapted"),
    ({"rank": 40, "target_modules": ["k_proj"]}, "lora.rank", r"40 exceeds the smallest dimension \(16\).*k_proj"),
])
def test_lora_config_errors_name_the_key_and_fix(lora, key, match):
    model = _model("llama", tie_word_embeddings=False)  # k_proj: 32 -> 2 kv heads x 8 = 16
    with pytest.raises(ConfigError) as e:
        add_lora(_spec(**lora), model, seed=0)
    msg = str(e.value)
    assert f"config key 'policies.p.{key}'" in msg and "\n" not in msg
    import re
    assert re.search(match, msg), msg


def test_default_targets_cover_both_families():
    for family, n in (("llama", 7), ("gpt2", 4)):
        model = add_lora(_spec(rank=2), _model(family), seed=0)
        assert len(lora_lib.lora_modules(model)) == 2 * n


def _tiny_run(lora: dict, beta: float = 0.0):
    tok = train_tokenizer("char", ["0123456789+= abc"] * 4, 300)
    cfg = from_dict(RunConfig, {"policies": [{"name": "p", "lora": lora, "grpo": {"beta": beta},
                                              "sampling": {"max_new_tokens": 3}}],
                                "num_generations": 2, "prompts_per_round": 2, "rounds": 2})
    return tok, cfg


def _batch(V, P=2, G=2, Tp=4, Tc=3, seed=0):
    rng = np.random.default_rng(seed)
    n = P * G
    return own_rows(prompt_ids=jnp.asarray(rng.integers(3, V, (P, Tp)), jnp.int32), prompt_mask=jnp.ones((P, Tp), bool),
                 completion_ids=jnp.asarray(rng.integers(3, V, (n, Tc)), jnp.int32), completion_mask=jnp.ones((n, Tc)),
                 old_logp=jnp.full((n, Tc), -3.0), ref_logp=jnp.zeros((n, Tc)),
                 rewards=jnp.asarray([1.0, 0.0, 0.0, 1.0]), truncated=jnp.zeros((n,), bool))


def test_lora_update_trains_adapters_only_and_its_kl_reference_is_the_base():
    tok, cfg = _tiny_run({"rank": 2, "alpha": 4.0}, beta=0.5)
    model = models.tiny_model("llama", tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, num_layers=1,
                              intermediate_size=16)
    base_state = nnx.split(nnx.clone(model))
    pol, params = one_device_policy(cfg, tok, model)
    st = pol.init_state(params)
    assert st.ref_params is None  # no copy of the base is held
    params = st.params
    adapters, frozen = lora_lib.split_adapters(params)
    adapters = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.key(x.size), x.shape), adapters)
    params = nnx.merge_state(adapters, frozen)
    batch = _batch(tok.vocab_size)
    view = see.empty_view(2, 1, 3, 3, 1)
    g, p = nnx.split(lora_lib.merge(nnx.merge(pol.graphdef, params)))  # before the update donates the adapters
    before = jax.tree.map(np.asarray, (adapters, frozen))
    new, opt_state, _, m = pol.update(params, st.opt_state, None, batch, view, jax.random.key(0), 0)
    a2, f2 = lora_lib.split_adapters(new)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[1]), jax.tree.leaves(f2)))
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before[0]), jax.tree.leaves(a2)))
    # the same step as full fine-tuning of the merged model, with the plain base as its reference: same KL
    grpo_cfg = cfg.policies[0].grpo.resolved(2, 3, cfg.policies[0].sampling.temperature)
    ref = make_logp_fn(base_state[0], grpo_cfg)(base_state[1], batch)
    full = make_update_step(g, make_optimizer(1e-3), "none", grpo_cfg, donate=False)
    _, _, m_full = full(p, make_optimizer(1e-3).init(p), batch.replace(ref_logp=ref), view, jax.random.key(0))
    assert float(m_full["kl"]) > 1e-4
    np.testing.assert_allclose(float(m["kl"]), float(m_full["kl"]), rtol=1e-4)
    np.testing.assert_allclose(float(m["loss"]), float(m_full["loss"]), rtol=1e-4, atol=1e-6)


def test_full_policy_update_scores_its_reference_itself():
    """beta > 0 without LoRA: the policy's update fills the rows' ref_logp from ref_params (the round passes rows
    without it), the same step as the learner's on rows scored by the reference outside."""
    tok, cfg = _tiny_run({}, beta=0.5)
    model = models.tiny_model("llama", tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, num_layers=1,
                              intermediate_size=16)
    pol, params = one_device_policy(cfg, tok, model)
    ref = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), params)
    st = pol.init_state(params, ref)
    batch, view = _batch(tok.vocab_size), see.empty_view(2, 1, 3, 3, 1)
    grpo_cfg = cfg.policies[0].grpo.resolved(2, 3, cfg.policies[0].sampling.temperature)
    scored = batch.replace(ref_logp=make_logp_fn(pol.graphdef, grpo_cfg)(ref, batch))
    full = make_update_step(pol.graphdef, pol.optimizer, "none", grpo_cfg, donate=False)
    _, _, m_full = full(params, pol.optimizer.init(params), scored, view, jax.random.key(0))
    _, _, ref_after, m = pol.update(jax.tree.map(jnp.copy, params), st.opt_state, ref, batch, view,
                                    jax.random.key(0), 0)
    assert float(m_full["kl"]) > 1e-4
    np.testing.assert_allclose(float(m["kl"]), float(m_full["kl"]), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss"]), float(m_full["loss"]), rtol=1e-5, atol=1e-7)


def _update_figures(rank: int) -> tuple[int, dict]:
    """(trainable params, compiled update memory) of one policy update, full FT when rank is 0."""
    tok, cfg = _tiny_run({"rank": rank, "alpha": 16.0} if rank else {})
    model = models.tiny_model("llama", 512, hidden_size=128, num_heads=4, num_kv_heads=2, num_layers=2,
                              intermediate_size=512)
    pol, params = one_device_policy(cfg, tok, model)
    st = pol.init_state(params)
    batch, view = _batch(512), see.empty_view(2, 1, 3, 3, 1)
    grpo_cfg = cfg.policies[0].grpo.resolved(2, 3, cfg.policies[0].sampling.temperature)
    if rank:
        adapters, frozen = lora_lib.split_adapters(st.params)
        g = nnx.split(nnx.merge(pol.graphdef, st.params), nnx.LoRAParam, ...)[0]
        step = make_update_step(g, pol.optimizer, "none", grpo_cfg, jit=False)
        lowered = jax.jit(step).lower(adapters, st.opt_state, batch, view, jax.random.key(0), frozen=frozen)
    else:
        step = make_update_step(pol.graphdef, pol.optimizer, "none", grpo_cfg, jit=False)
        lowered = jax.jit(step).lower(st.params, st.opt_state, batch, view, jax.random.key(0))
    mem = lowered.compile().memory_analysis()
    figures = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes")} if mem is not None else {}
    return trainable_param_count(st), figures


def test_rank8_lora_trains_a_fraction_of_the_params_in_less_update_memory():
    full_n, full_mem = _update_figures(0)
    lora_n, lora_mem = _update_figures(8)
    # rank 8 on the 7 projections of 2 layers (d=128, kv=64, ffn=512): r * (in + out) each
    per_layer = 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 512) * 3)
    assert lora_n == 2 * per_layer and lora_n < full_n / 10
    print(f"\nLoRA figure: trainable params full={full_n} rank8={lora_n}; update memory full={full_mem} "
          f"rank8={lora_mem}")
    if full_mem and lora_mem:  # outputs are the new params and optimizer state: adapters only with LoRA
        assert lora_mem["output_size_in_bytes"] < full_mem["output_size_in_bytes"] / 5
        total = lambda m: sum(m.values())  # noqa: E731
        assert total(lora_mem) < total(full_mem)


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_adapter_dropout_acts_in_the_update_only(rate):
    tok, cfg = _tiny_run({"rank": 2, "alpha": 4.0, "dropout": rate})
    model = models.tiny_model("llama", tok.vocab_size, hidden_size=16, num_heads=2, num_kv_heads=1, num_layers=1,
                              intermediate_size=16)
    pol, params = one_device_policy(cfg, tok, model)
    st = pol.init_state(params)
    adapters, frozen = lora_lib.split_adapters(st.params)
    adapters = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.key(x.size), x.shape), adapters)
    params = nnx.merge_state(adapters, frozen)
    ids = _ids(T=5) % tok.vocab_size
    sampler_model = nnx.merge(pol.graphdef, params)  # the sampler's graph: dropout off, deterministic
    np.testing.assert_array_equal(np.asarray(sampler_model(ids)), np.asarray(sampler_model(ids)))
    np.testing.assert_allclose(np.asarray(sampler_model(ids)), np.asarray(lora_lib.merge(sampler_model)(ids)),
                               atol=1e-5)
    batch, view = _batch(tok.vocab_size), see.empty_view(2, 1, 3, 3, 1)
    losses = []
    for k in (0, 0, 1):
        p = jax.tree.map(jnp.copy, params)
        _, _, _, m = pol.update(p, jax.tree.map(jnp.copy, st.opt_state), None, batch, view, jax.random.key(k), 0)
        losses.append(float(m["loss"]))
    assert losses[0] == losses[1] and (losses[0] != losses[2]) == (rate > 0)  # the key draws the dropout masks
