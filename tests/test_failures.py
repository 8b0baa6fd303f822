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

import support  # noqa: E402
from mrl_jax.cli import main  # noqa: E402
from mrl_jax.trainer.compile_stats import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_cache")

HOLD_LOCK = ("import sys, time\n"
             "from mrl_jax.trainer.run_lock import run_lock\n"
             "with run_lock(sys.argv[1]):\n"
             "    print('held', flush=True)\n"
             "    time.sleep(120)\n")


def _config(tmp_path, name="cfg.yaml", **overrides) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(support.tiny_config(**overrides)))
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


# --------------------------------------------------------------------------------- before, resume
FINISHED = dict(rounds=1, eval_samples=2, eval_prompts=4)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished one-round run of the tiny config through the CLI (with a sampled evaluation: ``before``)."""
    root = tmp_path_factory.mktemp("finished")
    assert main(["train", "--config", str(_config(root, "one.yaml", **FINISHED)), "--out", str(root / "run")]) == 0
    return root / "run"


def _copy(finished, tmp_path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_before_survives_resume_and_a_finished_run_is_left_untouched(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    before = json.loads((out / "before.json").read_text())
    assert json.loads((out / "summary.json").read_text())["before"] == before
    assert set(before) >= {"llama_bpe", "gpt2_uni"} and "pass@1" in json.dumps(before)
    snapshot = _files(out)
    capsys.readouterr()
    rc, err, programs = _cli(capsys, "train", "--config", _config(tmp_path, "one.yaml", **FINISHED), "--out", out,
                             "--resume")
    assert rc == 0 and "is complete" in err and programs == 0
    assert _files(out) == snapshot   # a resume of a finished run changes nothing
    # one more round (as after a kill following checkpoint 0): the summary keeps the starting state's figures
    more = _config(tmp_path, "two.yaml", **dict(FINISHED, rounds=2))
    rc, err, _ = _cli(capsys, "train", "--config", more, "--out", out, "--resume")
    assert rc == 0 and "rounds: 1 -> 2" in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"] == before and summary["resumed_from"] == 0 and summary["rounds"] == 2


def _resume_refused(capsys, tmp_path, out, **overrides) -> list[str]:
    cfg = _config(tmp_path, "more.yaml", **dict(FINISHED, rounds=2, **overrides))
    rc, err, _ = _cli(capsys, "train", "--config", cfg, "--out", out, "--resume")
    lines = err.splitlines()
    assert rc == 2 and "Traceback" not in err and "Event loop is closed" not in err and "absl" not in err, err
    assert len(lines) == 2 and lines[0].startswith("mrl train: warning: resuming"), err   # the changed keys, the error
    return lines


def test_resume_with_other_num_generations_is_refused_before_any_work(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    snapshot = _files(out)
    cfg = _config(tmp_path, "g.yaml", **dict(FINISHED, rounds=2, num_generations=2))
    rc, err, programs = _cli(capsys, "train", "--config", cfg, "--out", out, "--resume")
    assert rc == 2 and "\n" not in err and "config key 'num_generations'" in err and "num_generations: 4" in err
    assert programs == 0 and _files(out) == snapshot


def test_resume_with_another_model_size_is_one_line(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    model = {"family": "llama", "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    lines = _resume_refused(capsys, tmp_path, out, **{"policies.0.model": model})
    assert "float32[261, 32] but this run's config gives float32[261, 64]" in lines[1], lines


def test_corrupted_checkpoint_is_one_line_naming_the_array(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    for f in (out / "checkpoints" / "0" / "state").rglob("d/*"):
        f.write_bytes(os.urandom(100))
    lines = _resume_refused(capsys, tmp_path, out)
    assert "(round 0) is incomplete or corrupted" in lines[1] and "TensorStore details" not in lines[1], lines
    assert "Error reading" in lines[1] and "start a new --out" in lines[1]


# ------------------------------------------------------------------------------ table of bad inputs
def _rows(tmp: Path, name: str, rows: list, text: str | None = None) -> str:
    path = tmp / name
    path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


DISTINCT = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
SAME = [{"prompt": "1+1=", "answer": "2"}] * 40


def _dataset(**task):
    def edit(cfg, tmp, env):
        cfg["task"] = {"name": "dataset", "path": _rows(tmp, "d.jsonl", DISTINCT), **task}
    return edit


def _task(**task):
    def edit(cfg, tmp, env):
        cfg["task"] = task
    return edit


def _file_task(rows=None, text=None, **task):
    def edit(cfg, tmp, env):
        cfg["task"] = {"name": "dataset", "path": _rows(tmp, "f.jsonl", rows or [], text), **task}
    return edit


def _set(**overrides):
    def edit(cfg, tmp, env):
        for key, value in overrides.items():
            node, parts = cfg, key.split(".")
            for part in parts[:-1]:
                node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            node[parts[-1]] = value
    return edit


def _flags(*flags, env_vars=None):
    """``mrl train`` of the tiny config with extra multi-host ``flags`` (and environment variables)."""
    def edit(cfg, tmp, env):
        for k, v in (env_vars or {}).items():
            env.setenv(k, v)
        return ["train", "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "run"), *flags]
    return edit


def _coordinator_gone(cfg, tmp, env):
    env.setenv("MRL_INIT_TIMEOUT_S", "1")
    return ["train", "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "run"), "--coordinator",
            f"127.0.0.1:{support.free_port()}", "--num-processes", "2", "--process-id", "1"]


def _eval(*flags, model=None):
    """``mrl eval`` of the tiny config with ``flags`` (``model``: make that folder and pass it as --model)."""
    def edit(cfg, tmp, env):
        extra = []
        if model is not None:
            folder = tmp / "model"
            folder.mkdir()
            for name, text in model.items():
                (folder / name).write_text(text)
            extra = ["--model", str(folder), "--policy", "llama_bpe"]
        return ["eval", "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "ev"), *flags, *extra]
    return edit


def _out_is_a_file(verb):
    def edit(cfg, tmp, env):
        (tmp / "taken").write_text("x")
        return [verb, "--config", str(tmp / "cfg.yaml"), "--out", str(tmp / "taken")]
    return edit


# (case, edit(config dict, tmp dir, monkeypatch) -> argv or None (train), exit code, texts the line must hold)
CASES = [
    ("eval_split_on_a_plain_file", _dataset(eval_split="test"), 2, ("'task.eval_split'", "plain file")),
    ("split_on_a_plain_file", _dataset(split="train"), 2, ("'task.split'", "no splits")),
    ("eval_fraction_zero", _dataset(eval_fraction=0.0), 2, ("task.eval_fraction", "holds out no rows")),
    ("nothing_held_out", _dataset(eval_fraction=1e-6), 2, ("task.eval_fraction", "none held out",
                                                          "raise task.eval_fraction")),
    ("duplicate_rows", _file_task(SAME, eval_fraction=0.1), 2, ("task.eval_fraction", "1 distinct prompts",
                                                               "rows 1, 2, 3, 4, 5, ...")),
    ("eval_split_on_jsonl_task", _task(name="jsonl", path="x.jsonl", eval_split="test"), 2,
     ("task.eval_split", "only task 'dataset'")),
    ("empty_jsonl", _file_task(text=""), 2, ("f.jsonl", "the file is empty")),
    ("malformed_jsonl_line", _file_task(text='{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n'
                                             '{"prompt": "c", "answer"\n'), 2, ("f.jsonl:3:", "invalid JSON")),
    ("column_shadows_completions", _file_task([{"prompt": "1+1=", "answer": "2", "completions": "x"}] * 2 +
                                              DISTINCT), 2, ("f.jsonl", "column 'completions'", "rename the column")),
    ("reasoning_gym_bad_option", _task(name="reasoning_gym", datasets={"chain_sum": 1.0},
                                       config={"chain_sum": {"min_term": 2}}), 2,
     ("task.config.chain_sum.min_term", "valid options: min_terms, max_terms")),
    ("reasoning_gym_bad_value", _task(name="reasoning_gym", datasets={"chain_sum": 1.0},
                                      config={"chain_sum": {"min_terms": 5, "max_terms": 2}}), 2,
     ("task.config.chain_sum", "ChainSumConfig rejects")),
    ("reasoning_gym_config_not_in_datasets", _task(name="reasoning_gym", datasets={"chain_sum": 1.0},
                                                   config={"basic_arithmetic": {"min_terms": 2}}), 2,
     ("task.config.basic_arithmetic", "is not in task.datasets ['chain_sum']")),
    ("reasoning_gym_unknown_dataset", _task(name="reasoning_gym", datasets={"chain_sums": 1.0}), 2,
     ("task.datasets.chain_sums", "did you mean 'chain_sum'")),
    ("eval_negative_temperature", _eval("--temperature", "-1"), 2, ("--temperature -1.0", "must be > 0")),
    ("eval_negative_samples", _eval("--samples", "-1"), 2, ("--samples -1", "must be >= 0")),
    ("eval_out_is_a_file", _out_is_a_file("eval"), 2, ("--out", "is a file")),
    ("train_out_is_a_file", _out_is_a_file("train"), 2, ("--out", "is a file")),
    ("eval_model_is_a_run_directory", _eval(model={"config.json": json.dumps({"policies": []})}), 2,
     ("--model", "is a run directory", "--run")),
    ("eval_model_is_not_a_model", _eval(model={"notes.txt": "x"}), 2,
     ("--model", "not a model directory", "config.json with a model_type")),
    ("reward_weight_not_a_number", _set(rewards=[{"builtin": "accuracy"}, {"builtin": "format", "weight": "heavy"}]),
     2, ("rewards[1].weight", "'heavy' is not a finite number")),
    ("reward_weight_nan", _set(rewards=[{"builtin": "accuracy"}, {"builtin": "format", "weight": float("nan")}]), 2,
     ("rewards[1].weight", "nan is not a finite number")),
    ("max_num_gen_batches_unbounded", _set(dynamic_sampling={"enable": True, "max_num_gen_batches": 1000000}), 2,
     ("dynamic_sampling.max_num_gen_batches", "is over 64", "completions")),
    ("no_coordinator", _flags("--num-processes", "2", "--process-id", "0"), 2, ("--coordinator ($MRL_COORDINATOR)",)),
    ("process_id_out_of_range", _flags("--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"),
     2, ("--process-id 2 out of range for --num-processes 2",)),
    ("coordinator_without_port", _flags("--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"), 2,
     ("--coordinator 'localhost'", "host:port")),
    ("zero_processes", _flags("--num-processes", "0"), 2, ("--num-processes 0", ">= 1")),
    ("second_id_of_one_process", _flags("--num-processes", "1", "--process-id", "1"), 2,
     ("--process-id 1 with --num-processes 1",)),
    ("process_id_not_a_number", _flags("--coordinator", "localhost:1", "--num-processes", "2",
                                       env_vars={"MRL_PROCESS_ID": "zero"}), 2, ("--process-id 'zero'", "$MRL_PROCESS_ID")),
    ("bad_heartbeat", _flags("--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0",
                             env_vars={"MRL_HEARTBEAT_TIMEOUT_S": "0"}), 2, ("$MRL_HEARTBEAT_TIMEOUT_S",)),
    ("coordinator_never_answers", _coordinator_gone, 2, ("--coordinator 127.0.0.1:", "nothing answered there within 1 s",
                                                          "process 1 of 2", "(process 1 of 2, timeout 1 s)")),
]
LINES = {"coordinator_never_answers": 2}   # "waiting for coordinator ..." first


@pytest.mark.parametrize("case, edit, code, needles", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_before_any_compile(tmp_path, capsys, monkeypatch, case, edit, code, needles):
    cfg = support.tiny_config()
    argv = ["train", "--config", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "run")]
    extra = edit(cfg, tmp_path, monkeypatch)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    if isinstance(extra, list):
        argv = extra
    rc, err, programs = _cli(capsys, *argv)
    assert rc == code and err.count("\n") == LINES.get(case, 1) - 1 and "Traceback" not in err, err
    assert all(n in err for n in needles), (needles, err)
    assert programs == 0   # refused before any XLA program is built


# ------------------------------------------------------------------------------------------ waits
def test_dynamic_sampling_rounds_say_when_they_draw_more_and_when_they_keep_nothing(tmp_path, capsys):
    from mrl_jax.tasks import RewardSpec
    from mrl_jax.trainer import train

    cfg = support.to_run_config(support.tiny_config(rounds=1, **{"dynamic_sampling": {"enable": True,
                                                                                "max_num_gen_batches": 3}}))
    train(cfg, tmp_path / "run", reward_specs=[RewardSpec(lambda prompt, completion: 1.0, name="constant")],
          progress=False)
    err = capsys.readouterr().err.splitlines()
    draws = [line for line in err if line.startswith("[dynamic sampling]")]
    assert draws == [f"[dynamic sampling] round 0: 0 of 4 prompts useful after {k} batch(es); drawing batch {k + 1} "
                     "of at most 3" for k in (1, 2)]
    zero = [line for line in err if "kept 0 of 4 groups" in line]
    assert [("'llama_bpe'" in z, "'gpt2_uni'" in z) for z in zero] == [(True, False), (False, True)]
    assert all("after 3 batch(es)" in z and "max_num_gen_batches" in z for z in zero)


# ---------------------------------------------------------------------------------------- rewards
def _raises_on_odd_length(prompt, completion):
    if len(completion) % 2:
        raise ValueError(f"odd length {len(completion)}")
    return 0.5


def test_reward_errors_are_one_stderr_line_per_round(tmp_path, capsys):
    import re

    from mrl_jax.tasks import RewardSpec
    from mrl_jax.trainer import train

    cfg = support.to_run_config(support.tiny_config(rounds=2, max_reward_failures=1000))
    train(cfg, tmp_path / "run", reward_specs=[RewardSpec(_raises_on_odd_length, name="odd")], progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "reward 'odd' failed" in line]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    errors = {}
    for r in records:
        if "reward/odd/errors" in r:
            errors[r["round"]] = errors.get(r["round"], 0) + int(r["reward/odd/errors"])
    assert errors and sum(errors.values()) > 0
    expected = [r for r in sorted(errors) if errors[r]]
    assert [int(re.search(r"round (\d+):", line).group(1)) for line in lines] == expected
    for line, r in zip(lines, expected):
        assert f"failed on {errors[r]} calls (errors {errors[r]}; each scored 0)" in line
        assert "ValueError: odd length" in line


# ------------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_inside_a_checkpoint_write_is_one_line_with_the_resume_command(tmp_path, capsys, monkeypatch):
    from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch

    original = cch.CompositeCheckpointHandler.save

    def save(self, directory, *args, **kwargs):   # the arrays are in the temporary folder, not yet renamed
        out = original(self, directory, *args, **kwargs)
        if Path(str(directory)).name.split(".")[0] == "1":
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(cch.CompositeCheckpointHandler, "save", save)
    out = tmp_path / "run"
    argv = ["train", "--config", str(_config(tmp_path, rounds=3)), "--out", str(out)]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and "Traceback" not in "\n".join(err)
    assert err[-1] == (f"mrl train: interrupted in round 1; the checkpoint of round 0 in {out / 'checkpoints'} is "
                       "intact (later rounds are redone); resume with: mrl " + " ".join(argv + ["--resume"]))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0"]   # no stale *.orbax-checkpoint-tmp


def _sigint_inside_each_write(monkeypatch):
    """A real SIGINT to this process at the start of orbax's write of every checkpoint."""
    import signal

    from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch

    original = cch.CompositeCheckpointHandler.save

    def save(self, directory, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(self, directory, *args, **kwargs)

    monkeypatch.setattr(cch.CompositeCheckpointHandler, "save", save)


def test_sigint_during_a_checkpoint_write_waits_for_it_then_interrupts(tmp_path, monkeypatch, capsys):
    """A real SIGINT inside the write: the checkpoint still completes (no temp folder for orbax's threads to
    refill), then KeyboardInterrupt; the deferral says so on stderr."""
    import signal

    import numpy as np

    from mrl_jax.trainer.checkpoint import RunCheckpointer

    # Python's own handler, whatever this process inherited (a shell's background job starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    _sigint_inside_each_write(monkeypatch)
    ckpt = RunCheckpointer(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(3, {"w": np.arange(6.0)}, {"round": 3})
    ckpt.close()
    assert ckpt.latest_round() == 3 and sorted(p.name for p in ckpt.directory.iterdir()) == ["3"]
    assert "finishing the checkpoint of round 3; Ctrl-C again abandons it" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler is restored
    signal.signal(signal.SIGINT, previous)


def test_an_ignored_sigint_stays_ignored_during_a_checkpoint_write(tmp_path, monkeypatch):
    """A run that inherited SIGINT ignored (started in the background by a script) ignores it during the write
    too: the write finishes, no interrupt (the deferral used to turn it into one)."""
    import signal

    import numpy as np

    from mrl_jax.trainer.checkpoint import RunCheckpointer

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    _sigint_inside_each_write(monkeypatch)
    ckpt = RunCheckpointer(tmp_path)
    try:
        ckpt.save(3, {"w": np.arange(6.0)}, {"round": 3})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        ckpt.close()
        signal.signal(signal.SIGINT, previous)
    assert ckpt.latest_round() == 3


def test_processes_that_never_all_join_exit_2_naming_the_flags(tmp_path):
    """Process 0 of 2 alone: JAX would abort (exit 134, a C++ trace) at its start-up limit; the run exits 2 first."""
    env = dict(os.environ, PYTHONPATH=str(REPO), MRL_INIT_TIMEOUT_S="2", JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", "mrl_jax.cli", "train", "--config", str(_config(tmp_path)), "--out",
            str(tmp_path / "run"), "--coordinator", f"127.0.0.1:{support.free_port()}", "--num-processes", "2",
            "--process-id", "0"]
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    # ours, without JAX's one warning that its coordination service runs recoverable (docs/multihost.md)
    lines = [ln for ln in res.stderr.strip().splitlines() if "recoverable task feature" not in ln]
    assert res.returncode == 2 and "Check failure" not in res.stderr, res.stderr
    assert lines[0].startswith("waiting for coordinator 127.0.0.1:") and lines[0].endswith("(process 0 of 2, timeout 2 s)")
    assert lines[-1].startswith("mrl train: --coordinator 127.0.0.1:") and "did not all join within 2 s" in lines[-1]
    assert "--num-processes" in lines[-1] and len(lines) == 2, lines


def test_sigint_of_a_real_run_is_one_line_without_traceback(tmp_path):
    """SIGINT (what Ctrl-C sends to the process group) mid-run: exit 130, no traceback, no temp folder, and the
    line's command resumes."""
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **support.compile_cache_env())
    argv = ["train", "--config", str(_config(tmp_path, rounds=200)), "--out", str(out)]
    # SIGINT as a terminal's foreground process has it: a test run started in the background by a script inherits
    # it ignored (so did the run, which then stopped only when the signal came during a checkpoint write)
    child = subprocess.Popen([sys.executable, "-m", "mrl_jax.cli", *argv], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        # a checkpoint after round 0 (keep_checkpoints 2: checkpoint "1" lives for two rounds only, which a poll can miss)
        saved = lambda: any(p.name.isdigit() and int(p.name) >= 1 for p in (out / "checkpoints").glob("*"))
        while not saved() and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.2)
        assert child.poll() is None, "the run ended before it could be interrupted"
        os.killpg(child.pid, signal.SIGINT)   # the whole group, as a terminal does: reward workers included
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    lines = err.strip().splitlines()
    assert child.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert lines[-1].startswith("mrl train: interrupted in round ") and "is intact" in lines[-1], lines[-1]
    assert lines[-1].endswith("resume with: mrl " + " ".join(argv + ["--resume"]))
    assert not list((out / "checkpoints").glob("*.orbax-checkpoint-tmp*"))


def _always_raises(prompt, completion):
    raise ValueError("broken")


def test_reward_stop_names_the_config_key_and_memory_is_in_gib():
    from mrl_jax.mwra.memory_plan import gb
    from mrl_jax.tasks import RewardFailure, RewardScorer, RewardSpec
    from mrl_jax.tasks.base import Prompt

    prompts = [Prompt(id=i, text=str(i), answer="0", task="t") for i in range(4)]
    with RewardScorer([RewardSpec(_always_raises, name="bad")], max_consecutive_failures=2) as scorer:
        with pytest.raises(RewardFailure, match=r"limit 2: config key max_reward_failures"):
            scorer.score(prompts, ["a"] * 4)
    assert gb(3 * (1 << 30)) == "3 GiB"   # mwra.memory_gb is GiB: the figures it is compared with are too


def test_closed_event_loop_reports_are_kept_off_stderr_and_other_ones_are_not(monkeypatch):
    """What orbax's leftover event loops raise at garbage collection after a failed restore (98 tracebacks
    before): swallowed by the CLI's hooks; any other unraisable or thread error still reaches the hook before."""
    import threading
    import types

    from mrl_jax import cli

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(("unraisable", str(u.exc_value))))
    monkeypatch.setattr(threading, "excepthook", lambda a: seen.append(("thread", str(a.exc_value))))
    cli._quiet_libraries()
    for exc in (RuntimeError("Event loop is closed"), ValueError("a real bug")):
        sys.unraisablehook(types.SimpleNamespace(exc_value=exc))
        threading.excepthook(types.SimpleNamespace(exc_value=exc))
    assert seen == [("unraisable", "a real bug"), ("thread", "a real bug")]
