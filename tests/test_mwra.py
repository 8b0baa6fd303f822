"""MWRA: allocation (pure logic, fake devices), sharding rules, dispatch, distributed start-up -- in process;
placement, 4-vs-1-device equivalence and two-process jax.distributed runs -- in subprocesses
(tests/mwra_worker.py) with XLA_FLAGS=--xla_force_host_platform_device_count=N, so this process keeps its
single CPU device."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import worker_result
import support
from mrl_jax import mwra
from mrl_jax.mwra import allocate, plan, proportional_split

WORKER = Path(__file__).with_name("mwra_worker.py")
REPO = WORKER.parent.parent


class FakeDevice:
    def __init__(self, i: int, process_index: int = 0):
        self.id, self.process_index, self.platform = i, process_index, "fake"

    def __repr__(self):
        return f"FakeDevice({self.id}@{self.process_index})"


class FakeMesh:
    """Enough of a Mesh for `spec_for` (axis names and sizes)."""

    def __init__(self, **shape):
        self.shape, self.axis_names = dict(shape), tuple(shape)


def fakes(n: int, hosts: int = 1):
    return [FakeDevice(i, i % hosts) for i in range(n)]


# ---------------------------------------------------------------- allocation (pure logic)
def test_costs_1_3_on_8_devices_gives_2_and_6():
    assert proportional_split([1.0, 3.0], 8) == [2, 6]
    p = plan([1.0, 3.0], fakes(8))
    assert p.mode == "disjoint"
    assert [q.device_ids for q in p.policies] == [(0, 1), (2, 3, 4, 5, 6, 7)]
    assert [q.mesh_shape for q in p.policies] == [(2,), (6,)]


def test_largest_remainder_and_floor_of_one():
    assert proportional_split([1, 2, 3, 4], 7) == [1, 1, 2, 3]
    assert proportional_split([1, 1, 100], 4) == [1, 1, 2]  # floors of 1 taken from the largest
    assert proportional_split([1, 1, 1], 3) == [1, 1, 1]
    assert proportional_split([2, 1], 4) == [3, 1]  # quotas 2.67 / 1.33


@settings(max_examples=150, deadline=None)
@given(costs=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=6), extra=st.integers(0, 12))
def test_split_properties(costs, extra):
    d = len(costs) + extra
    alloc = proportional_split(costs, d)
    assert sum(alloc) == d and min(alloc) >= 1
    quota = [d * c / sum(costs) for c in costs]
    if min(quota) >= 1:  # no floor needed: plain largest remainder, within one device of the quota
        assert all(abs(a - q) < 1 + 1e-9 for a, q in zip(alloc, quota))
    p = plan(costs, fakes(d))
    ids = [i for q in p.policies for i in q.device_ids]
    assert sorted(ids) == list(range(d))  # disjoint and covering


def test_slices_stay_within_a_host():
    # ids interleaved across two hosts: devices are ordered by (process, id) before slicing
    p = plan([1.0, 1.0], fakes(8, hosts=2))
    owners = [{i % 2 for i in q.device_ids} for q in p.policies]
    assert owners == [{0}, {1}]


def test_time_share_pack_round_robin_and_by_cost():
    p = plan([1.0, 1.0, 1.0], fakes(2), names=["a", "b", "c"])
    assert p.mode == "time_share:pack"
    assert [q.device_ids for q in p.policies] == [(0,), (1,), (0,)]
    assert [q.shares_with for q in p.policies] == [("c",), (), ("a",)]
    # largest cost first onto the least-loaded device: the big policy keeps a device to itself
    p = plan([1.0, 5.0, 1.0], fakes(2))
    assert [q.device_ids for q in p.policies] == [(1,), (0,), (1,)]


def test_time_share_full():
    p = plan([1.0, 2.0, 3.0], fakes(2), time_share="full")
    assert p.mode == "time_share:full"
    assert all(q.device_ids == (0, 1) for q in p.policies)


@pytest.mark.parametrize("costs, match", [
    ([], "empty"),
    ([1.0, 0.0], "finite number > 0"),
    ([1.0, -2.0], "finite number > 0"),
    ([float("nan")], "finite number > 0"),
    ([float("inf"), 1.0], "finite number > 0"),
    (["x"], "sequence of numbers"),
])
def test_invalid_costs(costs, match):
    with pytest.raises(ValueError, match=match):
        plan(costs, fakes(4))


def test_invalid_requests_name_the_fix():
    with pytest.raises(ValueError, match="no devices"):
        plan([1.0], [])
    with pytest.raises(ValueError, match="one per policy"):
        plan([1.0, 2.0], fakes(4), names=["only-one"])
    with pytest.raises(ValueError, match="time_share"):
        plan([1.0, 2.0, 3.0], fakes(2), time_share="round")
    with pytest.raises(ValueError, match="needs param_counts"):
        plan([1.0], fakes(2), memory_bytes=1 << 30)
    with pytest.raises(ValueError, match="duplicates"):
        d = fakes(2)
        plan([1.0], d + d[:1])


def test_memory_check():
    gib = 1 << 30
    # 1.5B params -> 16 B/param = 24 GB: fits on 6 x 16 GiB, not on 1 x 16 GiB
    p = plan([1.0, 3.0], fakes(8), param_counts=[5 * 10**8, 15 * 10**8], memory_bytes=16 * gib)
    assert p.policies[1].memory_bytes_per_device == mwra.estimate_memory_bytes(15 * 10**8, 6)
    assert mwra.estimate_memory_bytes(10**9, 2) == math.ceil(16 * 10**9 / 2)
    assert mwra.estimate_memory_bytes(10**9, 2, activation_bytes=10**9) == math.ceil(17 * 10**9 / 2)
    assert mwra.estimate_memory_bytes(10**9, 1, activation_bytes=0) == 16 * 10**9
    with pytest.raises(ValueError, match=r"needs >= 2 device\(s\).*add devices"):
        plan([3.0, 1.0], fakes(2), param_counts=[15 * 10**8, 10**6], memory_bytes=16 * gib)
    # time-sharing one device: the residents add up, and the fix offered is time_share='full'
    with pytest.raises(ValueError, match="do not fit together.*time_share='full'"):
        plan([1.0, 1.0, 1.0], fakes(2), param_counts=[6 * 10**8] * 3, memory_bytes=16 * gib)
    plan([1.0, 1.0, 1.0], fakes(2), param_counts=[6 * 10**8] * 3, memory_bytes=16 * gib, time_share="full")


def test_plan_table_and_dict():
    p = plan([0.5e9, 1.5e9], fakes(8), param_counts=[494_032_768, 1_543_714_304],
             names=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    text = str(p)
    assert "qwen2.5-1.5b" in text and "2-7" in text and "GiB" in text and "mode=disjoint" in text
    d = json.loads(json.dumps(p.to_dict()))
    assert d["policies"][0]["device_ids"] == [0, 1] and d["policies"][1]["mesh_shape"] == [6]
    assert abs(sum(q["cost_share"] for q in d["policies"]) - 1) < 1e-9


def test_allocate_on_real_device_in_process():
    meshes = allocate([1.0, 2.0], jax.devices()[:1])  # one CPU device here: time-share it
    assert len(meshes) == 2 and all(isinstance(m, Mesh) for m in meshes)
    assert all(m.devices.size == 1 and m.axis_names == ("data",) for m in meshes)
    m = allocate([1.0], axis_names=("data", "model"))[0]
    assert m.axis_names == ("data", "model") and m.devices.shape == (len(jax.devices()), 1)


# ---------------------------------------------------------------- sharding rules
def test_spec_rules():
    m8 = FakeMesh(data=8)
    spec = lambda path, shape, **kw: mwra.spec_for(path, shape, m8, min_size=0, **kw)  # noqa: E731
    assert spec("layers/0/mlp/up_proj/kernel", (64, 128)) == P(None, "data")  # largest divisible dim
    assert spec("embed/embedding", (1000, 64)) == P("data")  # both divisible: the largest dim wins
    assert spec("embed/embedding", (1001, 64)) == P(None, "data")
    assert spec("lm_head/kernel", (64, 1000)) == P(None, "data")
    assert spec("layers/0/attn/q_proj/kernel", (63, 63)) == P()  # nothing divisible: replicated
    assert spec("layers/0/attn/q_proj/bias", (64,)) == P()
    assert spec("layers/0/input_layernorm/scale", (64,)) == P()
    assert spec("final_norm/weight", (64,)) == P()
    assert mwra.spec_for("layers/0/kernel", (64, 128), m8) == P()  # below DEFAULT_MIN_SIZE
    assert mwra.spec_for("w", (512, 256), FakeMesh(data=2, fsdp=4), min_size=0) == P(("data", "fsdp"))
    rules = ((r"q_proj/kernel$", P("data", None)), (r".*", mwra.FSDP))
    assert mwra.spec_for("a/q_proj/kernel", (64, 8), m8, rules, min_size=0) == P("data", None)
    with pytest.raises(ValueError, match="not divisible"):
        mwra.spec_for("a/q_proj/kernel", (60, 8), m8, rules, min_size=0)
    with pytest.raises(ValueError, match="rank"):
        mwra.spec_for("a/q_proj/kernel", (64,), m8, ((r".*", P(None, "data")),), min_size=0)


def _tiny_params():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.layers = nnx.List([nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)])
            self.norm = nnx.RMSNorm(8, rngs=rngs)

    return nnx.split(Net(), nnx.Param)[1]


def test_param_and_opt_state_shardings_mirror():
    params = _tiny_params()
    paths = [mwra.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert "layers/0/kernel" in paths and "norm/scale" in paths
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rules = ((r"kernel$", P(None, "data")), (r".*", mwra.REPLICATED))
    p_sh = mwra.param_shardings(params, mesh, rules, min_size=0)
    opt_state = optax.adamw(1e-3).init(params)
    o_sh = mwra.opt_state_shardings(opt_state, p_sh, mesh)
    specs = {mwra.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(
        o_sh, is_leaf=lambda x: isinstance(x, NamedSharding))[0]}
    assert specs["0/mu/layers/1/kernel"] == P(None, "data") and specs["0/nu/layers/0/kernel"] == P(None, "data")
    assert specs["0/mu/norm/scale"] == P() and specs["0/count"] == P()
    placed = mwra.put(opt_state, o_sh)
    assert mwra.devices_of(placed) == {jax.devices()[0].id}


def test_batch_sharding_and_errors():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    assert mwra.row_sharding(mesh).spec == P("data")
    b = mwra.shard_rows({"ids": np.zeros((4, 3), np.int32), "n": np.float32(1.0)}, mesh)
    assert b["ids"].sharding.spec == P("data") and b["n"].sharding.spec == P()
    with pytest.raises(ValueError, match="pad the rows to a multiple of 8"):
        mwra.row_shardings({"ids": np.zeros((12, 3))}, FakeMeshAsMesh())


class FakeMeshAsMesh(FakeMesh):
    def __init__(self):
        super().__init__(data=8)


# ---------------------------------------------------------------- distributed start-up (no real init here)
@pytest.fixture
def clean_env(monkeypatch):
    for names in (mwra.distributed.ENV_COORDINATOR, mwra.distributed.ENV_NUM_PROCESSES,
                  mwra.distributed.ENV_PROCESS_ID, mwra.distributed.ENV_HEARTBEAT):
        for n in names:
            monkeypatch.delenv(n, raising=False)
    monkeypatch.delenv("MRL_DISTRIBUTED_AUTO", raising=False)
    return monkeypatch


def test_initialize_distributed_single_process_is_noop(clean_env):
    info = mwra.initialize_distributed()
    assert not info.initialized and info.num_processes == 1 and info.process_id == 0
    clean_env.setenv("MRL_NUM_PROCESSES", "1")
    assert not mwra.initialize_distributed().initialized
    assert not jax.distributed.is_initialized()


def test_initialize_distributed_validation(clean_env):
    with pytest.raises(ValueError, match=r"--coordinator \(\$MRL_COORDINATOR\)"):
        mwra.initialize_distributed(num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="out of range"):
        mwra.initialize_distributed("localhost:1234", 2, 2)
    with pytest.raises(ValueError, match="host:port"):
        mwra.initialize_distributed("localhost", 2, 0)
    clean_env.setenv("MRL_PROCESS_ID", "zero")
    with pytest.raises(ValueError, match="not an integer"):
        mwra.initialize_distributed("localhost:1234", 2)
    clean_env.setenv("MRL_PROCESS_ID", "1")
    with pytest.raises(ValueError, match="only process has id 0"):
        mwra.initialize_distributed(num_processes=1)


def test_heartbeat_timeout_reaches_jax(clean_env):
    """The lost-process timeout (docs/multihost.md) from the argument or $MRL_HEARTBEAT_TIMEOUT_S reaches
    ``jax.distributed.initialize``; unset, JAX's own default stands; a bad value names the variable."""
    calls = []
    clean_env.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    clean_env.setattr(jax, "process_index", lambda: 0)
    clean_env.setattr(jax, "process_count", lambda: 2)
    mwra.initialize_distributed("localhost:1234", 2, 0)
    clean_env.setenv("MRL_HEARTBEAT_TIMEOUT_S", "30")
    mwra.initialize_distributed("localhost:1234", 2, 0)
    mwra.initialize_distributed("localhost:1234", 2, 0, heartbeat_timeout_s=12)
    assert ["heartbeat_timeout_seconds" in c for c in calls] == [False, True, True]
    assert [c.get("heartbeat_timeout_seconds") for c in calls[1:]] == [30, 12]
    clean_env.setenv("MRL_HEARTBEAT_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match=r"MRL_HEARTBEAT_TIMEOUT_S"):
        mwra.initialize_distributed("localhost:1234", 2, 0)


# ---------------------------------------------------------------- subprocesses with forced CPU devices
@pytest.fixture(scope="module")
def local8(tmp_path_factory):
    result = tmp_path_factory.mktemp("mwra") / "local8.json"
    r = subprocess.run([sys.executable, str(WORKER), "local"], env=worker_result.env_for(support.forced_devices_env(8), result),
                       capture_output=True, text=True, timeout=240, cwd=REPO)
    assert r.returncode == 0, f"worker failed ({r.returncode}):\n{r.stderr[-4000:]}"
    return worker_result.read(result, r.stdout)


def test_subprocess_allocation_on_8_cpu_devices(local8):
    assert local8["num_devices"] == 8
    assert local8["alloc_1_3"] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert local8["alloc_1_3_shapes"] == [[2], [6]]
    assert local8["time_share_3_on_2"] == [[0], [1], [0]]
    assert local8["time_share_full"] == [[0, 1]] * 3


def test_subprocess_placement(local8):
    a, b = local8["placement"]
    assert not set(a["mesh"]) & set(b["mesh"])  # disjoint meshes
    for rec in (a, b):
        assert rec["sharded_leaves"] > 0  # really sharded, not just replicated
        for k in ("params_before", "opt_before", "params_after", "opt_after"):
            assert rec[k] == rec["mesh"], k  # every leaf only on its mesh, the mesh fully used
        assert rec["per_leaf_subset"] and math.isfinite(rec["loss"])
    assert local8["moved_devices"] == b["mesh"]  # experience moved onto the other policy's mesh


def test_subprocess_sharded_update_equals_single_device(local8):
    assert local8["equiv_sharded_leaves"] > 0
    assert local8["equiv_param_delta"] > 1e-4  # the step moved the params
    assert local8["equiv_param_max_diff"] < 1e-5
    assert local8["equiv_opt_max_diff"] < 1e-5
    la, lb = local8["equiv_loss"]
    assert abs(la - lb) < 1e-5


@pytest.mark.slow
def test_two_processes_jax_distributed(tmp_path):
    port = support.free_port()
    results = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), "mp", str(i), str(port)],
                              env=worker_result.env_for(support.forced_devices_env(2), results[i]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} failed ({rc}):\n{err[-4000:]}"
    r0, r1 = (worker_result.read(path, o) for path, (_, o, _) in zip(results, outs))
    for i, r in enumerate((r0, r1)):
        assert r["info"] == [True, i, 2] and r["global_devices"] == 4 and r["local_devices"] == 2
        assert r["global_sharded_leaves"] > 0  # params really span both processes
        assert r["ref_max_diff"] < 1e-5 and abs(r["loss"] - r["ref_loss"]) < 1e-5
    assert r0["checksum"] == r1["checksum"] and r0["loss"] == r1["loss"]  # the processes agree
    # one policy per process; each process reads the loss of its own policy, equal to a 1-device reference
    assert r0["policy_meshes_process"] == [[0], [1]]
    assert set(r0["policy_losses"]) == {"0"} and set(r1["policy_losses"]) == {"1"}
    assert abs(r0["policy_losses"]["0"] - r0["policy_ref_losses"]["0"]) < 1e-5
    assert abs(r1["policy_losses"]["1"] - r1["policy_ref_losses"]["1"]) < 1e-5
