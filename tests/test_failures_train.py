"""Issue 60: ``mrl train``'s own start and stop lines. Each bad input or fault is one line on stderr with its exit
code (2: refused at start, whatever the exception type user code or a library raised; 3: a run stopped; 130:
interrupted) and no traceback; a clean start says nothing from absl, orbax or tensorboardX."""

import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def _set(**overrides):
    def edit(cfg, tmp):
        cfg.update(support.tiny_config(**overrides))   # every override at once (dotted keys: into one policy)
    return edit


def _task(**task):
    return _set(task=task)


def _bench_probes(spec):
    def edit(cfg, tmp):
        return ["bench", "probes", "--quick", "--probes", spec, "--out", str(tmp / "bench")]
    return edit


RG = "reasoning_gym"
# (case, edit(config dict, tmp dir) -> argv or None (train --config --out), exit code, the line; {cfg}: the config)
START = [
    ("probe_factory_raises", _set(**{"policies.0.probes": "tests.probe_fixtures:raises_at_build"}), 2,
     "mrl train: config error: {cfg}: config key 'policies[0].probes': 'tests.probe_fixtures:raises_at_build': probe "
     "'tests.probe_fixtures:raises_at_build': the "
     "factory tests.probe_fixtures:raises_at_build raised RuntimeError: no GPU for this probe; fix the factory or "
     "its options"),
    ("bench_probe_factory_raises", _bench_probes("tests.probe_fixtures:raises_at_build"), 2,
     "mrl bench: config error: --probes: probe 'tests.probe_fixtures:raises_at_build': the factory "
     "tests.probe_fixtures:raises_at_build raised RuntimeError: no GPU for this probe; fix the factory or its options"),
    ("reasoning_gym_weight_zero", _task(name=RG, datasets={"chain_sum": 0}), 2,
     "mrl train: config error: config key 'task.datasets.chain_sum': weight 0 is not a number > 0 (the dataset's "
     "share of the prompts); give e.g. chain_sum: 1.0, or drop 'chain_sum'"),
    ("reasoning_gym_weight_negative", _task(name=RG, datasets={"chain_sum": -1}), 2,
     "mrl train: config error: config key 'task.datasets.chain_sum': weight -1 is not a number > 0 (the dataset's "
     "share of the prompts); give e.g. chain_sum: 1.0, or drop 'chain_sum'"),
    ("reasoning_gym_weight_string", _task(name=RG, datasets={"chain_sum": "heavy"}), 2,
     "mrl train: config error: config key 'task.datasets.chain_sum': weight 'heavy' is not a number > 0 (the "
     "dataset's share of the prompts); give e.g. chain_sum: 1.0, or drop 'chain_sum'"),
    ("reward_module_raises_on_import", _set(rewards=[{"builtin": "accuracy"},
                                                     {"function": "tests.probe_fixtures_broken:score"}]), 2,
     "mrl train: config error: {cfg}: config key 'rewards[1].function': cannot import 'tests.probe_fixtures_broken' "
     "(RuntimeError: this module is broken on import); put it on PYTHONPATH or install it"),
    ("ladder_ratio_without_the_ladder", _set(**{"policies.0.sampling.ladder": False,
                                                "policies.0.sampling.ladder_ratio": 0.5}), 2,
     "mrl train: config error: {cfg}: config key 'policies[0].sampling.ladder_ratio': 0.5 shapes the ladder, which "
     "ladder: false turns off (S slots to the end); drop ladder_ratio, or drop ladder: false"),
    ("ladder_floor_without_the_ladder", _set(**{"policies.0.sampling.ladder": False,
                                                "policies.0.sampling.ladder_floor": 2}), 2,
     "mrl train: config error: {cfg}: config key 'policies[0].sampling.ladder_floor': 2 shapes the ladder, which "
     "ladder: false turns off (S slots to the end); drop ladder_floor, or drop ladder: false"),
    ("ladder_floor_above_slots", _set(**{"policies.0.sampling.slots": 8, "policies.0.sampling.ladder_floor": 12}), 2,
     "mrl train: config error: {cfg}: config key 'policies[0].sampling.ladder_floor': 12 is not below slots: 8, so "
     "the ladder has no rung below S; give a ladder_floor below 8, or set ladder: false"),
    ("reward_batch_size_zero", _set(rewards=[{"builtin": "accuracy"},
                                             {"function": "tests.reward_fixtures:length_bonus", "batch_size": 0}]), 2,
     "mrl train: config error: {cfg}: config key 'rewards[1].batch_size': 0 is not a whole number >= 1; give batch_size: "
     "1 to call the function per completion, or leave it out for the batch"),
]


@pytest.mark.parametrize("case, edit, code, line", START, ids=[c[0] for c in START])
def test_a_start_time_failure_is_one_line_with_exit_2(tmp_path, capsys, case, edit, code, line):
    cfg = support.tiny_config()
    argv = edit(cfg, tmp_path) or ["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "run")]
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert (rc, err) == (code, line.format(cfg=tmp_path / "cfg.yaml"))


# ------------------------------------------------------------------------------------------ Ctrl-C
def test_a_second_ctrl_c_inside_a_checkpoint_write_abandons_it_cleanly(tmp_path, capsys, monkeypatch):
    """Ctrl-C twice while round 1's checkpoint is written, a writer thread of the save still filling its temporary
    folder (as orbax's commit threads do): the interrupted line, exit 130, no traceback, no temporary folder."""
    import os
    import signal
    import threading
    import time

    from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch

    original = cch.CompositeCheckpointHandler.save

    def late_write(directory: Path):
        time.sleep(0.5)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "late").write_text("a write still in flight")

    def save(self, directory, *args, **kwargs):
        if Path(str(directory)).name.split(".")[0] != "1":
            return original(self, directory, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)   # held: the write goes on
        original(self, directory, *args, **kwargs)
        threading.Thread(target=late_write, args=(Path(str(directory)),)).start()
        os.kill(os.getpid(), signal.SIGINT)   # again: abandoned here, before orbax renames the folder

    monkeypatch.setattr(cch.CompositeCheckpointHandler, "save", save)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        out = tmp_path / "run"
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(yaml.safe_dump(support.tiny_config(rounds=3)))
        argv = ["train", "--config", str(cfg), "--out", str(out)]
        rc = main(argv)
    finally:
        signal.signal(signal.SIGINT, previous)
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[train]")]
    assert rc == 130 and err == [
        "mrl: finishing the checkpoint of round 1; Ctrl-C again abandons it",
        f"mrl train: interrupted in round 1; the checkpoint of round 0 in {out / 'checkpoints'} is intact (later "
        "rounds are redone); resume with: mrl " + " ".join(argv + ["--resume"])], err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0"]


# ---------------------------------------------------------------------------------------- NaN stop
def test_a_probe_whose_loss_is_nan_stops_naming_the_probe(tmp_path, capsys):
    """The first skipped update is one line; the stop (exit 3) names the probe whose loss term went non-finite;
    no tensorboardX warning about the NaN scalars."""
    probe = "tests.probe_fixtures:nan_loss"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(support.tiny_config(rounds=3, max_skipped_updates=2,
                                                      **{"policies.0.probes": probe})))
    out = tmp_path / "run"
    rc = main(["train", "--config", str(cfg), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[train]")]
    cause = f"the loss terms of probe {probe!r} are non-finite (loss nan, pg_loss "
    assert rc == 3 and len(err) == 2 and "Traceback" not in "\n".join(err), err
    assert err[0].startswith(f"mrl train: round 0: policy 'llama_bpe' skipped its update: {cause}"), err
    assert err[0].endswith("finite): fix the probe's loss_terms or its options; the run stops after 2 in a row "
                           "(max_skipped_updates)"), err
    assert err[1].startswith(f"mrl train: run stopped: policies ['llama_bpe'] skipped 2 updates in a row (llama_bpe: "
                             f"{cause}"), err
    assert f"state saved at round 1 in {out / 'checkpoints'}" in err[1] and err[1].endswith("Fix it, then --resume.")
    assert (out / "failed_batch_llama_bpe_round1.npz").is_file()


# ------------------------------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-round run of the tiny config through the CLI."""
    root = tmp_path_factory.mktemp("finished")
    (root / "cfg.yaml").write_text(yaml.safe_dump(support.tiny_config(rounds=1)))
    assert main(["train", "--config", str(root / "cfg.yaml"), "--out", str(root / "run")]) == 0
    return root / "run"


def _copy(finished: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _resume(tmp_path, out, **overrides) -> tuple[int, list[str]]:
    cfg = tmp_path / "resume.yaml"
    cfg.write_text(yaml.safe_dump(support.tiny_config(**overrides)))
    return main(["train", "--config", str(cfg), "--out", str(out), "--resume"])


def test_a_corrupt_checkpoint_metadata_file_resumes_without_absl_lines(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    capsys.readouterr()
    (out / "checkpoints" / "0" / "_CHECKPOINT_METADATA").write_text("garbage\n")
    rc = _resume(tmp_path, out, rounds=2)
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[train]")]
    assert rc == 0 and err == [f"mrl train: warning: resuming {out} with a config that differs from the one it "
                               "started with (config.json) in rounds: 1 -> 2"], err


def test_a_resume_with_another_model_family_is_one_short_line(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    capsys.readouterr()
    model = {"family": "gpt2", "hidden_size": 32, "num_layers": 1, "num_heads": 2}
    rc = _resume(tmp_path, out, **{"policies.0.model": model})
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err[-1].replace(str(out), "RUN")) < 450 and "Traceback" not in "\n".join(err), err
    assert err[-1].startswith(f"mrl train: checkpoint {out / 'checkpoints' / '0'} does not match this run's config ("), err
    assert "of this run's arrays are not in it (first " in err[-1], err


def test_a_clean_start_says_nothing_from_absl_orbax_or_tensorboardx(tmp_path):
    """A real ``mrl train`` process: stderr holds the progress lines only."""
    import os
    import subprocess

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(support.tiny_config(rounds=1)))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "mrl_jax.cli", "train", "--config", str(cfg), "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
    other = [line for line in proc.stderr.splitlines() if not line.startswith("[train]")]
    assert other == [], other
