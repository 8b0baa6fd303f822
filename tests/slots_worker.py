"""Child process of tests/test_rollout_slots.py (forced CPU devices): the slot sampler on a mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/slots_worker.py
"""
from __future__ import annotations

import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import worker_result
from mrl_jax import models, mwra
from mrl_jax.sampler import SamplingConfig, generate, generate_slots, left_pad
from mrl_jax.sampler.slots import _compact, _decode, _start
from mrl_jax.trainer.placement import pad_prompts

PROMPTS = [[1, 5, 9, 14], [1, 22], [1, 3, 4, 5, 6, 7]]


def main() -> dict:
    m = models.tiny_model("llama", 61, seed=3, hidden_size=32, intermediate_size=64)
    gd, p = nnx.split(m)
    p = jax.tree_util.tree_map(lambda x: x * 3.0, p)
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    cfg = SamplingConfig(max_new_tokens=21, pad_id=0, eos_id=(7, 19, 33), cache_bucket=8, temperature=0.9, top_p=0.9)
    key = jax.random.key(11)
    ref = jax.device_get(generate(gd, p, ids, mask, key, cfg, num_samples=3))
    res: dict = {"devices": len(jax.devices()), "lengths": ref.lengths.tolist(), "cases": {}}
    for d, slots in ((4, 5), (3, None)):   # P 3 -> 4 prompts (12 rows) in 8 slots on 4 devices; 9 rows, 9 slots on 3
        mesh = Mesh(np.asarray(jax.devices()[:d]).reshape(d), ("data",))
        params = mwra.put(p, mwra.param_shardings(p, mesh, min_size=0))
        pids, pmask = pad_prompts(ids, mask, d)
        with jax.transfer_guard("disallow"):
            out, stats = generate_slots(gd, params, pids, pmask, key, cfg, num_samples=3, slots=slots, mesh=mesh)
        b = len(PROMPTS) * 3
        res["cases"][str(d)] = {
            "tokens_equal": bool(np.array_equal(out.tokens[:b], ref.tokens)),
            "mask_equal": bool(np.array_equal(out.mask[:b], ref.mask)),
            "truncated_equal": bool(np.array_equal(out.truncated[:b], ref.truncated)),
            "logprob_diff": float(np.abs(out.logprobs[:b] - ref.logprobs).max()),
            "sampling_logprob_diff": float(np.abs(out.sampling_logprobs[:b] - ref.sampling_logprobs).max()),
            "slots": stats["slots"],
            "slot_devices": stats["slot_devices"],
            "gathered_keys": gathered_keys(gd, params, pids, pmask, key, cfg, mesh, stats["slots"]),
            "sharded_params": sum(len(x.sharding.device_set) == d and not x.sharding.is_fully_replicated
                                  for x in jax.tree.leaves(params)),
        }
    # the ladder on 2 devices: 4 prompts x G 12 = 48 rows in 48 slots, the tail moved to 32, 16, then 8 (4 per device)
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(2), ("data",))
    params = mwra.put(p, mwra.param_shardings(p, mesh, min_size=0))
    pids, pmask = pad_prompts(ids, mask, 2)
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 12, 19, 33, 41, 50), cache_bucket=8)   # a tail
    ref12 = jax.device_get(generate(gd, p, ids, mask, key, cfg, num_samples=12))
    with jax.transfer_guard("disallow"):
        out, stats = generate_slots(gd, params, pids, pmask, key, cfg, num_samples=12, mesh=mesh)
    b = len(PROMPTS) * 12
    res["ladder"] = {"rungs": list(stats["rungs"]), "tokens_equal": bool(np.array_equal(out.tokens[:b], ref12.tokens)),
                     "mask_equal": bool(np.array_equal(out.mask[:b], ref12.mask)),
                     "logprob_diff": float(np.abs(out.logprobs[:b] - ref12.logprobs).max()),
                     "move_collectives": move_collectives(gd, params, pids, pmask, key, cfg, mesh)}
    return res


def move_collectives(gd, params, ids, mask, key, cfg, mesh) -> int:
    """Collectives in the compiled move down the ladder (48 -> 12 slots on ``mesh``): none when each device's rows
    move within its own slots (a move across them gathers the indices and all-reduces the gathered cache)."""
    rows, repl = mwra.row_sharding(mesh), mwra.REPLICATED
    put = lambda x: mwra.put(x, jax.sharding.NamedSharding(mesh, repl))   # noqa: E731
    prompts, state = jax.jit(lambda p, i, m, k: _start(gd, p, i, m, k, cfg, num_samples=12, slots=48, width=8,
                                                          rows=rows))(params, put(ids), put(mask), put(key))
    assert state.cache.group == 12   # a slot per row: the move copies each prompt's entries in from its block
    text = jax.jit(lambda p, s: _compact(p, s, slots=12, rows=rows)).lower(prompts, state).compile().as_text()
    return len(re.findall(r" (?:all-gather|all-to-all|collective-permute|all-reduce)(?:-start)?\(", text))


def gathered_keys(gd, params, ids, mask, key, cfg, mesh, slots: int) -> int:
    """All-gathers of float arrays of 3 or more dims (a step's keys / values [S, K, D], the cache) in the compiled
    decode loop on ``mesh``: the cache write should keep every slot's entry on its device."""
    rows, repl = mwra.row_sharding(mesh), mwra.REPLICATED
    put = lambda x: mwra.put(x, jax.sharding.NamedSharding(mesh, repl))   # noqa: E731
    prompts, state = jax.jit(lambda p, i, m, k: _start(gd, p, i, m, k, cfg, num_samples=3, slots=slots, width=8,
                                                          rows=rows))(params, put(ids), put(mask), put(key))
    text = jax.jit(lambda p, a, b: _decode(nnx.merge(gd, p), a, b, cfg, 3, 4, rows, None)).lower(params, prompts,
                                                                                                  state)
    return len(re.findall(r"= f32\[\d+,\d+,\d+[\d,]*\]\S* all-gather\(", text.compile().as_text()))


if __name__ == "__main__":
    worker_result.write(main())
