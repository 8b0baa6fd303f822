"""Qwen3 / Gemma 3 / Phi-3 end to end: tiny HF directories (experiments/family_models.py, each family with its
own tokenizer and chat template) trained together for 2 rounds, then `mrl export`: transformers loads the full
policies with our trained logits, peft the Phi-3 LoRA adapters (fused qkv_proj / gate_up_proj)."""
import importlib.util
import json
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.configs import from_dict, load_yaml, to_dict  # noqa: E402
from mrl_jax.export import export_policy  # noqa: E402
from mrl_jax.tasks import RewardSpec  # noqa: E402
from mrl_jax.trainer import Run, train  # noqa: E402
from mrl_jax.trainer.checkpoint import RunCheckpointer  # noqa: E402
from mrl_jax.trainer.config import RunConfig  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ATOL = 1e-4

pytestmark = [pytest.mark.usefixtures("jax_compile_cache"), pytest.mark.slow]


def _family_models():
    spec = importlib.util.spec_from_file_location("family_models", REPO / "experiments" / "family_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_tokenizers_dir):
    """experiments/configs/families.yaml shrunk to 2 rounds of 2 prompts (`support.families_quick`: the budget
    tests/test_fresh_clone.py runs it at, so the qwen3 / gemma3 programs load from the suite's compilation cache),
    on freshly built directories."""
    root = tmp_path_factory.mktemp("families")
    dirs = _family_models().build(root / "models", phi3_tokenizer=shared_tokenizers_dir / "phi-3-mini")
    cfg = load_yaml(RunConfig, REPO / "experiments" / "configs" / "families.yaml")
    raw = support.families_quick(to_dict(cfg))
    for pol, name in zip(raw["policies"], ("qwen3", "gemma3", "phi3")):
        pol["model"]["path"] = str(dirs[name])
    cfg = from_dict(RunConfig, raw)
    out = root / "run"
    train(cfg, out, reward_specs=[RewardSpec(_text_hash, name="text_hash")], progress=False)
    built = Run(cfg)
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    state, _ = ckpt.restore(built.state_template())
    ckpt.close()
    return out, dirs, {p.name: (p, s) for p, s in zip(built.policies, state.policies)}


def _text_hash(prompt, completion: str) -> float:
    """A reward in [0, 1) that differs between any two different completions: two samples of a group always
    carry a learning signal, whatever the sampling stream (the weights must move in 2 rounds of 2 samples)."""
    return (zlib.crc32(completion.encode()) % 997) / 997


def _logits(pol, ps, ids):
    return np.asarray(nnx.merge(pol.graphdef, ps.params)(ids.astype(np.int32)))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_full_policies_export_to_transformers_with_the_trained_logits(run, tmp_path, name):
    out, dirs, pols = run
    pol, ps = pols[name]
    assert export_policy(out, name, tmp_path / "hf")["format"] == "hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = np.random.default_rng(0).integers(3, pol.tokenizer.vocab_size, size=(2, 19))  # past gemma's window 16
    ours = _logits(pol, ps, ids)
    assert not np.allclose(ours, _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(dirs[name]), ids),
                           atol=1e-3)   # the 2 rounds moved the weights
    np.testing.assert_allclose(_hf_logits(hf, ids), ours, atol=ATOL, rtol=ATOL)


def test_phi3_lora_policy_exports_peft_adapters_on_the_fused_projections(run, tmp_path):
    peft = pytest.importorskip("peft")
    out, dirs, pols = run
    pol, ps = pols["phi3"]
    assert export_policy(out, "phi3", tmp_path / "peft")["format"] == "peft"
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert "model.layers.0.self_attn.qkv_proj" in conf["target_modules"]
    assert "model.layers.1.mlp.gate_up_proj" in conf["target_modules"]
    base = transformers.AutoModelForCausalLM.from_pretrained(conf["base_model_name_or_path"],
                                                             attn_implementation="eager").eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    ids = np.random.default_rng(1).integers(3, 32000, size=(2, 9))
    np.testing.assert_allclose(_hf_logits(model, ids), _logits(pol, ps, ids), atol=ATOL, rtol=ATOL)
