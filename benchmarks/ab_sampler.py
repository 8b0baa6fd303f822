"""A/B of two sampler implementations in ONE process, interleaved (robust to a machine whose load drifts).

    git show abf26a9:mrl_jax/rollout.py > /tmp/old_rollout.py     # the sampler before issue #14
    python benchmarks/ab_sampler.py --old /tmp/old_rollout.py [--quick] [--out FILE]
    python benchmarks/ab_sampler.py --old-rev HEAD~1               # the whole package at a revision

``--old``: the old file is imported as a separate module next to today's ``mrl_jax.rollout`` (it must only use
the model API that still exists). ``--old-rev``: the package at that git revision (``old_tree``), models
included, so a change of the cache layout and its kernels compares as a whole; both sides build the same
weights and ``tokens_identical`` reports whether they sampled the same tokens. Each case runs both samplers on
the same weights and prompts (the new one with ``num_samples=G``; the old one too if its ``generate`` has it, else
on prompts repeated G times), ``repeats`` interleaved timed calls after a compile call; reported: tokens/s (min
time) of each, new / old, and the load record of the section (``mrl_jax.bench_env``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
import time

CASES = {  # P prompts x G samples, prompt length, new tokens; the bench_rollout demo model (d96, 2 layers)
    "b128_g1": dict(P=128, G=1, tp=32, n=64),
    "p16_g8": dict(P=16, G=8, tp=64, n=64),
    "p32_g8_long": dict(P=32, G=8, tp=64, n=256),
}
QUICK = {"b32_g1": dict(P=32, G=1, tp=16, n=32), "p8_g8": dict(P=8, G=8, tp=32, n=32)}


def _load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_rollout", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_rollout"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def _case(old, c: dict, repeats: int, old_models=None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mrl_jax import models, rollout
    from mrl_jax.bench_env import section

    arch = dict(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384)
    g, p = nnx.split(models.tiny_model("llama", 512, **arch))
    go, po = (g, p) if old_models is None else nnx.split(old_models.tiny_model("llama", 512, **arch))
    ids = jax.random.randint(jax.random.key(0), (c["P"], c["tp"]), 3, 512)
    mask = jnp.ones_like(ids, bool)
    rep_ids, rep_mask = jnp.repeat(ids, c["G"], 0), jnp.repeat(mask, c["G"], 0)
    kw = dict(max_new_tokens=c["n"], temperature=1.0, eos_id=None, pad_id=0)
    new_cfg, old_cfg = rollout.SamplingConfig(**kw), old.SamplingConfig(**kw)

    def run_new(k):
        return jax.block_until_ready(rollout.generate(g, p, ids, mask, k, new_cfg, num_samples=c["G"]))

    shared = "num_samples" in inspect.signature(old.generate).parameters   # an old sampler after item 3

    def run_old(k):
        if shared:
            return jax.block_until_ready(old.generate(go, po, ids, mask, k, old_cfg, num_samples=c["G"]))
        return jax.block_until_ready(old.generate(go, po, rep_ids, rep_mask, k, old_cfg))

    t0 = time.perf_counter(); out_new = run_new(jax.random.key(1)); compile_new = time.perf_counter() - t0
    t0 = time.perf_counter(); out_old = run_old(jax.random.key(1)); compile_old = time.perf_counter() - t0
    same = bool(jnp.array_equal(out_new.tokens, out_old.tokens))
    tn, to = [], []
    with section(f"ab_{c['P']}x{c['G']}_{c['tp']}+{c['n']}") as load:
        for i in range(repeats):   # alternate which side goes first
            for run, ts in ((run_new, tn), (run_old, to))[::1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter(); run(jax.random.key(2 + i)); ts.append(time.perf_counter() - t0)
    toks = c["P"] * c["G"] * c["n"]
    return dict(case=c, new_tokens_per_s=round(toks / min(tn)), old_tokens_per_s=round(toks / min(to)),
                new_over_old=round(min(to) / min(tn), 3), new_s_all=[round(t, 4) for t in tn],
                old_s_all=[round(t, 4) for t in to], tokens_identical=same, first_call_s_new=round(compile_new, 2),
                first_call_s_old=round(compile_old, 2), load=load, contended=load["contended"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--old", help="path of the old mrl_jax/rollout.py")
    which.add_argument("--old-rev", help="a git revision: its whole mrl_jax package is the old side")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from mrl_jax.bench import print_figures, run_recorded

    old_models = None
    if args.old_rev:
        from old_tree import import_old_package

        pkg = import_old_package(args.old_rev)
        old, old_models = (importlib.import_module(f"{pkg.__name__}.{m}") for m in ("rollout", "models"))
    else:
        old = _load_old(args.old)
    cases = QUICK if args.quick else CASES
    figures = run_recorded(lambda: {name: _case(old, c, args.repeats, old_models) for name, c in cases.items()},
                           args.wait_idle)
    print_figures(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
