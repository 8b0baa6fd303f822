"""Issue 60: the verbs beside ``train`` keep a run directory whole, and their start-time failures are one line.

``mrl eval`` and ``mrl plan`` pointed at a run write into ``RUN/eval/`` and ``RUN/plan/`` (every file of the run
byte-identical after); ``eval`` reads under the run's lock held shared. A table of failures: each row the command,
its exit code and the one stderr line expected, no traceback. Rows that load libtpu (a topology it refuses) run
in a child process: libtpu is never loaded in the pytest worker (tests/test_tpu_compile.py).
"""

import hashlib
import json
import os
import shutil
import subprocess
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

HOLD_LOCK = ("import sys, time\n"
             "from mrl_jax.trainer.run_lock import read_lock, run_lock\n"
             "with (read_lock if sys.argv[2] == 'shared' else run_lock)(sys.argv[1]):\n"
             "    print('held', flush=True)\n"
             "    time.sleep(300)\n")
ONE_ROUND = dict(rounds=1, eval_samples=2, eval_prompts=4)
LIBTPU_REFUSES = ("libtpu cannot lay out TPU topology 'v5e:3x7' (JaxRuntimeError: INVALID_ARGUMENT: Topology layout "
                  "\"v5e:3x7\" is not divisible by the given (or default) chips_per_host_bounds \"2x2x1\"); use a "
                  "slice name such as v5e-8 or v5p-16, or a topology string whose first two sides are even (a host "
                  "holds 2x2 chips), such as v5e:2x4 or v5p:2x2x1")


def _config(root: Path, name: str = "cfg.yaml", **overrides) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(support.tiny_config(**overrides)))
    return path


def _hashes(root: Path) -> dict:
    """Every file under ``root`` (hidden ones included) -> its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-round run of the tiny config through the CLI, and its config."""
    root = tmp_path_factory.mktemp("finished")
    cfg = _config(root, "one.yaml", **ONE_ROUND)
    assert main(["train", "--config", str(cfg), "--out", str(root / "run")]) == 0
    return root / "run", cfg


@pytest.fixture
def run_copy(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    return out


class Holders:
    """Child processes holding a directory's run lock (exclusive as ``train`` does, or shared as ``eval`` does)."""

    def __init__(self):
        self.children = []

    def hold(self, directory: Path, mode: str = "exclusive") -> int:
        child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory), mode], stdout=subprocess.PIPE,
                                 text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
        self.children.append(child)
        assert child.stdout.readline().strip() == "held"
        return child.pid

    def release(self):
        for child in self.children:
            child.kill()
            child.wait()


@pytest.fixture
def holders():
    h = Holders()
    yield h
    h.release()


# ------------------------------------------------------------------------ a run directory kept whole
def test_eval_of_a_run_writes_beside_it_and_changes_none_of_its_files(finished, run_copy, capsys):
    before = _hashes(run_copy)
    summary = json.loads((run_copy / "summary.json").read_text())
    assert main(["eval", "--config", str(finished[1]), "--out", str(run_copy)]) == 0   # --run defaults to --out
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {run_copy / 'eval' / 'summary.json'}"
    after = _hashes(run_copy)
    assert {k: v for k, v in after.items() if k != "eval/summary.json"} == before
    assert set(after) - set(before) == {"eval/summary.json"}
    ev = json.loads((run_copy / "eval" / "summary.json").read_text())
    assert ev["round"] == 0 and set(ev["eval"]) == set(summary["policies"])
    # a second eval replaces its own summary, still none of the run's
    assert main(["eval", "--config", str(finished[1]), "--out", str(run_copy), "--samples", "0"]) == 0
    assert {k: v for k, v in _hashes(run_copy).items() if k != "eval/summary.json"} == before


class _Report:
    """What `plan_for_topology` returns, as `_plan` uses it (the XLA:TPU compile is tests/test_tpu_compile.py's)."""

    fits = True

    def __str__(self):
        return "TPU plan on v5e-8\nverdict: fits"

    def to_dict(self):
        return {"topology": {"name": "v5e-8"}, "fits": True}


def test_plan_into_a_run_writes_beside_it_and_changes_none_of_its_files(finished, run_copy, monkeypatch, capsys):
    from mrl_jax.trainer import tpu_plan

    monkeypatch.setattr(tpu_plan, "plan_for_topology", lambda cfg, name, **_: _Report())
    before = _hashes(run_copy)
    assert main(["plan", "--config", str(finished[1]), "--topology", "v5e-8", "--out", str(run_copy)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {run_copy / 'plan' / 'summary.json'}"
    after = _hashes(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("plan/")} == before
    assert set(after) - set(before) == {"plan/summary.json", "plan/plan.txt"}
    assert (run_copy / "plan" / "plan.txt").read_text() == str(_Report()) + "\n"
    assert json.loads((run_copy / "plan" / "summary.json").read_text()) == _Report().to_dict()
    # a directory that holds no run is written as before
    fresh = run_copy.parent / "plan_only"
    assert main(["plan", "--config", str(finished[1]), "--topology", "v5e-8", "--out", str(fresh)]) == 0
    assert sorted(p.name for p in fresh.iterdir()) == ["plan.txt", "summary.json"]


def test_a_report_into_another_run_writes_beside_it(finished, run_copy, capsys):
    before = _hashes(run_copy)
    assert main(["report", str(finished[0]), "--out", str(run_copy)]) == 0
    after = _hashes(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("report/")} == before
    assert {"report/summary.json", "report/summary.md", "report/report.json"} <= set(after) - set(before)


def test_an_eval_reading_a_run_refuses_a_train_there_and_changes_nothing(finished, run_copy, holders, capsys):
    before = _hashes(run_copy)
    holders.hold(run_copy, "shared")
    holders.hold(run_copy, "shared")   # several readers at once
    rc = main(["train", "--config", str(_config(run_copy.parent, "two.yaml", **dict(ONE_ROUND, rounds=2))),
               "--out", str(run_copy), "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"mrl train: {run_copy} is being read: an `mrl eval` or `mrl export` holds "
                               f"{run_copy / '.lock'} shared while it restores a checkpoint; wait for it to "
                               "finish, then resume"), err
    assert _hashes(run_copy) == before


# ---------------------------------------------------------------------------------- Ctrl-C, exit 130
def test_an_interrupted_run_prints_no_closing_line_of_a_finished_one(finished, run_copy, monkeypatch, capsys):
    from mrl_jax.trainer import loop

    original = loop.run_round

    def interrupted_in_round_1(policies, state, inputs, *args, **kwargs):
        if inputs.index == 1:
            raise KeyboardInterrupt
        return original(policies, state, inputs, *args, **kwargs)

    monkeypatch.setattr(loop, "run_round", interrupted_in_round_1)
    argv = ["train", "--config", str(_config(run_copy.parent, "three.yaml", **dict(ONE_ROUND, rounds=3))),
            "--out", str(run_copy), "--resume"]
    assert main(argv) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1] == (f"mrl train: interrupted in round 1; the checkpoint of round 0 in {run_copy / 'checkpoints'} "
                         "is intact (later rounds are redone); resume with: mrl " + " ".join(argv)), lines
    assert not [line for line in lines if "rounds logged" in line], lines


# ------------------------------------------------------------------------------- table of failures
def _names() -> str:
    from mrl_jax.mwra.tpu import known_names

    return ", ".join(known_names())


def _train(*flags, cfg="cfg.yaml"):
    return lambda tmp, holders, finished: ["train", "--config", str(tmp / cfg), "--out", str(tmp / "run"), *flags]


def _plan(topology):
    return lambda tmp, holders, finished: ["plan", "--config", str(tmp / "cfg.yaml"), "--topology", topology]


def _held(verb, *flags, mode="exclusive"):
    """``verb`` on a run directory whose lock a child process holds (``{pid}`` in the line: its PID)."""
    def setup(tmp, holders, finished):
        (tmp / "run" / "checkpoints").mkdir(parents=True)
        holders.pid = holders.hold(tmp / "run", mode)
        return [verb, "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "run"), *flags]
    return setup


def _eval_beside_a_file(tmp, holders, finished):
    shutil.copytree(finished[0], tmp / "run")
    (tmp / "run" / "eval").write_text("x")
    return ["eval", "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "run")]


def _export_into_another_run(tmp, holders, finished):
    (tmp / "other" / "checkpoints").mkdir(parents=True)
    return ["export", "--run", str(finished[0]), "--policy", "llama_bpe", "--out", str(tmp / "other"), "--force"]


UNKNOWN = ("unknown TPU topology 'v9z-8'; use a slice name ({names}) or a topology string such as v5e:2x4 or "
           "v5p:2x2x1")
BUSY = "{run} is in use: another `mrl train` (PID {pid}) holds {run}/.lock and is writing its run there; "
# (case, setup(tmp, holders, finished) -> argv, config overrides, in a child process, exit code, the stderr line)
CASES = [
    ("plan_topology_libtpu_refuses", _plan("v5e:3x7"), {}, True, 2,
     f"mrl plan: config error: --topology: {LIBTPU_REFUSES}"),
    ("train_topology_flag_libtpu_refuses", _train("--topology", "v5e:3x7"), {}, True, 2,
     f"mrl train: config error: --topology: {LIBTPU_REFUSES}"),
    ("config_topology_libtpu_refuses", _train(), {"mwra.topology": "v5e:3x7"}, True, 2,
     f"mrl train: config error: config key 'mwra.topology': {LIBTPU_REFUSES}"),
    ("train_topology_flag_unknown", _train("--topology", "v9z-8"), {}, False, 2,
     f"mrl train: config error: --topology: {UNKNOWN}"),
    ("config_topology_unknown", _train(), {"mwra.topology": "v9z-8"}, False, 2,
     f"mrl train: config error: {{tmp}}/cfg.yaml: config key 'mwra.topology': {UNKNOWN}"),
    ("plan_topology_unknown", _plan("v9z-8"), {}, False, 2, f"mrl plan: config error: --topology: {UNKNOWN}"),
    ("new_train_on_a_held_run", _held("train"), {}, False, 2,
     "mrl train: " + BUSY + "wait for it to finish, or give this run another --out directory"),
    ("resume_on_a_held_run", _held("train", "--resume"), {}, False, 2,
     "mrl train: " + BUSY + "let it finish (or stop it), then resume"),
    ("new_train_on_a_run_being_read", _held("train", mode="shared"), {}, False, 2,
     "mrl train: {run} is being read: an `mrl eval` or `mrl export` holds {run}/.lock shared while it restores a "
     "checkpoint; wait for it to finish, or give this run another --out directory"),
    ("eval_of_a_held_run", _held("eval"), {}, False, 2,
     "mrl eval: {run} is in use: `mrl train` (PID {pid}) holds {run}/.lock and is writing its run there (checkpoints "
     "are written and deleted); evaluate it once that run has finished or stopped"),
    ("eval_beside_a_run_where_eval_is_a_file", _eval_beside_a_file, {}, False, 2,
     "mrl eval: --out {run} holds a run, and {run}/eval (where eval writes beside it) is a file; move it"),
    ("export_into_another_run", _export_into_another_run, {}, False, 2,
     "mrl export: --out {tmp}/other: holds another run of `mrl train` (export never writes into a run, --force "
     "included); choose a new or empty directory"),
]


def _in_child(argv: list[str]) -> tuple[int, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **support.compile_cache_env())
    res = subprocess.run([sys.executable, "-m", "mrl_jax.cli", *argv], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    return res.returncode, res.stderr


@pytest.mark.parametrize("case, setup, overrides, child, code, line", CASES, ids=[c[0] for c in CASES])
def test_a_failure_is_one_line(finished, tmp_path, holders, capsys, case, setup, overrides, child, code, line):
    _config(tmp_path, **overrides)
    argv = setup(tmp_path, holders, finished)
    if child:
        rc, err = _in_child(argv)
    else:
        rc, err = main(argv), capsys.readouterr().err
    expected = line.format(tmp=tmp_path, run=tmp_path / "run", pid=getattr(holders, "pid", None), names=_names())
    assert rc == code and "Traceback" not in err, err
    assert err.strip().splitlines() == [expected], err


# --------------------------------------------------------------------------- a misfit is a report
HUGE = {"family": "llama", "hidden_size": 8192, "num_layers": 12, "num_heads": 64, "num_kv_heads": 8}   # 1.8B params


def _one_policy(root: Path, **overrides) -> Path:
    cfg = support.tiny_config(**overrides)
    cfg["policies"] = cfg["policies"][:1]
    path = root / "one.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_plan_of_a_state_over_the_chip_is_a_report_with_exit_1(tmp_path, monkeypatch, capsys):
    """`mrl plan` of a policy whose params and optimizer state alone overflow the chip: exit 1, the figures per
    chip, the verdict and the fixes searched, from abstract shapes before any sampler search (nothing compiled: no
    compile line on stderr), not a config error naming ``sampling.slots``. The slice is v5e-1 laid out on this
    machine's CPU device (libtpu's layout is tests/test_tpu_compile.py's)."""
    import jax

    from mrl_jax.mwra import tpu

    monkeypatch.setattr(tpu.Topology, "devices", lambda self: jax.devices()[:1])
    cfg = _one_policy(tmp_path, **{"policies.0.model": HUGE})
    rc = main(["plan", "--config", str(cfg), "--topology", "v5e-1", "--out", str(tmp_path / "plan")])
    out, err = capsys.readouterr()
    assert rc == 1 and err == "", err
    lines = out.strip().splitlines()
    assert lines.pop() == f"wrote {tmp_path / 'plan' / 'summary.json'}"
    assert lines[0].endswith("16 GiB HBM per device; the states checked from their shapes, nothing compiled, nothing "
                             "allocated)"), lines[0]
    summary = json.loads((tmp_path / "plan" / "summary.json").read_text())
    assert not summary["fits"] and summary["memory"]["policies"]["llama_bpe"]["update"] is None
    assert summary["memory"]["misfits"] == lines[-1:]
    assert ("  llama_bpe on devices [0]: params 6.91 GiB + optimizer 13.8 GiB + reference 0 B = 20.7 GiB of 16 GiB: "
            "DOES NOT FIT (state alone; no step compiled)") in lines, out
    assert lines[-2:] == [
        "verdict: does not fit",
        "config key 'policies.llama_bpe': does not fit: its state alone needs 20.7 GiB per device (params 6.91 GiB + "
        "optimizer 13.8 GiB + reference 0 GiB, on 1 device(s)) but the device memory is 16 GiB (v5e-1 HBM); no step "
        "compiled; fixes: more chips: the states alone need 2 or more devices at FSDP (has 1); lora.rank: 16: state "
        "7.07 GiB per device (fits; its steps are compiled once the state fits); optimizer.micro_batch_size, "
        "model.remat and fewer sampling.slots shrink the steps, not the state: not searched"], out


def test_train_of_a_state_over_memory_gb_is_one_line_per_policy(tmp_path, capsys):
    """The same check in `mrl train` (``mwra.memory_gb``, CPU): exit 2 before any compile, the state's line."""
    cfg = _one_policy(tmp_path, **{"mwra.memory_gb": 0.0001})
    rc = main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        "mrl train: config error: config key 'policies.llama_bpe': does not fit: its state alone needs 0.000359 GiB "
        "per device (params 0.00012 GiB + optimizer 0.00024 GiB + reference 0 GiB, on 1 device(s)) but the device "
        "memory is 0.0001 GiB (mwra.memory_gb); no step compiled; fixes: more chips: the states alone need 4 or more "
        "devices at FSDP (has 1); lora.rank: 16: state 0.000246 GiB per device (does not fit; its steps are compiled "
        "once the state fits); optimizer.micro_batch_size, model.remat and fewer sampling.slots shrink the steps, "
        "not the state: not searched"], err
