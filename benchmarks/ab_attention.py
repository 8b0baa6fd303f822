"""A/B of two attention implementations (``mrl_jax/models/attention.py``) in ONE process, interleaved.

    git show 06abcb1~1:mrl_jax/models/attention.py > /tmp/old_attention.py    # before the block-merged softmax
    python benchmarks/ab_attention.py --old /tmp/old_attention.py [--repeats 8] [--wait-idle 300] [--out FILE]

The old file is imported as a separate module. While an "old" program traces, the model's attention kernels
(``_attend``, ``_attend_prefix``, ``_attend_shared``) are that module's, so each side compiles its own program from
the same weights and inputs (the sampler from its own copy of ``rollout.py``: ``generate``'s compile cache is per
module). Cases, on bench_trl's model (Qwen2 h128, 4 layers, 4 / 2 heads, V 512):

* ``layer_forward`` / ``layer_gradient``: one layer's prompt-shared attention (P 8 prompts x M 8 completions,
  128 + 128 tokens), its output and the gradient of a fixed linear loss on it;
* ``update``: ``learner.make_update_step`` (probe none) at that shape;
* ``generate_grpo`` (P 8 x G 8, 128 + 128) and ``generate_plain`` (128 x 1, 32 + 64).

Reported per case: min / median seconds of each side, old / new, the largest difference between their float
results, whether their integer results (sampled tokens) are equal, and the load record (``mrl_jax.bench_env``).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import statistics
import sys
import time

KERNELS = ("_attend", "_attend_prefix", "_attend_shared")
P, M, TP, TC, V = 8, 8, 128, 128, 512


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _kernels_of(attention, module):
    """``attention``'s kernels replaced by ``module``'s (those it has) inside the block."""
    saved = {k: getattr(attention, k) for k in KERNELS}
    for k in KERNELS:
        if hasattr(module, k):
            setattr(attention, k, getattr(module, k))
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(attention, k, v)


def _max_diff(a, b) -> float:
    import jax
    import numpy as np
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.asarray(x).dtype.kind == "f")


def _same_ints(a, b) -> bool:
    import jax
    import numpy as np
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
               if np.asarray(x).dtype.kind in "iub")


def _interleaved(new, old, repeats: int) -> dict:
    """Both callables already compiled; ``repeats`` alternating timed calls."""
    tn, to = [], []
    for _ in range(repeats):
        for f, ts in ((new, tn), (old, to)):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return dict(new_min_s=round(min(tn), 4), new_median_s=round(statistics.median(tn), 4),
                old_min_s=round(min(to), 4), old_median_s=round(statistics.median(to), 4),
                old_over_new_min=round(min(to) / min(tn), 3),
                old_over_new_median=round(statistics.median(to) / statistics.median(tn), 3))


def _layer_cases(attention, old):
    import jax
    import jax.numpy as jnp
    import numpy as np
    H, K, D = 4, 2, 32
    n, rs = P * TP + P * M * TC, np.random.RandomState(0)
    q, ct = (jnp.asarray(rs.randn(1, n, H, D), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rs.randn(1, n, K, D), jnp.float32) for _ in range(2))
    cm = jnp.asarray(np.arange(TC)[None] < rs.randint(TC // 2, TC + 1, (P * M, 1)), jnp.float32)
    mask = attention.PrefixMask.build(jnp.ones((P, TP), bool), cm)
    cases = {}
    for name, impl in (("new", attention._attend_prefix), ("old", old._attend_prefix)):
        fwd = jax.jit(lambda q, k, v, f=impl: f(q, k, v, mask, D ** -0.5))
        grad = jax.jit(jax.grad(lambda q, k, v, f=impl: jnp.sum(f(q, k, v, mask, D ** -0.5) * ct), argnums=(0, 1, 2)))
        cases.setdefault("layer_forward", {})[name] = lambda f=fwd: jax.block_until_ready(f(q, k, v))
        cases.setdefault("layer_gradient", {})[name] = lambda f=grad: jax.block_until_ready(f(q, k, v))
    return cases


def _model():
    from flax import nnx

    from mrl_jax.models import tiny_model
    return nnx.split(tiny_model("qwen2", V, hidden_size=128, num_layers=4, intermediate_size=384, num_heads=4,
                                num_kv_heads=2))


def _update_case(attention, old) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mrl_jax import learner, see
    from mrl_jax.rows import own_rows
    graphdef, params = _model()
    rs, rows = np.random.RandomState(0), P * M
    batch = own_rows(
        prompt_ids=jnp.asarray(rs.randint(3, V, (P, TP)), jnp.int32), prompt_mask=jnp.ones((P, TP), bool),
        completion_ids=jnp.asarray(rs.randint(3, V, (rows, TC)), jnp.int32),
        completion_mask=jnp.asarray(np.arange(TC)[None] < rs.randint(TC // 2, TC + 1, (rows, 1)), jnp.float32),
        old_logp=jnp.asarray(rs.uniform(-7, -5, (rows, TC)), jnp.float32), ref_logp=jnp.zeros((rows, TC)),
        rewards=jnp.asarray(rs.rand(rows) < 0.3, jnp.float32), truncated=jnp.zeros((rows,), bool))
    cfg = learner.GRPOConfig(num_generations=M, max_completion_length=TC, beta=0.0, loss_type="grpo")
    opt = learner.make_optimizer(1e-6)
    state, key, view = opt.init(params), jax.random.PRNGKey(0), see.empty_view(P, 1, TC, 1, 1)
    steps = {name: learner.make_update_step(graphdef, opt, "none", cfg, donate=False) for name in ("new", "old")}
    return {name: (lambda s=s: jax.block_until_ready(s(params, state, batch, view, key))) for name, s in steps.items()}


def _generate_cases(rollout_new, rollout_old) -> dict:
    import jax
    import jax.numpy as jnp
    graphdef, params = _model()
    cases = {}
    for case, (prompts, samples, tp, new_tokens) in {"generate_grpo": (P, M, TP, TC),
                                                     "generate_plain": (128, 1, 32, 64)}.items():
        ids = jax.random.randint(jax.random.key(0), (prompts, tp), 3, V)
        mask = jnp.ones_like(ids, bool)
        for name, mod in (("new", rollout_new), ("old", rollout_old)):
            cfg = mod.SamplingConfig(max_new_tokens=new_tokens, temperature=1.0, eos_id=None, pad_id=0)
            cases.setdefault(case, {})[name] = (
                lambda mod=mod, cfg=cfg, ids=ids, mask=mask, s=samples:
                jax.block_until_ready(mod.generate(graphdef, params, ids, mask, jax.random.key(1), cfg, num_samples=s)))
    return cases


def run(old_path: str, repeats: int) -> dict:
    from mrl_jax import rollout
    from mrl_jax.bench_env import section
    attention = importlib.import_module("mrl_jax.models.attention")
    old = _load("old_attention", old_path)
    cases = dict(_layer_cases(attention, old), update=_update_case(attention, old),
                 **_generate_cases(rollout, _load("rollout_for_old_attention", rollout.__file__)))
    out = {}
    for case, sides in cases.items():
        new_result = sides["new"]()                  # compiles with today's kernels
        with _kernels_of(attention, old):
            old_result = sides["old"]()              # traces (and compiles) with the old ones
        with section(case) as load:
            figures = _interleaved(sides["new"], sides["old"], repeats)
        out[case] = dict(figures, max_abs_diff=_max_diff(new_result, old_result),
                         integers_equal=_same_ints(new_result, old_result), load=load,
                         contended=load["contended"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="path of the old mrl_jax/models/attention.py")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from mrl_jax.bench import print_figures, run_recorded

    print_figures(run_recorded(lambda: run(args.old, args.repeats), args.wait_idle), args.out)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
