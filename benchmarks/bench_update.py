"""Update-step cost per probe: step time and memory of ``mrl_jax.learner.make_update_step`` for
none / xgrpo / prp / sgt on one tiny Llama config (same batch, same view, same shapes).

For each probe: compile time, median and min step time over ``repeats`` timed calls after the compile
call (params/opt_state donated, as in training), the compiled program's memory (XLA's
``memory_analysis``: arguments + outputs + temporaries - aliased; an estimate of the step's peak), the
device's ``peak_bytes_in_use`` where the backend reports it (GPU/TPU), and the rows the probe trains on.

    python benchmarks/bench_update.py [--quick] [--out FILE]

``run(quick) -> dict`` is what ``mrl bench`` calls.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

CASES = {
    True: dict(vocab=512, hidden=64, layers=2, P=8, G=4, K=2, Tp=16, Tc=32, micro=0, repeats=5),
    False: dict(vocab=2048, hidden=128, layers=2, P=16, G=8, K=4, Tp=32, Tc=64, micro=64, repeats=5),
}
PROBES = ("none", "xgrpo", "prp", "sgt")


def _inputs(c: dict, seed: int = 0):
    import jax.numpy as jnp

    from mrl_jax import see
    from mrl_jax.rows import own_rows

    rs = np.random.RandomState(seed)
    P, G, K, Tp, Tc, V = c["P"], c["G"], c["K"], c["Tp"], c["Tc"], c["vocab"]
    n, S = P * G, P * K
    lens = rs.randint(Tc // 2, Tc + 1, n)
    batch = own_rows(prompt_ids=jnp.asarray(rs.randint(3, V, (P, Tp)), jnp.int32), prompt_mask=jnp.ones((P, Tp), bool),
                  completion_ids=jnp.asarray(rs.randint(3, V, (n, Tc)), jnp.int32),
                  completion_mask=jnp.asarray(np.arange(Tc)[None] < lens[:, None], jnp.float32),
                  old_logp=jnp.asarray(rs.uniform(-7, -5, (n, Tc)), jnp.float32), ref_logp=jnp.zeros((n, Tc)),
                  rewards=jnp.asarray(rs.rand(n) < 0.3, jnp.float32), truncated=jnp.zeros((n,), bool))
    plens = rs.randint(Tc // 2, Tc, S)
    pm = np.arange(Tc)[None] < plens[:, None]
    stats = np.zeros((P, 2, 4), np.float32)
    stats[:, 1] = [G, G / 2, G / 2, G / 2]
    view = see.empty_view(P, K, Tc, Tc, 2).replace(
        completion_ids=jnp.asarray(rs.randint(3, V, (S, Tc)), jnp.int32), completion_mask=jnp.asarray(pm, jnp.float32),
        dst_chunk=jnp.asarray(np.where(pm, np.arange(Tc)[None], -1), jnp.int32),
        src_chunk_logp=jnp.asarray(rs.uniform(-7, -5, (S, Tc)) * pm, jnp.float32),
        chunk_valid=jnp.asarray(pm & (rs.rand(S, Tc) > 0.1)), rewards=jnp.asarray(rs.rand(S) < 0.5, jnp.float32),
        source=jnp.ones((S,), jnp.int32), row_kind=jnp.full((S,), see.PEER, jnp.int32),
        peer_stats=jnp.asarray(stats))
    return batch, view


def bench_probe(name: str, c: dict, batch, view) -> dict:
    import jax
    from flax import nnx

    from mrl_jax.bench.load import section
    from mrl_jax.learner import GRPOConfig, make_optimizer, make_update_step
    from mrl_jax.models import tiny_model

    model = tiny_model("llama", c["vocab"], hidden_size=c["hidden"], num_layers=c["layers"],
                       intermediate_size=4 * c["hidden"])
    graphdef, params = nnx.split(model)
    opt = make_optimizer(1e-4)
    state = opt.init(params)
    cfg = GRPOConfig(num_generations=c["G"], max_completion_length=c["Tc"], loss_type="dapo")
    update = make_update_step(graphdef, opt, name, cfg, micro_batch_size=c["micro"])
    key = jax.random.PRNGKey(0)
    t0 = time.perf_counter()
    compiled = update.lower(params, state, batch, view, key).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    est = None
    if mem is not None:
        est = int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                  - getattr(mem, "alias_size_in_bytes", 0))
    params, state, m = compiled(params, state, batch, view, key)
    jax.block_until_ready(params)
    times = []
    with section(f"update_{name}") as load:
        for i in range(c["repeats"]):
            t0 = time.perf_counter()
            params, state, m = compiled(params, state, batch, view, jax.random.fold_in(key, i))
            jax.block_until_ready((params, m))
            times.append(time.perf_counter() - t0)
    dev = jax.devices()[0]
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    out = {"compile_s": round(compile_s, 3), "step_ms_median": round(1e3 * statistics.median(times), 2),
           "step_ms_min": round(1e3 * min(times), 2), "xla_memory_bytes": est,
           "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
           "device_peak_bytes": int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None,
           "pg_rows": float(m["pg_rows"]), "num_tokens": float(m["num_tokens"]), "skipped": float(m["skipped"]),
           "load": load, "contended": load["contended"]}
    for k in ("prp/ess", "sgt/rows_fired", "xgrpo/adv_on_peer_solved"):
        if k in m:
            out[k] = round(float(m[k]), 4)
    return out


def chunked_logprob_memory(quick: bool) -> dict:
    """XLA temp bytes of grad(sum log pi) for a large vocabulary: full log-softmax vs chunked (compile only)."""
    import jax
    import jax.numpy as jnp

    from mrl_jax import grpo

    B, T, D, V = (4, 256, 64, 32768) if quick else (8, 1024, 128, 151936)
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    t = jax.ShapeDtypeStruct((B, T), jnp.int32)
    out = {"shape": {"B": B, "T": T, "D": D, "V": V}, "full_logits_f32_bytes": B * T * V * 4}
    for cs in (T, 128, 32):
        f = jax.grad(lambda w_, h_, t_: jnp.sum(grpo.chunked_token_logprobs(h_, lambda x: x @ w_, t_, cs)))
        mem = jax.jit(f).lower(w, h, t).compile().memory_analysis()
        out[f"temp_bytes_chunk_{cs}"] = int(mem.temp_size_in_bytes) if mem is not None else None
    return out


def run(quick: bool = False) -> dict:
    import jax

    c = CASES[bool(quick)]
    batch, view = _inputs(c)
    res = {"config": c, "backend": jax.default_backend(), "probes": {},
           "chunked_logprobs": chunked_logprob_memory(quick)}
    for name in PROBES:
        res["probes"][name] = bench_probe(name, c, batch, view)
    base = res["probes"]["none"]["step_ms_median"]
    for name in PROBES:
        res["probes"][name]["step_vs_none"] = round(res["probes"][name]["step_ms_median"] / base, 3)
    return res


def main(argv=None) -> int:
    from mrl_jax.bench import script_main

    return script_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
