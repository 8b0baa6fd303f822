"""Subprocess scenarios for tests/test_placement.py: ``mrl train`` with MWRA on forced CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/placement_worker.py main DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/placement_worker.py restore4 DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/placement_worker.py timeshare DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/placement_worker.py mp DIR PROCESS_ID PORT
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/placement_worker.py mpresume DIR PROCESS_ID PORT
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/placement_worker.py mpref DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=6 python tests/placement_worker.py invariance DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/placement_worker.py invariance_dynamic DIR

Writes one JSON object, the facts the test asserts on (tests/worker_result.py).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

if len(sys.argv) > 4 and sys.argv[1] in ("mp", "mpresume"):   # join the two-process run before any other JAX call
    from mrl_jax.mwra import initialize_distributed
    from mrl_jax.trainer.watchdog import Watchdog

    info = initialize_distributed(f"localhost:{sys.argv[4]}", 2, int(sys.argv[3]), heartbeat_timeout_s=10)
    Watchdog(Path(sys.argv[2]) / "mp", info.heartbeat_timeout_s).start()   # as `mrl train` does; stopped at exit

import numpy as np  # noqa: E402

import support  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker_result  # noqa: E402

support.enable_compile_cache()

from mrl_jax import mwra, sampler  # noqa: E402
from mrl_jax.tasks import RewardScorer  # noqa: E402
from mrl_jax.trainer.checkpoint import RunCheckpointer  # noqa: E402
from mrl_jax.trainer.loop import Run, train  # noqa: E402
from mrl_jax.trainer.round import run_round  # noqa: E402

COSTS = {"policies.0.cost": 1.0, "policies.1.cost": 3.0}
MWRA = {"min_size": 0}
SIGNAL = {"faulty": {"seed": 0, "p": {}}}   # support.digit_reward: a learning signal even for random tiny models   # shard every leaf the rules allow (the tiny model's leaves are all below the default)


def cfg_of(**overrides):
    return support.to_run_config(support.tiny_config(**{**COSTS, "mwra": dict(MWRA), **overrides}))


def sharded_leaves(states) -> int:
    """Array leaves split over more than one device (not fully replicated)."""
    return sum(isinstance(x, jax.Array) and not x.sharding.is_fully_replicated for x in jax.tree.leaves(states))


def leaves_on(state, mesh) -> bool:
    """Every array leaf of params / opt state (/ ref) lives only on ``mesh``'s devices."""
    ids = {d.id for d in mesh.devices.flat}
    trees = (state.params, state.opt_state) + (() if state.ref_params is None else (state.ref_params,))
    return all({d.id for d in x.sharding.device_set} <= ids for x in jax.tree.leaves(trees)
               if isinstance(x, jax.Array))


def final_params(out: Path) -> list:
    ck = RunCheckpointer(out)
    try:
        tree, _ = ck.read()
    finally:
        ck.close()
    return [np.asarray(x) for x in jax.tree.leaves(tree["policies"])]



def metrics_rows(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main(root: Path) -> dict:
    res: dict = {"num_devices": len(jax.devices())}
    # -- placement after round 0 and after a resume (ref params too: policy 0 has beta > 0 in a built run)
    cfg1 = cfg_of(rounds=1)
    t = time.perf_counter()
    s1 = train(cfg1, root / "eight", progress=False)
    res["time_first_train_s"] = time.perf_counter() - t
    plan = json.loads((root / "eight" / "plan.json").read_text())
    res["plan_devices"] = [p["device_ids"] for p in plan["policies"]]
    res["summary_plan_devices"] = [p["device_ids"] for p in s1["plan"]["policies"]]
    res["placement_round0"] = {n: p["placement"] for n, p in s1["policies"].items()}
    s2 = train(cfg_of(rounds=2), root / "eight", resume=True, progress=False)
    res["placement_resumed"] = {n: p["placement"] for n, p in s2["policies"].items()}
    res["plan_txt"] = (root / "eight" / "plan.txt").read_text()

    # -- every leaf on its mesh (params, opt state, ref params) in a built run and after one round
    run = Run(cfg_of(**{"policies.0.grpo": {"beta": 0.04}}))
    built = run.initial_state()
    res["ref_held"] = built.policies[0].ref_params is not None
    res["leaves_on_mesh_built"] = [leaves_on(s, m) for s, m in zip(built.policies, run.placement.meshes)]

    # -- one whole round under transfer_guard("disallow") (device parts), timestamps of dispatch / ready
    run = Run(cfg_of())
    with RewardScorer(support.reward_specs({"faulty": {"seed": 0, "p": {}}})) as scorer:
        state, metrics, _ = run_round(run.policies, run.initial_state(), run.round_inputs(0), scorer,
                                      device_guard="disallow")
    res["guard_round_ok"] = True
    res["leaves_on_mesh_round0"] = [leaves_on(s, m) for s, m in zip(state.policies, run.placement.meshes)]
    res["sharded_leaves_round0"] = sharded_leaves(state.policies)
    names = [p.name for p in run.policies]
    res["stamps"] = {n: {k: v for k, v in metrics[n].items() if k.startswith("time/") and
                         k.split("/")[1].startswith(("rollout_", "update_"))} for n in names}
    res["names"] = names
    try:   # the guard is real: an implicit host->device transfer into a pinned step raises
        with jax.transfer_guard("disallow"):
            pol = run.policies[0]
            ids = np.zeros((4, 3), np.int32)
            whole = sampler.round_program(pol.graphdef, pol.sampling, pol.num_generations,
                                                (4 * pol.num_generations,), 3, 0,
                                                mwra.row_sharding(pol.mesh))   # the sampler's pinned round
            whole(state.policies[0].params, ids, ids.astype(bool), jax.random.key(0))
        res["guard_catches_implicit"] = False
    except Exception as e:  # noqa: BLE001
        res["guard_catches_implicit"] = "transfer" in str(e).lower() or "disallow" in str(e).lower()

    return res


def jsonl_rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def invariance_case(root: Path, devices: int, prompts: int) -> dict:
    """The same 2-round config, ``prompts`` prompts per round, on ``devices`` devices (half each policy) and on
    one device: per-row rewards of round 0 (every sample), logged samples, round-0 metrics, final params."""
    over = {"rounds": 2, "prompts_per_round": prompts}
    many = support.tiny_config(**over, **{"policies.0.devices": devices // 2, "policies.1.devices": devices // 2})
    many["mwra"] = {**MWRA, "devices": devices}
    one = support.tiny_config(**over)
    one["mwra"] = {**MWRA, "devices": 1}
    runs = {"many": root / f"many{devices}", "one": root / f"one{devices}"}
    for name, d in (("many", many), ("one", one)):   # digit reward: non-zero advantages, so the params move
        train(support.to_run_config(d), runs[name], reward_specs=support.reward_specs(SIGNAL), progress=False)
    plans = {k: [p["device_ids"] for p in json.loads((d / "plan.json").read_text())["policies"]]
             for k, d in runs.items()}
    groups = {k: {r["policy"]: r["rewards"] for r in jsonl_rows(d / "groups.jsonl") if r["round"] == 0}
              for k, d in runs.items()}
    samples = {k: [s for s in jsonl_rows(d / "samples.jsonl") if s["round"] == 0] for k, d in runs.items()}
    metrics = {k: {r["policy"]: r for r in metrics_rows(d) if r.get("round") == 0} for k, d in runs.items()}
    diffs = {f"{n}/{k}": abs(float(metrics["many"][n][k]) - float(metrics["one"][n][k]))
             for n in metrics["one"] for k in ("loss", "kl", "grad_norm", "reward/mean", "completion/mean_length")
             if k in metrics["one"][n]}
    pa, pb = final_params(runs["many"]), final_params(runs["one"])
    return {"plans": plans, "groups_equal": groups["many"] == groups["one"],
            "reward_sum": float(sum(np.sum(r) for r in groups["one"].values())),
            "grad_norms": [float(m.get("grad_norm", 0.0)) for m in metrics["one"].values()],
            "group_rows": sum(len(r) * len(r[0]) for r in groups["one"].values()), "round0_metric_diffs": diffs,
            "samples_equal": samples["many"] == samples["one"],
            "final_param_max_diff": support.max_difference(pa, pb)}


def invariance(root: Path) -> dict:
    """5 prompts on 6 devices (3 + 3) against one device: no policy's data axis divides P, so every mesh pads its
    prompt rows."""
    return {"num_devices": len(jax.devices()), **invariance_case(root, 6, 5)}


def _half_uniform(prompt, completion):
    """0 on even prompt ids (uniform for every policy: dynamic sampling replaces them), else length parity."""
    return float(len(completion) % 2) if prompt.id % 2 else 0.0


def invariance_dynamic(root: Path) -> dict:
    """Dynamic sampling (oversampled batches) on 4 devices (2 + 2, 5 prompts: padded rows) and on one device:
    the kept batch's rows and rewards, its counters, and the final params."""
    from mrl_jax.tasks import RewardSpec

    over = {"rounds": 2, "prompts_per_round": 5, "dynamic_sampling": {"enable": True, "max_num_gen_batches": 3},
            "policies.0.probes": "none", "policies.1.probes": "none"}   # a peer-reading probe keeps all-fail groups
    many = support.tiny_config(**over, **{"policies.0.devices": 2, "policies.1.devices": 2})
    many["mwra"] = {**MWRA, "devices": 4}
    one = support.tiny_config(**over)
    one["mwra"] = {**MWRA, "devices": 1}
    runs = {"many": root / "ds_many", "one": root / "ds_one"}
    for name, d in (("many", many), ("one", one)):
        train(support.to_run_config(d), runs[name], reward_specs=[RewardSpec(_half_uniform, name="half")],
              progress=False)
    groups = {k: [(r["policy"], r["round"], r["prompt_ids"], r["rewards"]) for r in jsonl_rows(d / "groups.jsonl")]
              for k, d in runs.items()}
    batches = [r.get("dynamic_sampling/generated_batches", 0) for r in metrics_rows(runs["one"])]
    pa, pb = final_params(runs["many"]), final_params(runs["one"])
    return {"groups_equal": groups["many"] == groups["one"], "groups": len(groups["one"]),
            "generated_batches": batches, "final_param_max_diff": support.max_difference(pa, pb)}


def by_path(tree) -> dict:
    """``{path: numpy array}`` with nnx's ``value`` components dropped (the saved tree spells them out)."""
    return {"/".join(c for c in mwra.path_str(p).split("/") if c != "value"): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def restore4(root: Path) -> dict:
    """Restore the 8-device run's checkpoint on 4 devices: values equal, every leaf on the new plan's meshes."""
    out = root / "eight"
    run = Run(cfg_of(rounds=2))
    ck = RunCheckpointer(out)
    try:
        saved, meta = ck.read()
        state, _ = ck.restore(run.state_template())   # straight onto the 4-device plan's shardings (no run.place)
    finally:
        ck.close()
    want, got = by_path(saved["policies"]), by_path(state.policies)
    return {"num_devices": len(jax.devices()), "round": meta["round"], "leaves": len(got),
            "plan_devices": [list(p.device_ids) for p in run.placement.plan.policies],
            "equal": want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want),
            "leaves_on_mesh": [leaves_on(s, m) for s, m in zip(state.policies, run.placement.meshes)],
            "sharded_leaves": sharded_leaves(state.policies),
            "param_devices": [sorted(mwra.devices_of((s.params, s.opt_state))) for s in state.policies]}


def timeshare(root: Path) -> dict:
    """3 policies on 2 devices (time_share: pack, equal costs): policy i on device i % 2, one round runs."""
    d = support.tiny_config(rounds=1)
    d["policies"].append({**d["policies"][0], "name": "third"})
    for p in d["policies"]:
        p["cost"] = 1.0
    d["report_to"] = ["jsonl"]
    s = train(support.to_run_config(d), root / "share", progress=False)
    return {"num_devices": len(jax.devices()), "mode": s["plan"]["mode"],
            "placement": {n: p["placement"] for n, p in s["policies"].items()},
            "shares_with": {p["name"]: p["shares_with"] for p in s["plan"]["policies"]},
            "rounds_logged": len({r["round"] for r in metrics_rows(root / "share")})}


def mp_config():
    """8 global devices (4 per process): llama_bpe on the first 6 (all of process 0's and 2 of process 1's: a
    mesh spanning both processes; 6 sampler slots, fewer than its rows, so rows enter as slots free across the
    processes), gpt2_uni on the last 2 (inside process 1)."""
    d = support.tiny_config(rounds=3, **{"policies.0.devices": 6, "policies.1.devices": 2,
                                       "policies.0.sampling.slots": 6,
                                       "policies.0.grpo": {"beta": 0.04}})   # a KL reference on the spanning mesh
    d["mwra"] = dict(MWRA)
    d["report_to"] = ["jsonl"]
    return support.to_run_config(d)


def mp(root: Path) -> dict:
    """The whole run (the test kills process 1 after the first checkpoint)."""
    s = train(mp_config(), root / "mp", progress=False)
    return {"process": jax.process_index(), "rounds": s["rounds"]}


def mpresume(root: Path) -> dict:
    """Resumed to the config's 3 rounds (restore onto the host, then placed on the meshes)."""
    s = train(mp_config(), root / "mp", resume=True, progress=False)
    return {"process": jax.process_index(), "num_devices": len(jax.devices()), "resumed_from": s["resumed_from"],
            "local_devices": [d.id for d in jax.local_devices()],
            "placement": {n: p["placement"] for n, p in s["policies"].items()}}


def mpref(root: Path) -> dict:
    s = train(mp_config(), root / "ref", progress=False)
    return {"num_devices": len(jax.devices()), "placement": {n: p["placement"] for n, p in s["policies"].items()}}


if __name__ == "__main__":
    mode, root = sys.argv[1], Path(sys.argv[2])
    result = {"main": main, "restore4": restore4, "timeshare": timeshare, "mp": mp, "mpresume": mpresume,
              "mpref": mpref, "invariance": invariance, "invariance_dynamic": invariance_dynamic}[mode](root)
    worker_result.write(result)
