"""Trace+lower vs XLA compile time of the jitted update's gradient for a tiny model (1 layer, d 16, V 40;
2 prompts x 4 samples, 3 + 4 tokens) under the current ``XLA_FLAGS``: what the test suite pays per update.

    python benchmarks/compile_time.py
    XLA_FLAGS=--xla_backend_optimization_level=0 python benchmarks/compile_time.py    # the tests' setting

Prints one JSON line per case (probe, micro-batch size): seconds to trace and lower, seconds to compile, HLO lines.
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mrl_jax import see  # noqa: E402
from mrl_jax.learner import GRPOConfig, make_grad_fn  # noqa: E402
from mrl_jax.rows import Rows, own_rows  # noqa: E402
from mrl_jax.models import tiny_model  # noqa: E402


def _batch(P=2, G=4, T=4) -> Rows:
    rng = np.random.default_rng(0)
    return own_rows(prompt_ids=jnp.asarray(rng.integers(1, 40, (P, 3)), jnp.int32), prompt_mask=jnp.ones((P, 3), bool),
                 completion_ids=jnp.asarray(rng.integers(1, 40, (P * G, T)), jnp.int32),
                 completion_mask=jnp.ones((P * G, T), jnp.float32), old_logp=jnp.full((P * G, T), -3.7),
                 ref_logp=jnp.full((P * G, T), -3.6), rewards=jnp.asarray(rng.random(P * G), jnp.float32),
                 truncated=jnp.zeros((P * G,), bool))


def main() -> None:
    gd, params = nnx.split(tiny_model("llama", 40, seed=0, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1))
    batch, view, key = _batch(), see.empty_view(2, 1, 4, 4, 2), jax.random.key(0)
    for probe, mb in (("none", 0), ("none", 4), ("sgt", 0)):
        f = make_grad_fn(gd, probe, GRPOConfig(num_generations=4, max_completion_length=4), mb, jit=True)
        t0 = time.perf_counter()
        lowered = f.lower(params, batch, view, key)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        print(json.dumps({"probe": probe, "micro_batch_size": mb, "trace_lower_s": round(t1 - t0, 3),
                          "compile_s": round(t2 - t1, 3), "hlo_lines": lowered.as_text().count("\n"),
                          "xla_flags": os.environ.get("XLA_FLAGS", ""), "load1": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
