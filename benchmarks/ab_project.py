"""A/B of ``models.layers.project`` in ONE process, interleaved: the sampler with parallel projections fused
(q|k|v, gate|up as one matmul at <= ``FUSE_MAX_ROWS`` rows) against one matmul per layer.

    python benchmarks/ab_project.py [--quick] [--repeats N] [--wait-idle SECONDS] [--out FILE]

``FUSE_MAX_ROWS`` is read when a program is traced, so each side is its own ``jax.jit`` of ``generate``, traced
with the threshold set for it; the timed calls then alternate between the two compiled programs (robust to a
machine whose speed drifts between runs, which process-level A/Bs of this change were not). Reported per case:
min / median seconds of each side, per-layer / fused (> 1: fusing is faster), and the load record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# bench_rollout's llama cases (B distinct prompts) and bench_trl's realistic GRPO layout (P prompts x G samples)
CASES = {
    "llama_d96_b128": dict(family="llama", P=128, G=1, tp=32, n=64, V=512, d=96, L=2, f=384, h=4, k=2),
    "llama_8m_b16": dict(family="llama", P=16, G=1, tp=64, n=128, V=8192, d=256, L=4, f=1024, h=8, k=4),
    "qwen2_d128_p8g8": dict(family="qwen2", P=8, G=8, tp=128, n=128, V=512, d=128, L=4, f=384, h=4, k=2),
}
QUICK = {"llama_d64_b32": dict(family="llama", P=32, G=1, tp=16, n=32, V=512, d=64, L=2, f=256, h=4, k=2)}


def _case(c: dict, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mrl_jax import models, rollout
    from mrl_jax.bench_env import section
    from mrl_jax.models import layers

    m = models.tiny_model(c["family"], c["V"], hidden_size=c["d"], num_layers=c["L"], intermediate_size=c["f"],
                          num_heads=c["h"], num_kv_heads=c["k"])
    g, p = nnx.split(m)
    ids = jax.random.randint(jax.random.key(0), (c["P"], c["tp"]), 3, c["V"])
    mask = jnp.ones_like(ids, bool)
    cfg = rollout.SamplingConfig(max_new_tokens=c["n"], temperature=1.0, eos_id=None, pad_id=0)
    default = layers.FUSE_MAX_ROWS
    sides = {}
    for name, rows in (("fused", default), ("per_layer", 0)):
        fn = jax.jit(lambda p, ids, mask, key: rollout.generate(g, p, ids, mask, key, cfg, num_samples=c["G"]))
        layers.FUSE_MAX_ROWS = rows
        try:
            t0 = time.perf_counter()
            compiled = fn.lower(p, ids, mask, jax.random.key(1)).compile()
            jax.block_until_ready(compiled(p, ids, mask, jax.random.key(1)))
        finally:
            layers.FUSE_MAX_ROWS = default
        sides[name] = (compiled, time.perf_counter() - t0)
    times = {name: [] for name in sides}
    with section(f"ab_project_{c['family']}_{c['P']}x{c['G']}") as load:
        for i in range(repeats):
            for name, (fn, _) in sides.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(p, ids, mask, jax.random.key(2 + i)))
                times[name].append(time.perf_counter() - t0)
    out = {name: dict(min_s=round(min(t), 4), median_s=round(statistics.median(t), 4), all_s=[round(x, 4) for x in t],
                      first_call_s=round(sides[name][1], 2)) for name, t in times.items()}
    return dict(case=c, **out, per_layer_over_fused=round(min(times["per_layer"]) / min(times["fused"]), 3),
                per_layer_over_fused_median=round(statistics.median(times["per_layer"]) / statistics.median(times["fused"]), 3),
                load=load, contended=load["contended"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from mrl_jax.bench import run_recorded

    cases = QUICK if args.quick else CASES
    figures = run_recorded(lambda: {name: _case(c, args.repeats) for name, c in cases.items()}, args.wait_idle)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
