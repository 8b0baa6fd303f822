"""`mrl export` / `mrl eval --model` round trip from a 2-round tiny run: a full fine-tuned policy (Llama) and a
LoRA policy (GPT-2) come out as directories that transformers (and peft) load with the trained logits."""

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax import cli  # noqa: E402
from mrl_jax.export import ExportError, export_policy  # noqa: E402
from mrl_jax.models import lora as lora_lib  # noqa: E402
from mrl_jax.trainer import Run, train  # noqa: E402
from mrl_jax.trainer.checkpoint import RunCheckpointer  # noqa: E402
from mrl_jax.trainer.loop import evaluate_from_yaml  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ATOL = 1e-4
SIGNAL = {"faulty": {"seed": 0, "p": {}}}  # digit_reward: rewards vary, so the updates move the params


pytestmark = pytest.mark.usefixtures("jax_compile_cache")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, RunConfig, {policy: (Policy, restored PolicyState)}, initial RunState): a 2-round run."""
    out = tmp_path_factory.mktemp("run")
    cfg = support.to_run_config(support.tiny_config(**{
        "rounds": 2, "checkpoint_every": 1, "policies.0.probes": "none", "policies.1.probes": "none",
        "policies.1.lora": {"rank": 2, "alpha": 4.0}, "policies.1.optimizer.learning_rate": 0.05}))
    train(cfg, out, reward_specs=support.reward_specs(SIGNAL), progress=False)
    built = Run(cfg)
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    state, _ = ckpt.restore(built.state_template())
    ckpt.close()
    pols = {p.name: (p, s) for p, s in zip(built.policies, state.policies)}
    return out, cfg, pols, built.initial_state()


def _tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir",
                                       p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _ids(vocab: int, seed=0, B=3, T=9):
    return np.random.default_rng(seed).integers(3, vocab, size=(B, T)).astype(np.int64)


def _ours(pol, ps, ids):
    return np.asarray(nnx.merge(pol.graphdef, ps.params)(ids.astype(np.int32)))


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def test_export_full_policy_loads_in_transformers_with_the_trained_logits(run, tmp_path):
    out, cfg, pols, _ = run
    before = _tree_digest(out)
    pol, ps = pols["llama_bpe"]
    summary = export_policy(out, "llama_bpe", tmp_path / "hf")
    assert summary["format"] == "hf" and summary["round"] == 1
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "mrl_export.json"):
        assert (tmp_path / "hf" / f).is_file(), f
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = _ids(pol.tokenizer.vocab_size)
    np.testing.assert_allclose(_hf_logits(hf, ids), _ours(pol, ps, ids), atol=ATOL, rtol=ATOL)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("12+34=", add_special_tokens=False)["input_ids"] == pol.tokenizer.encode("12+34=")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == pol.tokenizer.eos_id == pol.sampling.eos_id
    assert _tree_digest(out) == before  # the run directory is only read


def test_export_lora_policy_as_peft_adapters_and_merged(run, tmp_path):
    peft = pytest.importorskip("peft")
    out, cfg, pols, initial = run
    pol, ps = pols["gpt2_uni"]
    # only the adapters trained: the base is bit-identical to the initial state, the adapters moved
    a0, f0 = lora_lib.split_adapters(initial.policies[1].params)
    a1, f1 = lora_lib.split_adapters(ps.params)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(f0), jax.tree.leaves(f1)))
    assert max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
               zip(jax.tree.leaves(a0), jax.tree.leaves(a1))) > 0
    moments = sum(x.size for x in jax.tree.leaves(ps.opt_state) if np.ndim(x))  # Adam mu + nu of the adapters only
    assert moments == 2 * sum(x.size for x in jax.tree.leaves(a1))
    ids = _ids(pol.tokenizer.vocab_size, seed=1)
    ours = _ours(pol, ps, ids)

    summary = export_policy(out, "gpt2_uni", tmp_path / "peft")
    assert summary["format"] == "peft"
    conf = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert conf["r"] == 2 and conf["lora_alpha"] == 4.0 and conf["peft_type"] == "LORA"
    base = transformers.AutoModelForCausalLM.from_pretrained(conf["base_model_name_or_path"],
                                                             attn_implementation="eager").eval()
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    np.testing.assert_allclose(_hf_logits(model, ids), ours, atol=ATOL, rtol=ATOL)

    export_policy(out, "gpt2_uni", tmp_path / "merged", merge_lora=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(merged, ids), ours, atol=ATOL, rtol=ATOL)


def test_cli_export_then_eval_of_the_exported_directory(run, tmp_path, capsys):
    out, cfg, pols, _ = run
    for name in ("llama_bpe", "gpt2_uni"):
        assert cli.main(["export", "--run", str(out), "--policy", name, "--out", str(tmp_path / name),
                         "--checkpoint", "0"]) == 0
        assert json.loads((tmp_path / name / "mrl_export.json").read_text())["round"] == 0
    want = evaluate_from_yaml(out / "config.json", out)  # latest checkpoint (round 1)
    for name in ("llama_bpe", "gpt2_uni"):
        export_policy(out, name, tmp_path / name, force=True)
        assert cli.main(["eval", "--config", str(out / "config.json"), "--model", str(tmp_path / name),
                         "--policy", name, "--out", str(tmp_path / f"eval_{name}")]) == 0
        got = json.loads((tmp_path / f"eval_{name}" / "summary.json").read_text())
        assert got["eval"][name] == want["eval"][name]


@pytest.mark.parametrize("argv, match", [
    (["--policy", "nope"], r"--policy 'nope'.*choose one of \['llama_bpe', 'gpt2_uni'\]"),
    (["--policy", "llama_bpe", "--checkpoint", "7"], r"--checkpoint 7: .*checkpoints.*complete rounds: \[0, 1\]"),
    (["--policy", "llama_bpe", "--merge-lora"], r"--merge-lora: policy 'llama_bpe' has no LoRA"),
])
def test_export_refusals_are_one_line_and_leave_the_run_alone(run, tmp_path, capsys, argv, match):
    out = run[0]
    before = _tree_digest(out)
    assert cli.main(["export", "--run", str(out), "--out", str(tmp_path / "x")] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and __import__("re").search(match, err), err
    assert not (tmp_path / "x").exists() and _tree_digest(out) == before


def test_export_refuses_a_non_empty_directory_unless_forced(run, tmp_path):
    out = run[0]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"--out .*busy: directory is not empty; pass --force"):
        export_policy(out, "llama_bpe", tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    export_policy(out, "llama_bpe", tmp_path / "busy", force=True)
    assert not (tmp_path / "busy" / "keep.txt").exists() and (tmp_path / "busy" / "config.json").is_file()
    for inside in (out / "checkpoints" / "x", out / "export", out, out.parent):
        with pytest.raises(ExportError, match="overlaps the run directory"):
            export_policy(out, "llama_bpe", inside, force=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match=r"config\.json: missing; --run must be a run directory"):
        export_policy(tmp_path / "empty", "llama_bpe", tmp_path / "y")
    with pytest.raises(ExportError, match=r"busy/config\.json: not the config\.json of an `mrl train` run"):
        export_policy(tmp_path / "busy", "llama_bpe", tmp_path / "y")  # a model directory, not a run


@pytest.mark.parametrize("name", ["phi-3-mini", "smollm2-135m"])
@pytest.mark.parametrize("system", [None, "You are terse."])
def test_exported_chat_prompt_ids_equal_autotokenizer(shared_tokenizers_dir, tmp_path, name, system):
    """The ids a chat policy is trained on are the ids ``AutoTokenizer`` gives on the exported directory (the
    Phi-3 folder names LlamaTokenizer, which transformers 5 rebuilds: '▁What' 1724 becomes 'What' 5618)."""
    from types import SimpleNamespace

    from mrl_jax.export import write_tokenizer_files
    from mrl_jax.tokenization import load_tokenizer
    from mrl_jax.trainer.config import PolicySpec
    from mrl_jax.trainer.policy import build_prompt_format

    folder = shared_tokenizers_dir / name
    tok = load_tokenizer(folder)
    spec = PolicySpec(name="p", prompt_format="chat", system_prompt=system)
    trained = build_prompt_format(spec, tok).encode(tok, ["What is 2+3?", " odd  spacing\tand 'quotes'"])
    out = tmp_path / "export"
    out.mkdir()
    write_tokenizer_files(SimpleNamespace(tokenizer=tok, spec=spec, sampling=SimpleNamespace(eos_ids=(tok.eos_id,))),
                          out)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    for text, ids in zip(["What is 2+3?", " odd  spacing\tand 'quotes'"], trained):
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        got = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert list(got["input_ids"] if hasattr(got, "keys") else got) == ids
