"""One-line messages (exit 2) for mistakes a new user makes, and the figures a run must show."""

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.cli import main  # noqa: E402
from mrl_jax.configs import ConfigError  # noqa: E402


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def _config(tmp_path, **overrides) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(support.tiny_config(**overrides)))
    return path


def test_missing_jsonl_names_task_path(tmp_path, capsys):
    cfg = _config(tmp_path, task={"name": "jsonl", "path": str(tmp_path / "nope.jsonl")})
    rc, err = _cli(capsys, "train", "--config", str(cfg), "--out", str(tmp_path / "run"))
    assert rc == 2 and "\n" not in err and "config key 'task.path'" in err and "nope.jsonl" in err


def test_model_path_that_is_a_file_says_so(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 16)
    cfg = _config(tmp_path, **{"policies.0.model": {"path": str(weights)}})
    rc, err = _cli(capsys, "train", "--config", str(cfg), "--out", str(tmp_path / "run"))
    assert rc == 2 and "\n" not in err
    assert "'policies.llama_bpe.model.path'" in err and "is a file" in err and "config.json" in err.split("give")[1]


def test_eval_of_a_missing_run_says_there_is_no_run(tmp_path, capsys):
    cfg = _config(tmp_path)
    missing = tmp_path / "no_such_run"
    rc, err = _cli(capsys, "eval", "--config", str(cfg), "--run", str(missing), "--out", str(tmp_path / "ev"))
    assert rc == 2 and "\n" not in err and "holds no run" in err and "--resume" not in err
    assert not missing.exists()   # nothing created where the user mistyped
    (tmp_path / "started" / "checkpoints").mkdir(parents=True)   # a run before its first checkpoint
    rc, err = _cli(capsys, "eval", "--config", str(cfg), "--run", str(tmp_path / "started"), "--out",
                   str(tmp_path / "ev"))
    assert rc == 2 and "no complete checkpoint yet" in err and "--resume" not in err


def test_wandb_without_a_login_is_one_line_naming_offline_mode(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from mrl_jax.trainer.metrics import RunLog

    def no_login(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\nmore")

    monkeypatch.setattr(wandb, "init", no_login)
    with pytest.raises(ConfigError) as e:
        RunLog(tmp_path, progress=False, report_to=["jsonl", "wandb"])
    msg = str(e.value)
    assert "\n" not in msg and "WANDB_MODE=offline" in msg and "api_key not configured" in msg


@pytest.mark.usefixtures("jax_compile_cache")
def test_warm_start_loss_in_progress_and_summary(tmp_path, capsys):
    from mrl_jax.trainer import train

    cfg = support.to_run_config(support.tiny_config(rounds=1, **{"policies.0.warm_start": {"steps": 3, "batch_size": 8}}))
    summary = train(cfg, tmp_path / "run", reward_specs=support.reward_specs({"faulty": {"seed": 0, "p": {}}}))
    ws = summary["policies"]["llama_bpe"]["warm_start"]
    assert ws["steps"] == 3 and ws["loss_min"] <= min(ws["loss_first"], ws["loss_last"]) and ws["loss_first"] > 0
    assert "warm_start" not in summary["policies"]["gpt2_uni"]   # no warm start configured
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["policies"]["llama_bpe"]["warm_start"] == ws
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[warm start]")]
    assert lines == [f"[warm start] llama_bpe: 3 SFT steps, loss {ws['loss_first']:.4f} -> {ws['loss_last']:.4f} "
                     f"(lowest {ws['loss_min']:.4f})"]
