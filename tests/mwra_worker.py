"""Subprocess scenarios for tests/test_mwra.py (run with XLA_FLAGS=--xla_force_host_platform_device_count=N).

    python tests/mwra_worker.py local                   # 8 CPU devices: allocation, placement, equivalence
    python tests/mwra_worker.py mp PROCESS_ID PORT      # one of two processes under jax.distributed

Writes one JSON object (tests/worker_result.py).
"""
from __future__ import annotations

import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from mrl_jax import mwra  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker_result  # noqa: E402

VOCAB = 64


class TinyLM(nnx.Module):
    """Fallback tiny model (embedding, residual Linear stack, RMSNorm, tied head) when mrl_jax.models is absent."""

    def __init__(self, vocab: int, dim: int, layers: int, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(dim, dim, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        for lin in self.layers:
            h = h + jax.nn.gelu(lin(h))
        return self.embed.attend(self.norm(h))


def make_model(dim: int = 32, layers: int = 2, seed: int = 0, family: str = "llama"):
    """mrl_jax.models.tiny_model when available (family "mlp": always TinyLM), else TinyLM. -> (model, kind)."""
    if family == "mlp":
        return TinyLM(VOCAB, dim, layers, seed=seed), "TinyLM (nnx.Linear stack)"
    try:
        from mrl_jax.models import tiny_model

        return tiny_model(family, VOCAB, seed=seed, hidden_size=dim, num_layers=layers,
                          intermediate_size=2 * dim), f"mrl_jax.models.tiny_model({family})"
    except Exception:  # noqa: BLE001 -- models module not ready / different overrides
        return TinyLM(VOCAB, dim, layers, seed=seed), "TinyLM (nnx.Linear stack)"


OPT = optax.adamw(1e-3, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def make_step(graphdef, opt=OPT):
    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["ids"]).astype(jnp.float32)
        lp = jax.nn.log_softmax(logits[:, :-1])
        tok = jnp.take_along_axis(lp, batch["ids"][:, 1:, None], axis=-1)[..., 0]
        return -(tok * batch["mask"][:, 1:]).sum() / batch["mask"][:, 1:].sum()

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_batch(rows: int = 12, length: int = 12, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, VOCAB, size=(rows, length), dtype=np.int32),
            "mask": (rng.random((rows, length)) < 0.9).astype(np.float32)}


def setup_policy(mesh, *, dim=32, layers=2, seed=0, min_size=0, family="llama"):
    """Model, sharded params/opt state and a jitted step pinned to ``mesh``."""
    model, kind = make_model(dim, layers, seed, family)
    graphdef, params = nnx.split(model, nnx.Param)
    opt = OPT
    p_sh = mwra.param_shardings(params, mesh, min_size=min_size)
    params = mwra.put(params, p_sh)
    opt_state = opt.init(params)
    o_sh = mwra.opt_state_shardings(opt_state, p_sh, mesh)
    opt_state = mwra.put(opt_state, o_sh)
    batch = make_batch(seed=seed)
    b_sh = mwra.row_shardings(batch, mesh)
    step = jax.jit(make_step(graphdef, opt), in_shardings=(p_sh, o_sh, b_sh),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0, 1))
    return dict(params=params, opt_state=opt_state, batch=mwra.put(batch, b_sh), step=step, kind=kind,
                p_sh=p_sh, host_batch=batch)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def scenario_local() -> dict:
    out: dict = {"num_devices": len(jax.devices())}
    devs = jax.devices()
    # allocation on real devices
    m = mwra.allocate([1.0, 3.0], devs)
    out["alloc_1_3"] = [sorted(d.id for d in mm.devices.flat) for mm in m]
    out["alloc_1_3_shapes"] = [list(mm.devices.shape) for mm in m]
    ts = mwra.allocate([1.0, 1.0, 1.0], devs[:2])
    out["time_share_3_on_2"] = [sorted(d.id for d in mm.devices.flat) for mm in ts]
    full = mwra.allocate([1.0, 1.0, 1.0], devs[:2], time_share="full")
    out["time_share_full"] = [sorted(d.id for d in mm.devices.flat) for mm in full]

    # placement: two policies of different size on their meshes, one update each dispatched concurrently
    pols = [setup_policy(m[0], dim=32, seed=1), setup_policy(m[1], dim=48, seed=2, family="gpt2")]
    out["model_kind"] = [p["kind"] for p in pols]
    placement = []
    for pol, mesh in zip(pols, m):
        mesh_ids = {d.id for d in mesh.devices.flat}
        before = (mwra.devices_of(pol["params"]), mwra.devices_of(pol["opt_state"]))
        sharded = sum(1 for s in jax.tree.leaves(pol["p_sh"], is_leaf=lambda x: isinstance(x, NamedSharding))
                      if any(e is not None for e in s.spec))
        placement.append({"mesh": sorted(mesh_ids), "params_before": sorted(before[0]),
                          "opt_before": sorted(before[1]), "sharded_leaves": sharded})
    res = jax.block_until_ready([p["step"](p["params"], p["opt_state"], p["batch"]) for p in pols])
    for rec, (params, opt_state, loss) in zip(placement, res):
        rec["params_after"] = sorted(mwra.devices_of(params))
        rec["opt_after"] = sorted(mwra.devices_of(opt_state))
        rec["per_leaf_subset"] = all(
            {d.id for d in x.sharding.device_set} <= set(rec["mesh"])
            for x in jax.tree.leaves((params, opt_state)))
        rec["loss"] = float(loss)
    out["placement"] = placement
    # experience moved from policy 0's mesh to policy 1's mesh
    moved = mwra.to_mesh(res[0][0], m[1])
    moved_h = mwra.to_mesh(pols[0]["host_batch"], m[1], via_host=True)
    out["moved_devices"] = sorted(mwra.devices_of(moved) | mwra.devices_of(moved_h))

    # equivalence: one AdamW step sharded over 4 devices == on 1 device
    mesh4 = mwra.allocate([1.0], devs[:4])[0]
    mesh1 = mwra.allocate([1.0], devs[4:5])[0]
    a, b = setup_policy(mesh4, dim=32, seed=3), setup_policy(mesh1, dim=32, seed=3)
    pa, oa, la = a["step"](a["params"], a["opt_state"], a["batch"])
    pb, ob, lb = b["step"](b["params"], b["opt_state"], b["batch"])
    out["equiv_param_max_diff"] = max_diff(host(pa), host(pb))
    out["equiv_opt_max_diff"] = max_diff(host(oa), host(ob))
    out["equiv_loss"] = [float(la), float(lb)]
    out["equiv_sharded_leaves"] = sum(1 for x in jax.tree.leaves(pa) if not x.sharding.is_fully_replicated)
    out["equiv_param_delta"] = max_diff(host(pb), host(nnx.split(make_model(32, 2, 3)[0], nnx.Param)[1]))
    return out


def _mark(label: str, t0=[time.perf_counter()]) -> None:  # noqa: B006 -- stderr timing trace
    print(f"[mwra_worker {time.perf_counter() - t0[0]:6.2f}s] {label}", file=sys.stderr, flush=True)


def scenario_mp(process_id: int, port: int) -> dict:
    info = mwra.initialize_distributed(f"localhost:{port}", 2, process_id, initialization_timeout=60)
    out = {"info": [info.initialized, info.process_id, info.num_processes],
           "global_devices": len(jax.devices()), "local_devices": len(jax.local_devices())}
    _mark('distributed up; one policy over 4 global devices')
    mesh = mwra.allocate([1.0], jax.devices())[0]  # one policy over both processes' devices
    pol = setup_policy(mesh, dim=32, seed=5, family="mlp")
    params, opt_state, loss = pol["step"](pol["params"], pol["opt_state"], pol["batch"])
    gathered = [np.asarray(x) for x in jax.tree.leaves(multihost_utils.process_allgather(params, tiled=True))]
    out["global_sharded_leaves"] = sum(1 for x in jax.tree.leaves(params) if not x.is_fully_addressable)
    out["checksum"] = float(sum(np.sum(x, dtype=np.float64) for x in gathered))
    out["loss"] = float(loss)
    _mark('single-device reference')
    # reference on one local device of this process
    local = jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("data",))
    ref = setup_policy(local, dim=32, seed=5, family="mlp")
    rp, _, rl = ref["step"](ref["params"], ref["opt_state"], ref["batch"])
    out["ref_max_diff"] = max_diff(gathered, host(rp))
    out["ref_loss"] = float(rl)
    _mark('two policies, one per process')
    # two policies, one per process (each mesh holds only one host's devices). Multi-controller SPMD:
    # every process makes the same calls; a process holding no device of a mesh just enqueues nothing.
    p_meshes = mwra.allocate([1.0, 1.0], jax.devices())
    out["policy_meshes_process"] = [sorted({d.process_index for d in mm.devices.flat}) for mm in p_meshes]
    pols = [setup_policy(mm, seed=10 + i, family="mlp") for i, mm in enumerate(p_meshes)]
    res = jax.block_until_ready([p["step"](p["params"], p["opt_state"], p["batch"]) for p in pols])
    out["policy_losses"] = {}
    out["policy_ref_losses"] = {}
    for i, (mm, (_, _, l)) in enumerate(zip(p_meshes, res)):
        if l.is_fully_addressable:  # this process's policy
            out["policy_losses"][str(i)] = float(l)
        r = setup_policy(local, seed=10 + i, family="mlp")
        out["policy_ref_losses"][str(i)] = float(r["step"](r["params"], r["opt_state"], r["batch"])[2])
    _mark('done; barrier')
    multihost_utils.sync_global_devices("mrl_mwra_test_done")
    return out


def main(argv: list[str]) -> None:
    t0 = time.perf_counter()
    if argv[0] == "local":
        out = scenario_local()
    elif argv[0] == "mp":
        out = scenario_mp(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit(f"unknown scenario {argv[0]!r}")
    out["seconds"] = round(time.perf_counter() - t0, 2)
    worker_result.write(out)


if __name__ == "__main__":
    main(sys.argv[1:])
