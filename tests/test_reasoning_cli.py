"""End to end: `mrl train` on a local parquet file with a user reward function and sampled evaluation,
then `mrl eval --samples`; a reward path that does not import is a one-line config error."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("datasets")
pytest.importorskip("math_verify")
import datasets  # noqa: E402

from mrl_jax import cli  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "tiny_two_policy.yaml"


def _config(tmp_path: Path, **over) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a % 3} for a in range(5) for b in range(4)]
    data = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    cfg = yaml.safe_load(TINY.read_text())
    cfg.update(rounds=2, eval_every=1, eval_prompts=5, eval_samples=2, checkpoint_every=2,
               task={"name": "dataset", "path": str(data), "eval_fraction": 0.3},
               rewards=[{"builtin": "accuracy"}, {"function": "tests.reward_fixtures:length_bonus", "weight": 2.0}])
    cfg.update(over)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_train_and_eval_report_pass_at_k_and_population(tmp_path, capsys):
    config, out = _config(tmp_path), tmp_path / "out"
    assert cli.main(["train", "--config", str(config), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    pop = summary["population"]
    assert set(summary["before"]["population"]) == set(pop) and "pass@2" in summary["before"]["llama_bpe"]
    assert set(pop) >= {"pass@1", "pass@2", "transfer", "policies"} and len(pop["transfer"]) == 2
    for name in ("llama_bpe", "gpt2_uni"):
        ev = summary["policies"][name]["eval"]
        assert {"success", "avg@2", "pass@1", "pass@2", "maj@2"} <= set(ev)
        assert ev["pass@1"] <= ev["pass@2"] <= 1.0 and pop["pass@2"] >= ev["pass@2"] - 1e-9
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["policy"] == "population/eval" and "pass@2" in r for r in records)
    rounds = [r for r in records if r["policy"] == "llama_bpe"]
    assert rounds and all("rewards/length_bonus/mean" in r and "rewards/accuracy/std" in r for r in rounds)
    # 2.0 x 0.1 per token lifts most wrong answers over tau = 1: success must still be the verifier's
    assert any(r["reward/mean"] >= 1.0 for r in rounds)
    assert all(r["reward/success_rate"] == pytest.approx(r["rewards/accuracy/mean"]) for r in rounds)
    assert cli.main(["eval", "--config", str(config), "--run", str(out), "--out", str(tmp_path / "ev"),
                     "--samples", "4", "--temperature", "0.7"]) == 0
    res = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert "pass@4" in res["population"] and "maj@4" in res["eval"]["gpt2_uni"]


def test_unresolvable_reward_is_a_config_error(tmp_path, capsys):
    config = _config(tmp_path, rewards=[{"function": "tests.no_such_module:fn"}])
    capsys.readouterr()
    assert cli.main(["train", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rewards[0].function" in err and "no_such_module" in err, err


def test_experiment_config_loads_and_builds_its_task():
    pytest.importorskip("reasoning_gym")
    from mrl_jax.configs import load_yaml
    from mrl_jax.trainer.config import RunConfig
    from mrl_jax.trainer.run import build_task

    cfg = load_yaml(RunConfig, Path(__file__).resolve().parents[1] / "experiments" / "reasoning" / "rg_mixture.yaml")
    assert len(cfg.policies) == 3 and cfg.eval_samples == 8
    task = build_task(cfg)
    assert len(task.train_prompts()) == cfg.task.size and task.eval_prompts()


def test_reasoning_gym_task_without_its_extra_is_one_line_naming_the_install(monkeypatch):
    """`pip install -e .` does not bring reasoning-gym (the `reasoning` extra does): the config says so when it
    is read, before any work (it was a ModuleNotFoundError traceback from inside the run)."""
    import importlib.util

    from mrl_jax.configs import ConfigError
    from mrl_jax.trainer import task_spec

    real = importlib.util.find_spec
    monkeypatch.setattr(task_spec.importlib.util, "find_spec",
                        lambda name, *a: None if name == "reasoning_gym" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        task_spec.TaskSpec(name="reasoning_gym", datasets={"chain_sum": 1.0})
    msg = str(e.value)
    assert "task.name" in msg and "pip install -e '.[reasoning]'" in msg and "\n" not in msg
    task_spec.TaskSpec(name="mixture")   # other tasks do not need it
