"""``mrl train`` with MWRA end to end (issue 13): the plan from the config (fake devices, in process), and in
subprocesses with forced CPU devices (tests/placement_worker.py): placement after round 0 and after a resume,
a round under ``jax.transfer_guard("disallow")``, dispatch order, samples and params independent of the device
count (P dividing no data axis), and restoring an 8-device checkpoint onto 4 devices."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import worker_result
import support
from mrl_jax.configs import ConfigError
from mrl_jax.trainer.placement import config_rules, pad_prompts, plan_run

WORKER = Path(__file__).with_name("placement_worker.py")
REPO = WORKER.parent.parent


class FakeDevice:
    def __init__(self, i: int):
        self.id, self.process_index, self.platform = i, 0, "fake"

    def memory_stats(self):
        return None


def fakes(n):
    return [FakeDevice(i) for i in range(n)]


def cfg(**overrides):
    return support.to_run_config(support.tiny_config(**overrides))


# ------------------------------------------------------------------------- the plan (in process)
def test_costs_1_3_on_8_devices_gives_2_and_6():
    p = plan_run(cfg(**{"policies.0.cost": 1.0, "policies.1.cost": 3.0}), [1000, 1000], [5.0, 5.0], fakes(8))
    assert [q.device_ids for q in p.policies] == [(0, 1), (2, 3, 4, 5, 6, 7)]
    assert p.mode == "disjoint"


def test_cost_is_params_times_tokens_per_round():
    # 3x the parameters -> 3x the cost -> 2 and 6 devices
    p = plan_run(cfg(), [1000, 3000], [4.0, 4.0], fakes(8))
    assert [q.num_devices for q in p.policies] == [2, 6]
    c = cfg()
    assert p.policies[0].cost == 1000 * c.prompts_per_round * c.num_generations * (4.0 + 6)


def test_device_overrides_counts_and_ids():
    p = plan_run(cfg(**{"policies.0.devices": [6, 7], "policies.1.devices": 3}), [1, 1], [1, 1], fakes(8))
    assert [q.device_ids for q in p.policies] == [(6, 7), (0, 1, 2)]
    p = plan_run(cfg(**{"policies.0.devices": 1}), [1, 1], [1, 1], fakes(8))
    assert [q.device_ids for q in p.policies] == [(0,), (1, 2, 3, 4, 5, 6, 7)]
    p = plan_run(cfg(mwra={"devices": 4}), [1, 3], [1, 1], fakes(8))
    assert [q.device_ids for q in p.policies] == [(0,), (1, 2, 3)]


@pytest.mark.parametrize("overrides, key, words", [
    ({"policies.0.devices": [0, 1], "policies.1.devices": [1, 2]}, "policies.gpt2_uni.devices", "overlap"),
    ({"policies.0.devices": [9]}, "policies.llama_bpe.devices", "does not exist"),
    ({"policies.0.devices": 5, "policies.1.devices": 4}, "policies[*].devices", "remain"),
    ({"mwra": {"devices": 16}}, "mwra.devices", "only 8 exist"),
    ({"mwra": {"rules": [["kernel", "sideways"]]}}, "mwra.rules[0]", "spec"),
    ({"mwra": {"time_share": "spread"}}, "mwra.time_share", "not one of"),
])
def test_placement_errors_are_one_line_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        plan_run(cfg(**overrides), [10_000, 10_000], [4.0, 4.0], fakes(8))
    msg = str(e.value)
    assert f"'{key}'" in msg and words in msg and "\n" not in msg, msg


def test_time_share_pack_on_fewer_devices():
    three = support.tiny_config()
    three["policies"].append({**three["policies"][0], "name": "third"})
    p = plan_run(support.to_run_config(three), [1, 1, 1], [1, 1, 1], fakes(2))
    assert p.mode == "time_share:pack" and [q.device_ids for q in p.policies] == [(0,), (1,), (0,)]
    three["mwra"] = {"time_share": "full"}
    p = plan_run(support.to_run_config(three), [1, 1, 1], [1, 1, 1], fakes(2))
    assert [q.device_ids for q in p.policies] == [(0, 1)] * 3


def test_config_rules_and_padding():
    from jax.sharding import PartitionSpec

    from mrl_jax import mwra

    rules = config_rules([["embed", "replicated"], ["kernel", [None, "data"]], ["head", "fsdp"]])
    assert rules[:3] == (("embed", mwra.REPLICATED), ("kernel", PartitionSpec(None, "data")), ("head", mwra.FSDP))
    assert rules[3:] == tuple(mwra.DEFAULT_RULES)
    import numpy as np

    ids, mask = np.arange(8).reshape(4, 2), np.ones((4, 2), bool)
    pi, pm = pad_prompts(ids, mask, 6)
    assert pi.shape == (6, 2) and (pi[4:] == ids[-1]).all() and (pi[:4] == ids).all() and pm.all()
    assert pad_prompts(ids, mask, 2)[0] is ids


# ------------------------------------------------------------------ forced devices (subprocesses)
def _worker(mode: str, root: Path, devices: int, timeout: int = 600) -> dict:
    result = root / f"{mode}.result.json"
    env = worker_result.env_for(dict(support.forced_devices_env(devices), **support.compile_cache_env()), result)
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(root)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return worker_result.read(result, proc.stdout)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    root = tmp_path_factory.mktemp("placement")
    return root, _worker("main", root, 8)


def test_placement_on_8_devices_after_round0_and_resume(eight):
    _, r = eight
    assert r["num_devices"] == 8
    assert r["plan_devices"] == [[0, 1], [2, 3, 4, 5, 6, 7]] == r["summary_plan_devices"]
    for key in ("placement_round0", "placement_resumed"):
        pl = r[key]
        assert pl["llama_bpe"] == {"devices": [0, 1], "param_devices": [0, 1]}
        assert pl["gpt2_uni"] == {"devices": [2, 3, 4, 5, 6, 7], "param_devices": [2, 3, 4, 5, 6, 7]}
    assert r["ref_held"] and r["leaves_on_mesh_built"] == [True, True]
    assert r["leaves_on_mesh_round0"] == [True, True]
    assert r["sharded_leaves_round0"] > 0   # mwra.min_size 0: FSDP really splits leaves over the meshes
    assert "MWRA plan: 2 policies on 8 cpu device(s)" in r["plan_txt"]
    # each sampler's S covers its rows, P padded to its data axis (4 prompts x G 4 on 2 devices; 6 prompts on 6)
    assert re.findall(r"sampler (\w+): S = (\d+) decode slots for \d+ rows a round \(every row\); rungs ([\d, ]+)",
                      r["plan_txt"]) == [("llama_bpe", "16", "16"), ("gpt2_uni", "24", "24")]   # 6 tokens: short


def test_round_under_transfer_guard_disallow(eight):
    _, r = eight
    assert r["guard_round_ok"] is True
    assert r["guard_catches_implicit"] is True   # the guard is live: an implicit transfer would have raised


def test_second_rollout_dispatched_before_first_result_is_read(eight):
    _, r = eight
    first, second = (r["stamps"][n] for n in r["names"])
    assert second["time/rollout_dispatched"] <= first["time/rollout_read"]
    assert second["time/update_dispatched"] <= first["time/update_read"]
    for s in (first, second):
        assert s["time/rollout_dispatched"] <= s["time/rollout_read"] <= s["time/rollout_ready"]
        assert s["time/update_dispatched"] <= s["time/update_read"] <= s["time/update_ready"]


@pytest.mark.slow
def test_samples_do_not_depend_on_the_device_count(tmp_path):
    """5 prompts on 6 devices (3 + 3): P divides no policy's data axis (padded rows on every mesh). Every round-0
    sample of both policies (per-row rewards, logged completions) equals the 1-device run's, the metrics agree and
    the final params after 2 rounds stay within 1e-4 (the sharded update's reduction order)."""
    r = _worker("invariance", tmp_path, 6, timeout=1500)   # two 2-round runs
    assert r["plans"]["one"] == [[0], [0]] and r["plans"]["many"] == [[0, 1, 2], [3, 4, 5]], r["plans"]
    assert r["group_rows"] == 2 * 5 * 4 and r["groups_equal"] and r["samples_equal"]
    assert len(r["round0_metric_diffs"]) >= 6 and max(r["round0_metric_diffs"].values()) <= 1e-5, r["round0_metric_diffs"]
    assert r["reward_sum"] > 0 and min(r["grad_norms"]) > 0   # the samples and the updates carry signal
    assert r["final_param_max_diff"] <= 1e-4, r["final_param_max_diff"]


@pytest.mark.slow
def test_dynamic_sampling_does_not_depend_on_the_device_count(tmp_path):
    """Oversampled batches (dynamic sampling) on 4 devices (2 + 2, 5 prompts: padded rows) equal the 1-device
    run's: every kept group's prompt ids and rewards, and the final params within 1e-4."""
    r = _worker("invariance_dynamic", tmp_path, 4, timeout=1500)
    assert r["groups"] == 4 and r["groups_equal"], r
    assert max(r["generated_batches"]) > 1, r["generated_batches"]   # the rounds did oversample
    assert r["final_param_max_diff"] <= 1e-4, r["final_param_max_diff"]


def test_restore_8_device_checkpoint_on_4_devices(eight):
    root, _ = eight
    r = _worker("restore4", root, 4)
    assert r["num_devices"] == 4 and r["round"] == 1
    assert r["plan_devices"] == [[0], [1, 2, 3]]
    assert r["leaves"] > 0 and r["equal"] is True
    assert r["leaves_on_mesh"] == [True, True] and r["sharded_leaves"] > 0   # restored straight onto the plan
    assert r["param_devices"] == [[0], [1, 2, 3]]


def test_time_share_3_policies_on_2_devices_follow_the_packing(tmp_path):
    r = _worker("timeshare", tmp_path, 2)
    assert r["num_devices"] == 2 and r["mode"] == "time_share:pack" and r["rounds_logged"] == 1
    # equal costs: policy i on device i % D (allocation.py's documented packing)
    assert r["placement"] == {"llama_bpe": {"devices": [0], "param_devices": [0]},
                              "gpt2_uni": {"devices": [1], "param_devices": [1]},
                              "third": {"devices": [0], "param_devices": [0]}}
    assert r["shares_with"] == {"llama_bpe": ["third"], "gpt2_uni": [], "third": ["llama_bpe"]}


def _start_two(mode: str, root: Path) -> tuple[list, list]:
    """placement_worker ``mode`` as 2 local CPU processes x 4 forced devices (gloo); (processes, result paths)."""
    port = support.free_port()
    env = dict(support.forced_devices_env(4), **support.compile_cache_env())
    paths = [root / f"{mode}{i}.result.json" for i in range(2)]
    return [subprocess.Popen([sys.executable, str(WORKER), mode, str(root), str(i), str(port)],
                             env=worker_result.env_for(env, paths[i]), cwd=str(REPO), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)], paths


def _stop_and_read(procs: list) -> list[str]:
    """Each process's stderr tail once every one has stopped: a live peer of a dead one is killed first (it would
    wait for the dead one's collectives, and reading its pipes would wait with it)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    return [p.communicate(timeout=60)[1][-3000:] for p in procs]


def _kill_after_first_checkpoint(procs: list, ckpts: Path, timeout: float = 900) -> None:
    """kill -9 process 1 once the run's first checkpoint is complete (orbax's bare step folder)."""
    deadline = time.monotonic() + timeout
    while not (ckpts / "0").is_dir():
        assert all(p.poll() is None for p in procs), _stop_and_read(procs)
        assert time.monotonic() < deadline, "no checkpoint of round 0"
        time.sleep(0.1)
    procs[1].kill()


def _metrics_close(a: Path, b: Path, tol: float = 1e-5) -> None:
    """Two runs' metrics.jsonl: same records and keys, numbers within ``tol`` (relative) -- the spanning update's
    reductions (entropy) run in another order than on one process; wall-clock figures dropped."""
    ra = [support.strip_times(r) for r in support.read_jsonl(a / "metrics.jsonl")]
    rb = [support.strip_times(r) for r in support.read_jsonl(b / "metrics.jsonl")]
    assert len(ra) == len(rb) and [sorted(x) for x in ra] == [sorted(y) for y in rb]
    for x, y in zip(ra, rb):
        for k, v in x.items():
            if isinstance(v, float):
                assert abs(v - y[k]) <= tol * max(1.0, abs(v)), (k, v, y[k])
            else:
                assert v == y[k], k


def test_two_processes_spanning_policy_survive_a_lost_process(tmp_path):
    """`mrl train` under jax.distributed: 2 local CPU processes x 4 forced devices (gloo, 10 s heartbeat);
    llama_bpe's mesh (with a KL reference and the slot sampler at 6 slots, fewer than its rows) spans both
    processes (6 devices: 4 + 2), gpt2_uni's lies inside process 1 (2 devices).
    Process 1 is killed (-9) after the first checkpoint: process 0 prints one line naming it, the intact
    checkpoint and the resume, and exits with `LOST_EXIT_CODE` (its `trainer.watchdog.Watchdog`). Both resumed to 3 rounds equal an
    uninterrupted single-process 8-device run: the same records (no duplicate, none missing), final params
    within 1e-5."""
    sys.path.insert(0, str(WORKER.parent))
    from placement_worker import by_path

    from mrl_jax.trainer.checkpoint import RunCheckpointer
    from mrl_jax.trainer.watchdog import LOST_EXIT_CODE

    procs, _ = _start_two("mp", tmp_path)
    try:
        _kill_after_first_checkpoint(procs, tmp_path / "mp" / "checkpoints")
        _, err0 = procs[0].communicate(timeout=300)
    finally:
        for p in procs:
            p.kill()
    lines = [ln for ln in err0.splitlines() if ln.startswith("mrl train: process 1 of 2 stopped answering")]
    assert procs[0].returncode == LOST_EXIT_CODE and len(lines) == 1, err0[-4000:]
    assert re.search(r"the checkpoint of round \d+ in .*checkpoints is intact", lines[0]) and "--resume" in lines[0]

    procs, paths = _start_two("mpresume", tmp_path)
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    results = [worker_result.read(path, out) for path, (out, _) in zip(paths, outs)]
    assert [r["process"] for r in results] == [0, 1] and all(r["num_devices"] == 8 for r in results)
    assert len({r["resumed_from"] for r in results}) == 1 and results[0]["resumed_from"] in (0, 1)
    local = [sorted(r["local_devices"]) for r in results]
    for r in results:   # read back from the arrays on both processes
        pl = r["placement"]
        assert pl["llama_bpe"]["param_devices"] == pl["llama_bpe"]["ref_devices"] == sorted(local[0] + local[1][:2])
        assert pl["gpt2_uni"]["param_devices"] == local[1][2:]
    ref = _worker("mpref", tmp_path, 8)
    assert ref["placement"]["llama_bpe"]["devices"] == [0, 1, 2, 3, 4, 5]
    assert set(support.record_differences(tmp_path / "mp", tmp_path / "ref")) <= {"metrics.jsonl"}   # samples, groups
    _metrics_close(tmp_path / "mp", tmp_path / "ref")

    def final(run_dir):
        ck = RunCheckpointer(run_dir)
        try:
            tree, meta = ck.read()
        finally:
            ck.close()
        return by_path(tree["policies"]), meta["round"]

    (a, ra), (b, rb) = final(tmp_path / "mp"), final(tmp_path / "ref")
    assert ra == rb == 2 and a.keys() == b.keys() and len(a) > 0
    assert support.max_difference([a[k] for k in a], [b[k] for k in a]) <= 1e-5
    assert (tmp_path / "mp" / "summary.json").exists()   # written by process 0 only


def test_lost_process_line_names_the_process_and_the_complete_checkpoint(tmp_path, monkeypatch):
    """The survivor's line: the dead processes, the newest *complete* checkpoint (orbax's temporary folder of a
    later round ignored), the resume command; a coordinator that stops answering is named as such."""
    from mrl_jax.trainer.watchdog import lost_process_line

    monkeypatch.setattr(sys, "argv", ["/usr/bin/mrl", "train", "--config", "run.yaml", "--out", str(tmp_path)])
    for name in ("2", "3", "4.orbax-checkpoint-tmp-17", "notes"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    line = lost_process_line([1], tmp_path)
    assert line.startswith("mrl train: process 1 of ") and "\n" not in line
    assert f"checkpoint of round 3 in {tmp_path / 'checkpoints'} is intact" in line
    assert line.endswith(f"restart every process with mrl train --config run.yaml --out {tmp_path} --resume")
    assert lost_process_line([1, 3], tmp_path).startswith("mrl train: process 1, 3 of ")
    line = lost_process_line(None, tmp_path / "new")
    assert "the coordinator (process 0) or another process" in line and "no checkpoint was complete yet" in line
