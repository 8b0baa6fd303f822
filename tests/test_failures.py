"""Issue 37: two runs never share a directory, held-out data is held out, no wait or failure is silent.

The run lock (two real processes), ``before`` kept across resumes, a resume of a finished run that changes
nothing, and a table of bad inputs: each one line on stderr naming its key, exit 2, refused before any XLA
compile (so the table runs in seconds).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import soak  # noqa: E402
from mrl_jax.cli import main  # noqa: E402
from mrl_jax.compile_stats import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

HOLD_LOCK = ("import sys, time\n"
             "from mrl_jax.trainer.run_lock import run_lock\n"
             "with run_lock(sys.argv[1]):\n"
             "    print('held', flush=True)\n"
             "    time.sleep(120)\n")


def _config(tmp_path, name="cfg.yaml", **overrides) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(soak.tiny_config(**overrides)))
    return path


def _cli(capsys, *argv) -> tuple[int, str]:
    with CompileCounter() as compiles:
        rc = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return rc, err, compiles.programs


def _files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ run lock
def test_second_process_on_a_locked_run_directory_exits_2_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True,
                             env=env, cwd=REPO)
    try:
        assert child.stdout.readline().strip() == "held"
        for extra in ([], ["--resume"]):
            rc, err, programs = _cli(capsys, "train", "--config", _config(tmp_path), "--out", out, *extra)
            assert rc == 2 and "\n" not in err and f"PID {child.pid}" in err and str(out / ".lock") in err, err
            assert programs == 0   # refused before any work
        assert not (out / "config.json").exists()
    finally:
        child.kill()
        child.wait()
    from mrl_jax.trainer.run_lock import run_lock

    with run_lock(out) as path:   # the kernel dropped the dead holder's lock
        assert path.read_text().strip() == str(os.getpid())
    assert path.read_text() == ""   # emptied on release


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    target = tmp_path / "f.txt"
    target.write_text("x")
    rc, err, programs = _cli(capsys, "train", "--config", _config(tmp_path), "--out", target)
    assert rc == 2 and "\n" not in err and "--out" in err and "is a file" in err and programs == 0


# --------------------------------------------------------------------------------- before, resume
def test_before_survives_resume_and_a_finished_run_is_left_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    first = _config(tmp_path, "one.yaml", rounds=1, eval_samples=2, eval_prompts=4)
    assert main(["train", "--config", str(first), "--out", str(out)]) == 0
    before = json.loads((out / "before.json").read_text())
    assert json.loads((out / "summary.json").read_text())["before"] == before
    assert set(before) >= {"llama_bpe", "gpt2_uni"} and "pass@1" in json.dumps(before)
    snapshot = _files(out)
    capsys.readouterr()
    rc, err, programs = _cli(capsys, "train", "--config", first, "--out", out, "--resume")
    assert rc == 0 and "is complete" in err and programs == 0
    assert _files(out) == snapshot   # a resume of a finished run changes nothing
    # one more round (as after a kill following checkpoint 0): the summary keeps the starting state's figures
    more = _config(tmp_path, "two.yaml", rounds=2, eval_samples=2, eval_prompts=4)
    rc, err, _ = _cli(capsys, "train", "--config", more, "--out", out, "--resume")
    assert rc == 0 and "rounds: 1 -> 2" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"] == before and summary["resumed_from"] == 0 and summary["rounds"] == 2
