"""MWRA figures: one round (an AdamW update step of each of two tiny policies, each on its own sub-mesh)
dispatched concurrently (every step launched before any is awaited) vs one after the other, on 8 CPU devices; and the
allocation plan for a 0.5B + 1.5B pair on 8 devices.

    python benchmarks/bench_mwra.py [--quick]      # prints JSON

`run(quick)` re-executes this file in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8
unless the current process already has >= 8 devices. Caveat: forced CPU "devices" share the host's cores, so
on CPU the concurrent/sequential ratio mostly measures dispatch overlap, not extra compute; on separate
accelerators the concurrent round approaches max(step times) instead of their sum.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUM_DEVICES = 8
QWEN_05B, QWEN_15B = 494_032_768, 1_543_714_304  # Qwen2.5-0.5B / -1.5B parameter counts


def _policy(mesh, family: str, dim: int, vocab: int, rows: int, length: int, seed: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from mrl_jax import mwra
    from mrl_jax.models import tiny_model

    model = tiny_model(family, vocab, seed=seed, hidden_size=dim, num_layers=2, intermediate_size=4 * dim)
    graphdef, params = nnx.split(model, nnx.Param)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    opt = optax.adamw(1e-3, weight_decay=0.1)

    def step(params, opt_state, batch):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(batch[:, :-1]).astype(jnp.float32)
            lp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(lp, batch[:, 1:, None], axis=-1).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    p_sh = mwra.param_shardings(params, mesh, min_size=1024)
    params = mwra.put(params, p_sh)
    opt_state = opt.init(params)
    o_sh = mwra.opt_state_shardings(opt_state, p_sh, mesh)
    opt_state = mwra.put(opt_state, o_sh)
    batch = np.random.default_rng(seed).integers(0, vocab, size=(rows, length), dtype=np.int32)
    b_sh = mwra.row_sharding(mesh)
    jitted = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh),
                     out_shardings=(p_sh, o_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=(0, 1))
    return {"step": jitted, "state": [params, opt_state], "batch": mwra.put(batch, b_sh),
            "params": int(n_params), "tokens": rows * length}


def _child(quick: bool) -> dict:
    import jax

    from mrl_jax import mwra

    devices = jax.devices()
    out = {"devices": len(devices), "platform": devices[0].platform, "jax": jax.__version__}
    big = mwra.plan([QWEN_05B * 4096, QWEN_15B * 4096], devices[:NUM_DEVICES], [QWEN_05B, QWEN_15B],
                    ["qwen2.5-0.5b", "qwen2.5-1.5b"])
    out["plan_0.5b_1.5b"] = str(big)
    out["plan_0.5b_1.5b_dict"] = big.to_dict()

    dim, rows, length, reps = (64, 16, 32, 5) if quick else (128, 32, 64, 15)
    specs = [("llama", dim), ("gpt2", dim)]
    # cost = parameters x tokens per round, measured on the actual tiny models
    from flax import nnx

    from mrl_jax.models import tiny_model

    counts = []
    for fam, d in specs:
        m = tiny_model(fam, 512, hidden_size=d, num_layers=2, intermediate_size=4 * d)
        counts.append(sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))))
    p = mwra.plan([c * rows * length for c in counts], devices[:NUM_DEVICES], counts, [f for f, _ in specs])
    out["tiny_plan"] = str(p)
    meshes = p.meshes()
    pols = [_policy(m, fam, d, 512, rows, length, seed=i) for i, (m, (fam, d)) in enumerate(zip(meshes, specs))]

    def call(pol):
        return pol["step"](pol["state"][0], pol["state"][1], pol["batch"])

    def keep(pol, res):
        pol["state"] = [res[0], res[1]]

    def dispatch_all():   # every policy's step launched before any is awaited
        return jax.block_until_ready([call(q) for q in pols])

    for _ in range(2):  # compile + warm up
        for pol, res in zip(pols, dispatch_all()):
            keep(pol, res)

    def sequential():
        for pol in pols:
            keep(pol, jax.block_until_ready(call(pol)))

    def concurrent():
        for pol, res in zip(pols, dispatch_all()):
            keep(pol, res)

    def single(i):
        keep(pols[i], jax.block_until_ready(call(pols[i])))

    from mrl_jax.bench.load import section

    times = {"sequential": [], "concurrent": [], "policy0_alone": [], "policy1_alone": []}
    with section("mwra_round") as out["load"]:
        for _ in range(reps):  # interleaved so background load hits both alike
            for name, fn in (("sequential", sequential), ("concurrent", concurrent),
                             ("policy0_alone", lambda: single(0)), ("policy1_alone", lambda: single(1))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    out["contended"] = out["load"]["contended"]
    med = {k: statistics.median(v) for k, v in times.items()}
    out["round_ms_median"] = {k: round(1e3 * v, 3) for k, v in med.items()}
    out["concurrent_over_sequential"] = round(med["concurrent"] / med["sequential"], 3)
    out["ideal_ratio_max_over_sum"] = round(max(med["policy0_alone"], med["policy1_alone"]) /
                                            (med["policy0_alone"] + med["policy1_alone"]), 3)
    out["config"] = {"hidden": dim, "rows": rows, "length": length, "repeats": reps, "param_counts": counts,
                     "host_cpus": os.cpu_count()}
    return out


def run(quick: bool = False) -> dict:
    """The MWRA figures as a dict (runs on 8 forced CPU devices in a subprocess when needed)."""
    import jax

    if len(jax.devices()) >= NUM_DEVICES:
        return _child(quick)
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={NUM_DEVICES}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(repo)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] + (["--quick"] if quick else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"bench_mwra child failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    res = _child(quick) if "--child" in sys.argv else run(quick)
    print(json.dumps(res))
