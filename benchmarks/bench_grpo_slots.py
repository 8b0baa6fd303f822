"""The slot sampler against the static sampler on GRPO's layout (P prompts x G 8, every row decoding up to N tokens),
in one process: the min of R alternating calls of each (each returning its whole Rollout to the host), and the
median and quartiles of the R paired ratios (each slot call against the static call just before it: steadier than
the ratio of the mins on a machine whose speed drifts), five shapes.

    python benchmarks/bench_grpo_slots.py [--quick] [--wait-idle SECONDS] [--out FILE]

``run(quick) -> dict`` is what ``mrl bench`` calls (quick: the 64-row shape, 3 repeats). The script imports the
``mrl_jax`` of the tree it sits in; for a before / after A/B copy it out of the tree and run it with each tree on
``PYTHONPATH``, in alternate processes each started at 1-minute load < 0.5: the ratio is taken in one process, so
the machine's drift between processes cancels.
"""
from __future__ import annotations

import os
import sys
import time

# name: (prompts P, samples G, prompt tokens, new tokens N, hidden, layers, stop id): bench_rollout's quick_g8 (64
# rows), the same at 64 prompts (512 rows), its demo_g8 (1024 rows); bench_trl.py's two GRPO shapes (its tiny
# model's size: 4 layers, hidden 128; a stop id, which a random model's rows rarely sample)
SHAPES = {"quick_g8": (8, 8, 32, 32, 64, 2, None), "quick_g8_512_rows": (64, 8, 32, 32, 64, 2, None),
          "demo_g8": (128, 8, 64, 64, 96, 2, None), "trl_small": (8, 8, 16, 32, 128, 4, 2),
          "trl_realistic": (8, 8, 128, 128, 128, 4, 2)}

# alternating calls of each sampler per shape: ~20 s of calls each (a quick_g8 call lasts ~20 ms, a realistic ~0.3 s)
REPEATS = {"quick_g8": 61, "quick_g8_512_rows": 25, "demo_g8": 9, "trl_small": 41, "trl_realistic": 15}


def bench(P: int, G: int, Tp: int, N: int, hidden: int, layers: int, stop: int | None, repeats: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from mrl_jax import models
    from mrl_jax.sampler import SamplingConfig, generate, generate_slots

    gd, params = nnx.split(models.tiny_model("llama", 512, seed=0, hidden_size=hidden, intermediate_size=2 * hidden,
                                             num_layers=layers, num_heads=4, num_kv_heads=2))
    ids = np.random.default_rng(0).integers(1, 512, size=(P, Tp)).astype(np.int32)
    mask = np.ones((P, Tp), bool)
    cfg = SamplingConfig(max_new_tokens=N, temperature=1.0, eos_id=stop, pad_id=0)
    key, stats = [jax.random.key(0)], {}

    def static():
        key[0], k = jax.random.split(key[0])
        return jax.device_get(generate(gd, params, ids, mask, k, cfg, num_samples=G)).tokens   # the whole Rollout

    def slots():
        key[0], k = jax.random.split(key[0])
        out, st = generate_slots(gd, params, ids, mask, k, cfg, num_samples=G)
        stats.update(st)
        return out.tokens

    from mrl_jax.bench.load import section

    first = {}
    for name, fn in (("static", static), ("slots", slots)):   # compiles
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    times: dict = {"static": [], "slots": []}
    with section(f"grpo_{P}x{G}") as load:
        for _ in range(repeats):
            for name, fn in (("static", static), ("slots", slots)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    paired = np.array(times["static"]) / np.array(times["slots"])   # each call against the static call before it
    return {"rows": P * G, "prompt_len": Tp, "new_tokens": N, "static_s": best["static"], "slots_s": best["slots"],
            "slots_vs_static": best["static"] / best["slots"],
            "slots_vs_static_paired": {"median": float(np.median(paired)),
                                       "quartiles": [float(q) for q in np.percentile(paired, [25, 75])]},
            "first_call_s": first,
            "shared_prompts": stats.get("shared_prompts"), "rungs": stats.get("rungs"), "load": load}


def run(quick: bool = False) -> dict:
    import mrl_jax

    shapes = {"quick_g8": SHAPES["quick_g8"]} if quick else SHAPES
    out = {"benchmark": "grpo_slots", "quick": quick,
           "mrl_jax": os.path.dirname(os.path.dirname(os.path.abspath(mrl_jax.__file__))),
           "results": {name: bench(*shape, repeats=3 if quick else REPEATS[name]) for name, shape in shapes.items()}}
    out["contended"] = any(r["load"]["contended"] for r in out["results"].values())
    return out


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    from mrl_jax.bench import script_main

    raise SystemExit(script_main(run, __doc__.splitlines()[0]))
