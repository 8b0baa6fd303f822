"""Experiment trackers (issue 16): ``report_to`` in the run config, TRL metric names under ``<policy>/``,
TensorBoard events with those names, W&B in offline mode (files under the run directory, no network)."""

import struct
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.configs import ConfigError  # noqa: E402
from mrl_jax.trainer.metrics import RunLog  # noqa: E402
from mrl_jax.trainer.trackers import tracker_name, tracker_scalars  # noqa: E402

ROUNDS = [{"a": {"reward/mean": 0.25, "reward/std": 0.1, "reward_std": 0.2, "kl": 0.01, "entropy": 2.5,
                 "clip_ratio/low_mean": 0.05, "completion/mean_length": 5.5, "completion/truncated": 0.5,
                 "reward/faulty/mean": 0.3, "sgt/rows_fired": 2.0, "frac_reward_zero_std": 0.75}},
          {"a": {"reward/mean": 0.5, "reward/std": 0.2, "reward_std": 0.3, "kl": 0.02, "entropy": 2.0, "clip_ratio/low_mean": 0.0,
                 "completion/mean_length": 6.0, "completion/truncated": 1.0, "frac_reward_zero_std": 0.25}}]
TRL = {"a/reward": "reward/mean", "a/reward_std": "reward_std", "a/kl": "kl", "a/entropy": "entropy",
       "a/clip_ratio/low_mean": "clip_ratio/low_mean", "a/completions/mean_length": "completion/mean_length",
       "a/completions/clipped_ratio": "completion/truncated", "a/frac_reward_zero_std": "frac_reward_zero_std"}


def test_trl_names_for_the_same_concepts_and_the_rest_unchanged():
    assert tracker_name("reward/mean") == "reward" and tracker_name("reward_std") == "reward_std"
    assert tracker_name("reward/std") == "reward/std"  # the batch-wide std is not TRL's reward_std
    assert tracker_name("completion/mean_length") == "completions/mean_length"
    assert tracker_name("reward/faulty/mean") == "rewards/faulty/mean"
    assert tracker_name("reward/success_rate") == "reward/success_rate"
    assert tracker_name("sgt/rows_fired") == "sgt/rows_fired"
    s = tracker_scalars(ROUNDS[0])
    assert s["a/reward"] == 0.25 and s["a/reward_std"] == 0.2 and s["a/reward/std"] == 0.1
    assert s["a/rewards/faulty/mean"] == 0.3 and s["a/sgt/rows_fired"] == 2.0
    assert "a/reward/mean" not in s


def test_report_to_is_validated_in_the_run_config():
    assert support.to_run_config(support.tiny_config()).report_to == ["tensorboard", "jsonl"]
    assert support.to_run_config(support.tiny_config(report_to=["wandb", "jsonl"])).report_to == ["wandb", "jsonl"]
    with pytest.raises(ConfigError, match="report_to.*'mlflow'"):
        support.to_run_config(support.tiny_config(report_to=["mlflow"]))
    with pytest.raises(ConfigError, match="report_to"):
        support.to_run_config(support.tiny_config(report_to="wandb"))  # a list, as in TRL


def test_wandb_without_its_client_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"report_to.*mrl-jax\[wandb\]"):
        RunLog(tmp_path, progress=False, report_to=["jsonl", "wandb"])


def test_report_to_none_writes_only_the_run_record(tmp_path):
    log = RunLog(tmp_path, progress=False, report_to=["none"])
    log.log_round(0, ROUNDS[0])
    log.close()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "wandb").exists()
    assert "reward/mean" in (tmp_path / "metrics.jsonl").read_text()  # internal names kept in the record


def _tfrecords(path: Path):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + n]
        pos += 12 + n + 4


def test_tensorboard_events_carry_trl_names(tmp_path):
    from tensorboardX.proto import event_pb2

    log = RunLog(tmp_path, progress=False, report_to=["tensorboard", "jsonl"])
    for r, m in enumerate(ROUNDS):
        log.log_round(r, m)
    log.close()
    tags = {}
    for f in (tmp_path / "tb").iterdir():
        for rec in _tfrecords(f):
            ev = event_pb2.Event.FromString(rec)
            for v in ev.summary.value:
                tags[(v.tag, ev.step)] = v.simple_value
    for name, key in TRL.items():
        assert tags[(name, 0)] == pytest.approx(ROUNDS[0]["a"][key]), name
    assert tags[("a/reward", 1)] == 0.5
    assert (tmp_path / "metrics.jsonl").is_file()


def _wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (.wandb): LevelDB log blocks after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, part, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            yield pb.Record.FromString(part + chunk)
            part = b""
        elif kind in (2, 3):
            part += chunk


def test_wandb_offline_writes_a_run_with_the_logged_keys(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    log = RunLog(tmp_path, progress=False, report_to=["wandb"], config={"rounds": 2, "seed": 0})
    for r, m in enumerate(ROUNDS):
        log.log_round(r, m)
        log.log_round(r, {"a/eval": {"success": 0.5 + r}})
    log.close()
    wandb.teardown()  # wait for W&B's service to finish writing the run's transaction log
    assert not (tmp_path / "tb").exists()  # report_to without tensorboard
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    files = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list((tmp_path / "wandb").iterdir())
    history, config = {}, {}
    for rec in _wandb_records(files[0]):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            assert rec.run.run_id == run_id
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
    assert sorted(history) == [0, 1]
    for step, m in enumerate(ROUNDS):
        for name, key in TRL.items():
            assert history[step][name] == pytest.approx(m["a"][key]), (step, name)
        assert history[step]["a/eval/success"] == 0.5 + step
    assert history[0]["a/reward/std"] == 0.1 and history[0]["a/sgt/rows_fired"] == 2.0
    assert config["rounds"] == 2 and config["seed"] == 0  # the run config
