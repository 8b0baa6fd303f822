"""A documented experiment runs from a fresh clone: family_models.py builds its three directories with no
../shared beside the repository (the Phi-3-style tokenizer is trained, with Phi-3's control tokens and chat
template), and prompt_format: chat without jinja2 names jinja2, not the template."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_family_models_builds_in_a_clone_without_shared(tmp_path):
    from mrl_jax.chat import PromptFormat
    from mrl_jax.tokenization import load_tokenizer

    clone = tmp_path / "clone"            # a clone with no ../shared next to it
    (clone / "experiments").mkdir(parents=True)
    shutil.copy(REPO / "experiments" / "family_models.py", clone / "experiments")
    assert not (tmp_path / "shared").exists()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MRL_SHARED_TOKENIZERS": str(tmp_path / "missing")}
    proc = subprocess.run([sys.executable, "experiments/family_models.py", "runs/family_models"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    phi3 = clone / "runs" / "family_models" / "phi3"
    for name in ("qwen3", "gemma3", "phi3"):
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (clone / "runs" / "family_models" / name / f).is_file(), (name, f)
    tok = load_tokenizer(phi3)
    gen = json.loads((phi3 / "generation_config.json").read_text())
    end = tok.hf.token_to_id("<|end|>")
    assert end in gen["eos_token_id"] and json.loads((phi3 / "config.json").read_text())["vocab_size"] == tok.vocab_size
    fmt = PromptFormat.chat_from(phi3)
    assert fmt.chat.render(["2+3="]) == ["<|user|>\n2+3=<|end|>\n<|assistant|>\n"]
    assert fmt.chat.end_of_turn() == "<|end|>"


def test_chat_without_jinja2_names_jinja2_not_the_template(tmp_path, monkeypatch):
    import transformers.utils.chat_template_utils as ctu

    from mrl_jax.chat import ChatDependencyError, PromptFormat
    from mrl_jax.tokenization import train_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    train_tokenizer("byte_bpe", ["hello world"] * 20, 300).hf.save(str(folder / "tokenizer.json"))
    # a template no earlier test compiled (transformers caches compiled templates)
    tpl = "{# fresh-clone test #}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl}))
    assert PromptFormat.chat_from(folder).chat.render(["hi"]) == ["<hi>"]   # with jinja2
    monkeypatch.setattr(ctu, "is_jinja_available", lambda: False)           # the README's plain install, before
    fmt = PromptFormat.chat_from(folder)
    fmt.chat.template = tpl + "{# uncached #}"
    with pytest.raises(ChatDependencyError) as e:
        fmt.chat.render(["hi"])
    msg = str(e.value)
    assert "jinja2" in msg and "pip install" in msg and "fix the template" not in msg and "\n" not in msg


def test_jinja2_is_a_main_dependency():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("jinja2>=3.1.6") for d in deps)
