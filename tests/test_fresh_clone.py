"""Every command README.md and experiments/*/README.md give runs, at its quick setting, in a clean clone with no
../shared beside it, installed as the README installs it (tests/installs.py: only what `pip install -e .`, or the
extra the doc names, brings). `QUICK` maps each documented command to what is run here; a command added to a doc
without an entry fails `test_every_documented_command_is_run_here`. `mrl bench probes --quick` runs this way in
tests/test_bench_probes.py; chat without jinja2 names jinja2, not the template."""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "experiments/bandit/README.md", "experiments/demo/README.md", "experiments/reasoning/README.md")
# the quick demo at 2 of its 20 rounds (its later rounds rerun round 1's programs; tests/test_demo.py runs the demo's
# every artefact at a tiny budget)
DEMO = "mrl demo --quick --rounds 2 --probes sgt --out runs/demo"
BANDIT = "mrl bandit --quick --out runs/bandit"
# run_analysis.py reads a YAML LabConfig: a two-probe, ten-step one here (quick.yaml's equality with `mrl bandit
# --quick`'s config is asserted in process: the same `lab.run`, no second run of it needed)
BANDIT_YAML = "python experiments/bandit/run_analysis.py --config runs/tiny_lab.yaml --out runs/bandit_yaml"
TINY_LAB = "probes: [none, sgt]\ngroup_sizes: [4]\nsigmas: [1.0]\nsteps: 10\nseeds: 2\nrecord_every: 5\n"
VARIANTS = "python experiments/bandit/variants.py --quick --out runs/variants"
FAMILY_MODELS = "python experiments/family_models.py runs/family_models"
# families.yaml at a smoke budget (tests/support.py FAMILIES_QUICK: 2 rounds of 2 prompts x 2, a checkpoint and an
# evaluation each; its equality with families.yaml in every other key is asserted below)
FAMILIES = "mrl train --config runs/families_quick.yaml --out runs/families"
REPORT = "mrl report runs/families --out runs/families_report"
REASONING = "python experiments/reasoning/run.py --out runs/reasoning --seeds 1 --quick --probes sgt"
REASONING_DS = "python experiments/reasoning/run.py --out runs/reasoning_ds --variant dataset --seeds 1 --quick --probes none"
SUITE = "the suite itself (.ci/run runs it)"
# documented command -> what runs here (a full budget becomes its quick setting; DIR a folder of the clone)
QUICK = {
    "mrl demo --out runs/demo": DEMO,
    "mrl demo --out experiments/demo": DEMO,
    "python -m pytest -q -n 2 --dist loadfile --durations=15": SUITE,
    "mrl report RUN --out DIR": REPORT,
    "mrl config-help": "mrl config-help",
    "python experiments/family_models.py runs/family_models": FAMILY_MODELS,
    "mrl train --config experiments/configs/families.yaml --out runs/families": FAMILIES,
    "mrl bandit --out DIR": BANDIT,
    "mrl bandit --quick --out DIR": BANDIT,
    "mrl bandit --out experiments/bandit/results": BANDIT,
    "python experiments/bandit/run_analysis.py --config experiments/bandit/full.yaml --out DIR": BANDIT_YAML,
    "python experiments/bandit/variants.py --out experiments/bandit/results/variants": VARIANTS,
    "pip install -e '.[reasoning]'": "the venv of REASONING",
    "python experiments/reasoning/run.py --out /tmp/reasoning": REASONING,
    "python experiments/reasoning/run.py --out /tmp/reasoning_ds --variant dataset": REASONING_DS,
    "python experiments/reasoning/run.py --out /tmp/smoke --seeds 1 --quick": REASONING,
    "python experiments/reasoning/run.py --out /tmp/dyn_exp/rg --seeds 3": REASONING,
}


def documented_commands(root: Path) -> list[tuple[str, str]]:
    """(doc, command) for each command line of the docs' code blocks (a usage line with ``[--flag]`` is a
    synopsis, not a command) and each inline ``python|mrl ... experiments/...`` command of their prose."""
    found = []
    for doc in DOCS:
        text = (root / doc).read_text()
        lines = [ln for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M) for ln in block.splitlines()]
        lines += re.findall(r"`((?:python|mrl) [^`]*experiments/[^`]*)`", text)
        for line in lines:
            cmd = re.sub(r"^.*&& \.venv/bin/", "", re.split(r"\s{2,}", line.strip())[0])
            if re.match(r"(python3?|mrl|pip) ", cmd) and "[--" not in line:
                found.append((doc, cmd))
    return found


def _ok(fresh_clone, command: str, extras: tuple[str, ...] = ()):
    proc = fresh_clone.run(command, extras=extras)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    return proc


def test_every_documented_command_is_run_here():
    found = documented_commands(REPO)
    assert {doc for doc, _ in found} == set(DOCS)
    missing = [f"{doc}: {cmd}" for doc, cmd in found if cmd not in QUICK]
    assert not missing, "documented commands with no quick form in tests/test_fresh_clone.py QUICK: " + str(missing)
    source = Path(__file__).read_text()
    for run in set(QUICK.values()) - {SUITE, "the venv of REASONING", "mrl config-help"}:
        name = next(k for k, v in globals().items() if v == run and k.isupper())
        assert f"_ok(fresh_clone, {name}" in source, name   # a test below runs it


def test_the_clone_is_clean_and_its_install_is_the_readmes(fresh_clone):
    assert (fresh_clone.root / "pyproject.toml").is_file() and not (fresh_clone.root.parent / "shared").exists()
    assert not (fresh_clone.root / ".venv").exists()
    probe = ("import importlib.util as u, mrl_jax; print(mrl_jax.__file__); "
             "print([m for m in ('torch', 'pytest', 'reasoning_gym', 'hypothesis', 'peft') if u.find_spec(m)])")
    out = _ok(fresh_clone, f'python -c "{probe}"').stdout.splitlines()
    assert out == [str(fresh_clone.root / "mrl_jax" / "__init__.py"), "[]"]
    assert "policies[i].name" in _ok(fresh_clone, "mrl config-help").stdout


def test_demo_quick(fresh_clone):
    _ok(fresh_clone, DEMO)
    run = fresh_clone.root / "runs" / "demo"
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["probes"]) == {"sgt"}
    assert {len(pol["reward_curve"]) for pol in summary["probes"]["sgt"].values()} == {2}
    for name in ("summary.md", "success.png", "curves.png"):
        assert (run / name).stat().st_size > 0


def test_family_models_then_the_families_run_and_its_report(fresh_clone):
    """The Phi-3-style tokenizer is trained when no ../shared is there (with Phi-3's control tokens and chat
    template); `prompt_format: chat` renders with jinja2, a main dependency."""
    from mrl_jax.tokenization.chat import PromptFormat
    from mrl_jax.tokenization import load_tokenizer

    _ok(fresh_clone, FAMILY_MODELS)
    models = fresh_clone.root / "runs" / "family_models"
    for name in ("qwen3", "gemma3", "phi3"):
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (models / name / f).is_file(), (name, f)
    phi3 = models / "phi3"
    tok = load_tokenizer(phi3)
    gen = json.loads((phi3 / "generation_config.json").read_text())
    assert tok.hf.token_to_id("<|end|>") in gen["eos_token_id"]
    assert json.loads((phi3 / "config.json").read_text())["vocab_size"] == tok.vocab_size
    fmt = PromptFormat.chat_from(phi3)
    assert fmt.chat.render(["2+3="]) == ["<|user|>\n2+3=<|end|>\n<|assistant|>\n"]
    assert fmt.chat.end_of_turn() == "<|end|>"

    import yaml

    import support
    from mrl_jax.configs import load_yaml, to_dict
    from mrl_jax.trainer.config import RunConfig

    written = fresh_clone.root / "experiments" / "configs" / "families.yaml"
    quick_yaml = fresh_clone.root / "runs" / "families_quick.yaml"
    quick_yaml.write_text(yaml.safe_dump(support.families_quick(yaml.safe_load(written.read_text()))))
    full, quick = to_dict(load_yaml(RunConfig, written)), to_dict(load_yaml(RunConfig, quick_yaml))
    assert {k for k in full if quick[k] != full[k]} == set(support.FAMILIES_QUICK) | {"policies"}
    assert [p["sampling"].pop("max_new_tokens") for p in quick["policies"]] == [support.FAMILIES_QUICK_TOKENS] * 3
    assert [p["sampling"].pop("max_new_tokens") for p in full["policies"]] == [8] * 3
    assert quick["policies"] == full["policies"]
    _ok(fresh_clone, FAMILIES)
    summary = json.loads((fresh_clone.root / "runs" / "families" / "summary.json").read_text())
    assert set(summary["policies"]) == {"qwen3", "gemma3", "phi3"}
    assert sorted(int(p.name) for p in (fresh_clone.root / "runs" / "families" / "checkpoints").iterdir()) == [0, 1]
    _ok(fresh_clone, REPORT)
    assert (fresh_clone.root / "runs" / "families_report" / "summary.md").is_file()


def test_bandit_commands(fresh_clone):
    from mrl_jax.bandit import lab

    _ok(fresh_clone, BANDIT)
    assert set(json.loads((fresh_clone.root / "runs" / "bandit" / "summary.json").read_text())["probes"]) == set(
        lab.default_config(quick=True).probes)
    assert lab.load_config(str(REPO / "experiments/bandit/quick.yaml")) == lab.default_config(quick=True)
    (fresh_clone.root / "runs" / "tiny_lab.yaml").write_text(TINY_LAB)
    _ok(fresh_clone, BANDIT_YAML)
    summary = json.loads((fresh_clone.root / "runs" / "bandit_yaml" / "summary.json").read_text())
    assert set(summary["probes"]) == {"none", "sgt"} and summary["settings"]["config"]["steps"] == 10
    _ok(fresh_clone, VARIANTS)
    table = (fresh_clone.root / "runs" / "variants" / "variants.md").read_text()
    for variant in ("no_truncation", "high_lr", "shared_params", "extra_probes"):
        assert f"| {variant} |" in table


def test_reasoning_commands(fresh_clone):
    """The reasoning-gym variant needs the extra its README installs: without it one line names the install."""
    proc = fresh_clone.run(REASONING)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and "\n" not in err and "pip install -e '.[reasoning]'" in err, err
    _ok(fresh_clone, REASONING, extras=("reasoning",))
    _ok(fresh_clone, REASONING_DS)
    for out, runs in (("reasoning", ("rg_sgt_s0",)), ("reasoning_ds", ("dataset_none_s0",))):
        results = json.loads((fresh_clone.root / "runs" / out / "results.json").read_text())
        assert sorted(f"{r['variant']}_{r['probes']}_s{r['seed']}" for r in results) == sorted(runs)


def test_chat_without_jinja2_names_jinja2_not_the_template(tmp_path, monkeypatch):
    import transformers.utils.chat_template_utils as ctu

    from mrl_jax.tokenization.chat import ChatDependencyError, PromptFormat
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
