"""Reliability of ``mrl train`` (issue "reliability"): resume and kill-and-resume equality, atomic checkpoints
and retention, failing rewards, guarded updates, and clear errors for bad input.

Every run is the tiny two-policy config (experiments/configs/tiny_two_policy.yaml: Llama + byte-level BPE,
GPT-2 + Unigram, hidden 32, one layer, 4 prompts x 4 generations, 6 new tokens) with the same shapes. The runs
that are compared bit for bit (the reference, the resumed and the killed ones) run in child processes one after
another, sharing the module's persistent compilation cache as a user's ``mrl`` runs share theirs: the first
compiles, the others load.
"""

import gc
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax.configs import ConfigError, load_yaml  # noqa: E402
from mrl_jax.tasks import RewardFailure, RewardSpec  # noqa: E402
from mrl_jax.trainer import Run, TrainingStopped, train  # noqa: E402
from mrl_jax.trainer.checkpoint import CheckpointError, RunCheckpointer  # noqa: E402
from mrl_jax.trainer.config import RunConfig  # noqa: E402


pytestmark = pytest.mark.usefixtures("jax_compile_cache")


POLICIES = ["llama_bpe", "gpt2_uni"]
ROUNDS = 4
SIGNAL = {"faulty": {"seed": 0, "p": {}}}  # digit_reward: a learning signal even for random tiny models


def cfg_of(**overrides) -> RunConfig:
    return support.to_run_config(support.tiny_config(**overrides))


def base_overrides(**more) -> dict:
    return dict(dict(rounds=ROUNDS, checkpoint_every=1, keep_checkpoints=2, eval_every=2), **more)


def assert_same_as_reference(reference, out):
    """Final checkpoint arrays bit for bit, and every record file (metrics with eval rows, samples, groups)."""
    same = support.compare_runs(reference, out)
    assert same["arrays_equal"] and same["metrics_equal"], same
    assert support.record_differences(reference, out) == {}


def leaves_by_path(out, round_index) -> dict:
    return dict(support.checkpoint_leaves(out, round_index)[0])


def policy_arrays(leaves: dict, index: int) -> dict:
    return {k: v for k, v in leaves.items() if k.startswith(f"['policies'][{index}]")}


def arrays_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def child_cache(tmp_path_factory):
    """The compilation cache of this module's child runs (one at a time)."""
    return tmp_path_factory.mktemp("xla_cache")


def child(out, child_cache, **kw) -> dict:
    """``train`` of the base config (``rounds`` etc. as keyword overrides) in a child process with the digit reward;
    ``resume`` / ``kill_*`` as ``support.run_child``."""
    run = {k: kw.pop(k) for k in list(kw) if k in ("resume", "kill_after_round", "kill_after_save", "kill_in_save")}
    return support.run_child(support.tiny_config(**base_overrides(**kw)), out, rewards=SIGNAL, cache_dir=child_cache,
                             **run)


def resumed(out, child_cache) -> dict:
    """Resume ``out`` to ROUNDS rounds in a child; its summary.json."""
    res = child(out, child_cache, resume=True)
    assert res["returncode"] == 0, res["stderr"]
    return dict(json.loads((out / "summary.json").read_text()), stderr=res["stderr"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, child_cache):
    """An uninterrupted run of ROUNDS rounds, a checkpoint every round, keep 2."""
    out = tmp_path_factory.mktemp("reference")
    res = child(out, child_cache)
    assert res["returncode"] == 0, res["stderr"]
    return out


# ------------------------------------------------------------------------------------------ resume
def test_reference_run_writes_everything_and_keeps_k(reference):
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json", "config.json"):
        assert (reference / name).is_file(), name
    assert support.checkpoint_rounds(reference) == [ROUNDS - 2, ROUNDS - 1]  # keep_checkpoints = 2
    assert not [n for n in os.listdir(reference / "checkpoints") if "tmp" in n]
    records = support.training_records(reference)
    assert support.contiguity_problems(records, POLICIES, ROUNDS) == []
    # the runs compared below really learn: params move every round
    first, last = leaves_by_path(reference, ROUNDS - 2), leaves_by_path(reference, ROUNDS - 1)
    assert not arrays_equal(policy_arrays(first, 0), policy_arrays(last, 0))
    assert not arrays_equal(policy_arrays(first, 1), policy_arrays(last, 1))
    assert all(r["skipped"] == 0.0 for r in records)


def test_resume_continues_rounds_and_metrics_bit_identically(reference, tmp_path, child_cache):
    out = tmp_path / "run"
    assert child(out, child_cache, rounds=2)["returncode"] == 0
    assert support.checkpoint_rounds(out) == [0, 1]
    assert resumed(out, child_cache)["resumed_from"] == 1
    assert support.contiguity_problems(support.training_records(out), POLICIES, ROUNDS) == []
    assert_same_as_reference(reference, out)
    assert support.checkpoint_rounds(out) == [2, 3]


def test_sigkill_mid_run_then_resume_equals_uninterrupted(reference, tmp_path, child_cache):
    out = tmp_path / "killed"
    res = child(out, child_cache, kill_after_round=1)
    assert res["killed"] and res["returncode"] == -9, res
    ckpt = RunCheckpointer(out)
    latest = ckpt.latest_round()
    ckpt.close()
    assert latest is not None and 1 <= latest < ROUNDS - 1  # killed with rounds left to redo
    resumed(out, child_cache)
    assert support.contiguity_problems(support.training_records(out), POLICIES, ROUNDS) == []
    assert_same_as_reference(reference, out)


def test_sigkill_right_after_checkpoint_keeps_every_record(reference, tmp_path, child_cache):
    """Killed the moment round 1's checkpoint is complete: that round's held-out eval (eval_every 2) is already
    logged, so the resumed run's files equal the uninterrupted run's, eval rows included."""
    evals = [r["round"] for r in support.read_jsonl(reference / "metrics.jsonl") if r["policy"].endswith("/eval")]
    assert evals == [1, 1, 3, 3]
    out = tmp_path / "killed_after_save"
    res = child(out, child_cache, kill_after_save=1)
    assert res["returncode"] == -9, res
    assert support.checkpoint_rounds(out) == [0, 1]
    resumed(out, child_cache)
    assert_same_as_reference(reference, out)


def test_sigkill_inside_checkpoint_write_is_never_taken_as_latest(reference, tmp_path, child_cache):
    out = tmp_path / "killed_in_save"
    res = child(out, child_cache, kill_in_save=2)
    assert res["returncode"] == -9, res
    names = os.listdir(out / "checkpoints")
    assert any(n.startswith("2.") and "tmp" in n for n in names), names  # the partial write is there ...
    ckpt = RunCheckpointer(out)
    assert ckpt.latest_round() == 1  # ... but never the latest
    ckpt.close()
    assert support.last_logged_round(out) == 2  # round 2 was logged before its checkpoint write was killed
    summary = resumed(out, child_cache)
    assert "differs" not in summary["stderr"]  # same config: no "config differs" warning
    assert summary["resumed_from"] == 1
    assert support.contiguity_problems(support.training_records(out), POLICIES, ROUNDS) == []
    assert_same_as_reference(reference, out)
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3"]  # leftover removed, keep-2 applied


def test_existing_checkpoints_need_resume(reference, tmp_path, capsys):
    with pytest.raises(CheckpointError, match="--resume") as e:
        train(cfg_of(**base_overrides()), reference, progress=False)
    assert str(reference) in str(e.value) and "new --out" in str(e.value)
    from mrl_jax.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(support.tiny_config(**base_overrides())))
    try:  # the CLI reports it (an exit code and the message) or lets the CheckpointError through
        rc = main(["train", "--config", str(cfg_path), "--out", str(reference)])
        assert rc != 0 and "--resume" in capsys.readouterr().err
    except CheckpointError as err:
        assert "--resume" in str(err)


# ------------------------------------------------------------------------------- bad checkpoints
@pytest.fixture(scope="module")
def template():
    return Run(cfg_of(**base_overrides())).state_template()


def test_corrupted_checkpoint_names_dir_and_fix(reference, tmp_path, template):
    out = tmp_path / "corrupt"
    shutil.copytree(reference, out)
    for f in (out / "checkpoints" / "3" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as e:   # one more round: a resume of a finished run reads no checkpoint
        train(cfg_of(**base_overrides(rounds=ROUNDS + 1)), out, resume=True, reward_specs=support.reward_specs(SIGNAL),
              progress=False)
    msg = str(e.value)
    assert str(out / "checkpoints" / "3") in msg and "corrupted" in msg
    assert "delete" in msg and "round 2" in msg  # the fix: fall back to the previous complete checkpoint
    # following the advice works: round 2 restores
    shutil.rmtree(out / "checkpoints" / "3")
    ckpt = RunCheckpointer(out)
    state, meta = ckpt.restore(template)
    ckpt.close()
    assert meta["round"] == 2


def test_checkpoint_with_deleted_files_names_dir(reference, tmp_path, template):
    out = tmp_path / "deleted"
    shutil.copytree(reference, out)
    (out / "checkpoints" / "3" / "state" / "_METADATA").unlink()
    ckpt = RunCheckpointer(out)
    with pytest.raises(CheckpointError, match="incomplete or corrupted") as e:
        ckpt.restore(template)
    ckpt.close()
    assert str(out / "checkpoints" / "3") in str(e.value) and "round 2" in str(e.value)


def test_checkpoint_of_another_config_names_array(reference, template):
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(template)
    k = int(np.argmax([np.size(x) for x in leaves]))
    leaves[k] = np.zeros((np.shape(leaves[k])[0] + 1,) + np.shape(leaves[k])[1:], leaves[k].dtype)
    other = jax.tree_util.tree_unflatten(treedef, leaves)
    ckpt = RunCheckpointer(reference)
    left = []   # orbax reads started and abandoned: coroutines closed at garbage collection, reported here
    hook, sys.unraisablehook = sys.unraisablehook, left.append
    try:
        with pytest.raises(CheckpointError, match="config") as e:
            ckpt.restore(other)
        ckpt.close()
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert "checkpoints/3" in str(e.value) and "Resume with the config that wrote" in str(e.value)
    assert f"array {jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(template)[0][k][0])}" in str(e.value)
    assert not left, f"the refused restore left {len(left)} reads behind: {left[0].object!r}"


def test_resume_with_checkpoints_deleted_refuses(reference, tmp_path):
    out = tmp_path / "no_ckpts"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(CheckpointError, match="no complete checkpoint") as e:
        train(cfg_of(**base_overrides()), out, resume=True, progress=False)
    assert "metrics.jsonl" in str(e.value) and "new --out" in str(e.value)
    assert len(support.training_records(out)) == 2 * ROUNDS  # the logs were not touched


def test_new_run_into_directory_with_records_refused(reference, tmp_path, capsys):
    out = tmp_path / "records_only"
    out.mkdir()
    for name in ("metrics.jsonl", "samples.jsonl", "config.json"):
        shutil.copy(reference / name, out / name)
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="already holds a run's records") as e:
        train(cfg_of(**base_overrides()), out, progress=False)
    assert "metrics.jsonl" in str(e.value) and "new --out" in str(e.value)
    assert (out / "metrics.jsonl").read_text() == before   # nothing appended
    from mrl_jax.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(support.tiny_config(**base_overrides())))
    assert main(["train", "--config", str(cfg_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a run's records" in err and "\n" not in err


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint") as e:
        train(cfg_of(**base_overrides()), tmp_path / "empty", resume=True, progress=False)
    assert "start without --resume" in str(e.value)
    out = tmp_path / "killed_before_first"   # records of round 0, no checkpoint yet (checkpoint_every 5)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 0, "policy": "llama_bpe"}\n')
    with pytest.raises(CheckpointError, match="before its first one, round 4") as e:
        train(cfg_of(**base_overrides(checkpoint_every=5)), out, resume=True, progress=False)
    assert "delete metrics.jsonl" in str(e.value)


def test_resume_with_other_rounds_under_decaying_schedule_refused(reference, tmp_path):
    out = tmp_path / "rounds"
    shutil.copytree(reference, out)
    cfg = support.tiny_config(**base_overrides(rounds=ROUNDS + 3))
    cfg["policies"][1]["optimizer"]["schedule"] = "cosine"
    with pytest.raises(ConfigError, match="'rounds'") as e:
        train(support.to_run_config(cfg), out, resume=True, progress=False)
    msg = str(e.value)
    assert f"rounds: {ROUNDS}" in msg and f"rounds: {ROUNDS + 3}" in msg
    assert "policies[1].optimizer.schedule: cosine" in msg
    assert support.checkpoint_rounds(out) == support.checkpoint_rounds(reference)   # nothing ran


def test_resume_with_changed_probes_is_one_warning_line(reference, capsys):
    from mrl_jax.trainer.loop import _check_config_changes

    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no Python warning object
        _check_config_changes(reference, cfg_of(**base_overrides(**{"policies.0.probes": "sgt"})))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mrl train: warning:")
    assert "policies.0.probes: 'xgrpo+sgt' -> 'sgt'" in err


# ----------------------------------------------------------------------------------------- rewards
def test_failing_rewards_are_counted_and_do_not_stop_the_run(tmp_path):
    F = support.FaultyReward
    specs = [RewardSpec(F(seed=1, p={"raise": 0.3}), name="raising", timeout_s=0.5),
             RewardSpec(F(seed=2, p={"hang": 0.08}, hang_s=0.8), name="hanging", timeout_s=0.5),
             RewardSpec(F(seed=3, p={"nan": 0.3}), name="nan", timeout_s=0.5),
             RewardSpec(F(seed=4, p={"string": 0.3}), name="string", timeout_s=0.5)]
    out = tmp_path / "faulty"
    train(cfg_of(**base_overrides(rounds=2)), out, reward_specs=specs, progress=False)
    records = support.training_records(out)
    assert support.contiguity_problems(records, POLICIES, 2) == []
    total = lambda key: sum(r[key] for r in records)  # noqa: E731
    assert total("reward/raising/errors") > 0
    assert total("reward/hanging/timeouts") > 0
    assert total("reward/nan/nonfinite") > 0
    assert total("reward/string/bad_type") > 0
    assert all(np.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in records)
    assert (out / "summary.json").is_file() and support.checkpoint_rounds(out) == [0, 1]


def test_reward_failing_every_call_stops_with_logs_intact(tmp_path):
    # 2 policies x 16 calls per round: calls 0..63 (rounds 0, 1) succeed, then every call fails
    specs = [RewardSpec(support.FaultyReward(fail_after_calls=64), name="broken", timeout_s=0.5)]
    out = tmp_path / "broken"
    with pytest.raises(RewardFailure) as e:
        train(cfg_of(**base_overrides(max_reward_failures=20)), out, reward_specs=specs, progress=False)
    msg = str(e.value)
    assert "'broken'" in msg and "consecutive" in msg and "round 2" in msg and "--resume" in msg
    assert support.contiguity_problems(support.training_records(out), POLICIES, 2) == []
    assert support.checkpoint_rounds(out) == [0, 1]
    for r in (0, 1):
        assert support.checkpoint_leaves(out, r)[1] == {"round": r}
    assert all(json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines())
    assert not (out / "summary.json").exists()


# ---------------------------------------------------------------------------------- guarded update
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_nonfinite_update_is_skipped_then_run_stops_with_batch_saved(tmp_path):
    # policy 0's rewards are 3e38 from round 1 on (calls 32.. with n % 32 < 16): its group mean overflows,
    # the loss is NaN; policy 1 gets the ordinary signal. Probes 'none': nothing crosses between the two.
    specs = [RewardSpec(support.FaultyReward(huge_calls=(32, 0, 16), huge_from_call=32), name="huge",
                        timeout_s=0.5, high=3.4e38)]
    # The run is cut after round 1 (one skip) and resumed: the skip count lives in the optimizer state, so the
    # second skip in a row (round 2, after the resume) stops the run.
    out = tmp_path / "nan"
    over = dict(max_skipped_updates=2, keep_checkpoints=4, **{"policies.0.probes": "none", "policies.1.probes": "none"})
    train(cfg_of(**base_overrides(**over, rounds=2)), out, reward_specs=specs, progress=False)
    with pytest.raises(TrainingStopped) as e:
        train(cfg_of(**base_overrides(**over)), out, resume=True, reward_specs=specs, progress=False)
    batch_file = out / "failed_batch_llama_bpe_round2.npz"
    msg = str(e.value)
    assert "llama_bpe" in msg and "gpt2_uni" not in msg and str(batch_file) in msg
    assert "(llama_bpe: the rewards overflow or are not finite (reward_mean inf): check the reward functions)" in msg
    records = support.training_records(out)
    skipped = {p: [(r["skipped"], r["skipped_in_a_row"]) for r in records if r["policy"] == p] for p in POLICIES}
    assert skipped == {"llama_bpe": [(0.0, 0.0), (1.0, 1.0), (1.0, 2.0)], "gpt2_uni": [(0.0, 0.0)] * 3}
    assert support.checkpoint_rounds(out) == [0, 1, 2]
    ck = {r: leaves_by_path(out, r) for r in (0, 1, 2)}
    steady = lambda leaves: {k: v for k, v in leaves.items() if "finite" not in k}   # noqa: E731  (no counters)
    in_a_row = [int(v) for r in (0, 1, 2) for k, v in policy_arrays(ck[r], 0).items() if "notfinite_count" in k
                and "total" not in k]
    assert in_a_row == [0, 1, 2]   # the optimizer state's count, checkpointed
    assert arrays_equal(steady(policy_arrays(ck[0], 0)), steady(policy_arrays(ck[1], 0)))   # params, Adam unchanged
    assert arrays_equal(steady(policy_arrays(ck[0], 0)), steady(policy_arrays(ck[2], 0)))
    assert not arrays_equal(policy_arrays(ck[0], 1), policy_arrays(ck[1], 1))  # the other policy trains on
    saved = np.load(batch_file)
    assert int(saved["round"]) == 2 and len(saved["prompts"]) == 4
    assert np.all(saved["batch.rewards"] >= 1e38) and saved["batch.completion_ids"].shape == (16, 6)


def test_a_checkpoint_from_before_the_skip_counter_resumes_with_zero_counts(tmp_path):
    """A checkpoint whose optimizer states are the inner ones (written before the skip counter moved into the
    optimizer state) restores onto today's run: the same arrays, zero counts, placed (it was a config mismatch)."""
    from mrl_jax.trainer.loop import restore_state

    run = Run(cfg_of(**base_overrides()))
    state = run.initial_state()
    ckpt = RunCheckpointer(tmp_path / "old")
    try:
        ckpt.save(3, state.replace(policies=tuple(p.replace(opt_state=p.opt_state.inner_state)
                                                  for p in state.policies)), {"round": 3})
        restored, meta = restore_state(run, ckpt)
    finally:
        ckpt.close()
    assert meta["round"] == 3
    for new, old in zip(restored.policies, state.policies):
        assert int(new.opt_state.notfinite_count) == 0 == int(new.opt_state.total_notfinite)
        assert bool(new.opt_state.last_finite)
        assert arrays_equal(dict(enumerate(jax.tree.leaves((new.params, new.opt_state.inner_state)))),
                            dict(enumerate(jax.tree.leaves((old.params, old.opt_state.inner_state)))))
    assert restored.policies[0].params is not None and isinstance(jax.tree.leaves(restored.policies[0].opt_state)[0],
                                                                  jax.Array)   # placed, not host values
    other = RunCheckpointer(tmp_path / "other")   # a checkpoint of another config still names the mismatch
    try:
        other.save(0, {"w": np.zeros(3)}, {"round": 0})
        with pytest.raises(CheckpointError, match="does not match this run's config|holds"):
            restore_state(run, other)
    finally:
        other.close()


# ------------------------------------------------------------------------------------- bad configs
def write_yaml(tmp_path, data, name="cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize("edit, key, needle", [
    (lambda c: c.update(promts_per_round=4), "promts_per_round", "Did you mean 'prompts_per_round'"),
    (lambda c: c["policies"][0]["model"].update(hiden_size=32), "policies[0].model.hiden_size",
     "Did you mean 'hidden_size'"),
    (lambda c: c["policies"][1]["sampling"].update(temprature=1.0), "policies[1].sampling.temprature",
     "Did you mean 'temperature'"),
    (lambda c: c.update(rounds="ten"), "rounds", "expected an integer"),
    (lambda c: c.update(num_generations=0), "num_generations", "must be > 0"),
    (lambda c: c["policies"][0]["sampling"].update(top_p=1.5), "policies[0].sampling.top_p", "must be in (0, 1]"),
    (lambda c: c["policies"][0]["tokenizer"].update(kind="bpe"), "policies[0].tokenizer.kind", "is not one of"),
    (lambda c: c.update(overlong_prompts="cut"), "overlong_prompts", "'truncate'"),
    (lambda c: c["policies"][0].update(max_prompt_length=-1), "policies[0].max_prompt_length", "must be >= 0"),
    (lambda c: c["see"].update(capacity=0), "see.capacity", "must be > 0"),
    (lambda c: c["policies"][0].update(probes="xgrp+sgt"), "policies[0].probes", "known: ['none'"),
    (lambda c: c["policies"][1].update(probes="sgt:lamda=0.3"), "policies[1].probes", "lamda"),
    (lambda c: c.update(max_skipped_updates=0), "max_skipped_updates", "must be > 0"),
    (lambda c: c["policies"][1].update(name="llama_bpe"), "policies", "unique"),
    (lambda c: c.pop("policies"), "policies", "missing required"),
])
def test_bad_config_names_key_and_fix(tmp_path, edit, key, needle):
    data = support.tiny_config()
    edit(data)
    path = write_yaml(tmp_path, data)
    with pytest.raises(ConfigError) as e:
        load_yaml(RunConfig, path)
    msg = str(e.value)
    assert str(path) in msg and key in msg and needle in msg, msg


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(RunConfig, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(RunConfig, write_yaml(tmp_path, "rounds: [1,\n"))


def test_cli_reports_config_errors_with_exit_code(tmp_path, capsys):
    from mrl_jax.cli import main

    data = support.tiny_config()
    data["roundz"] = 3
    rc = main(["train", "--config", str(write_yaml(tmp_path, data)), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "roundz" in err and "Did you mean 'rounds'" in err


# ------------------------------------------------------------------------ bad models and tokenizers
@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory):
    """A local HF directory: a tiny llama whose embedding has 100 rows, and a trained tokenizer.json (~261)."""
    from mrl_jax import models
    from mrl_jax.tokenization import train_tokenizer
    from mrl_jax.trainer.loop import build_task, task_corpus

    d = tmp_path_factory.mktemp("hf")
    models.save_pretrained(models.tiny_model("llama", 100, hidden_size=32, num_layers=1, num_heads=2,
                                             num_kv_heads=1), d / "model")
    tok = train_tokenizer("byte_bpe", task_corpus(build_task(cfg_of())), 300)
    tok.save(d / "tokenizer")
    return d


def test_unsupported_model_type_names_file_and_supported(tmp_path, local_checkpoint):
    bert = tmp_path / "bert"
    shutil.copytree(local_checkpoint / "model", bert)
    hf = json.loads((bert / "config.json").read_text())
    hf["model_type"] = "bert"
    (bert / "config.json").write_text(json.dumps(hf))
    cfg = cfg_of(**{"policies.0.model": {"path": str(bert)},
                    "policies.0.tokenizer": {"path": str(local_checkpoint / "tokenizer")}})
    with pytest.raises(ConfigError) as e:
        Run(cfg)
    msg = str(e.value)
    assert "policies.llama_bpe.model.path" in msg and "config.json" in msg and "'bert'" in msg
    assert "supported model types" in msg and "llama" in msg


def test_tokenizer_larger_than_embedding_names_both(local_checkpoint):
    cfg = cfg_of(**{"policies.0.model": {"path": str(local_checkpoint / "model")},
                    "policies.0.tokenizer": {"path": str(local_checkpoint / "tokenizer")}})
    with pytest.raises(ConfigError) as e:
        Run(cfg)
    msg = str(e.value)
    assert "policies.llama_bpe.tokenizer.path" in msg and str(local_checkpoint / "tokenizer") in msg
    assert "only 100 rows" in msg and "Use the tokenizer saved with this model" in msg


def test_missing_tokenizer_file_names_key(tmp_path):
    cfg = cfg_of(**{"policies.0.tokenizer": {"path": str(tmp_path / "missing")}})
    with pytest.raises(ConfigError, match=r"policies\.llama_bpe\.tokenizer\.path"):
        Run(cfg)


# ---------------------------------------------------------------------------------- prompt lengths
def test_overlong_prompts_truncated_and_counted(tmp_path):
    # arith prompts are 12 Unigram tokens for gpt2_uni (with BOS): a limit of 10 truncates every prompt's text
    out = tmp_path / "trunc"
    cfg = cfg_of(**base_overrides(rounds=1, overlong_prompts="truncate", **{"policies.1.max_prompt_length": 10,
                                                                           "policies.0.probes": "none",
                                                                           "policies.1.probes": "none"}))
    summary = train(cfg, out, progress=False)
    assert summary["prompts"]["train_prompts_overlong"] > 0
    records = support.training_records(out)
    assert [r["data/prompts_truncated"] for r in records] == [4.0, 4.0]
    run = Run(cfg)
    inputs = run.round_inputs(0)
    assert inputs.counts["data/prompts_truncated"] == 4.0
    lengths = run._prompt_lengths([p.text for p in inputs.prompts])
    assert lengths[:, 1].max() <= 10
    assert all(p.text.endswith("=") for p in inputs.prompts)  # the tail (the question's end) is kept


def test_overlong_prompts_rejected_or_clear_error(tmp_path):
    from mrl_jax.tasks import JsonlTask

    lines = [{"prompt": f"add:{a}+{b}=", "answer": str(a + b)} for a in range(10, 40) for b in range(10, 13)]
    rng = np.random.default_rng(0)
    lines += [{"prompt": "add:" + "".join(map(str, rng.integers(0, 10, 150))) + "=", "answer": "0"} for _ in range(30)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    task = JsonlTask(str(path), seed=0)
    cfg = cfg_of(**{"policies.0.max_prompt_length": 24, "policies.1.max_prompt_length": 24})
    run = Run(cfg, task=task)
    assert run.prompt_stats["train_prompts_overlong"] > 0
    total = 0.0
    for r in range(6):
        inputs = run.round_inputs(r)
        assert len(inputs.prompts) == 4 and all(len(p.text) < 20 for p in inputs.prompts)
        total += inputs.counts["data/prompts_rejected"]
    assert total > 0
    assert run.round_inputs(3).prompts == run.round_inputs(3).prompts  # still a function of (seed, round)
    tight = cfg_of(**{"policies.0.max_prompt_length": 3})
    with pytest.raises(ConfigError) as e:
        Run(tight, task=task)
    assert "max_prompt_length" in str(e.value) and "overlong_prompts: truncate" in str(e.value)


# ------------------------------------------------------------------ degenerate completions and texts
def test_empty_and_non_roundtrip_completions_flow_through(tmp_path, monkeypatch):
    """Row 0 of every group ends at once (empty completion); row 1 of the byte-BPE policy is a lone UTF-8
    lead byte (text that does not survive retokenization): the run completes and THL reports them."""
    import mrl_jax.trainer.round as round_mod
    from mrl_jax.sampler import drive

    from mrl_jax.trainer.loop import build_task, task_corpus
    from mrl_jax.trainer.policy import build_tokenizer

    cfg = cfg_of(**base_overrides(rounds=2))
    tok = build_tokenizer(cfg.policies[0], task_corpus(build_task(cfg)))
    lead = next(i for i in range(tok.vocab_size) if tok.decode_bytes([i]) == b"\xc3")
    real_dispatch = round_mod._dispatch_rollout

    def dispatch(pol, ps, ids, mask, key):   # the real samples, then every 4th row empty, the next a lead byte
        out = jax.device_get(drive([real_dispatch(pol, ps, ids, mask, key)])[0])
        tokens, m = np.array(out.tokens), np.array(out.mask)
        eos, pad = pol.sampling.eos_id, pol.sampling.pad_id
        eos = eos[0] if isinstance(eos, tuple) else eos
        B, N = tokens.shape
        for b in range(0, B, 4):
            tokens[b, 0], tokens[b, 1:], m[b, 0], m[b, 1:] = eos, pad, True, False
        for b in range(1, B, 4):  # (in the Unigram policy's vocabulary the same id is some ordinary piece)
            tokens[b, 0], tokens[b, 1], tokens[b, 2:], m[b, :2], m[b, 2:] = lead, eos, pad, True, False
        lengths = m.sum(1).astype(np.int32)
        return out.replace(tokens=tokens, mask=m, lengths=lengths, truncated=np.zeros(B, bool),
                           logprobs=np.where(m, np.array(out.logprobs), 0.0).astype(np.float32))

    monkeypatch.setattr(round_mod, "_dispatch_rollout", dispatch)
    out = tmp_path / "degenerate"
    train(cfg, out, reward_specs=support.reward_specs(SIGNAL), progress=False)
    records = support.training_records(out)
    assert support.contiguity_problems(records, POLICIES, 2) == []
    assert all(np.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in records)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert any(s["completion"] == "" for s in samples)
    for r in records:
        assert any(k.startswith("thl/") for k in r), sorted(r)
    gpt2 = [r for r in records if r["policy"] == "gpt2_uni"]  # consumer of the byte-BPE texts (PRP)
    assert all(r["thl/src_non_roundtrip_texts"] > 0 for r in gpt2)
