"""The update step on bench_trl's model and small shape, under whichever tree is first on ``sys.path``:
an A/B of two commits, each in its own process (the model code differs, so they cannot share one).

    git worktree add /tmp/before c4c413f
    PYTHONPATH=/tmp/before python benchmarks/ab_update.py      # before
    python benchmarks/ab_update.py                              # this tree

Qwen2 h128, 4 layers, V 512; P 8 x G 8 rows of 16 prompt + 32 completion tokens (ragged); probe "none" with an
empty view, and probe "sgt" with 32 peer slots (4 per prompt), one per prompt filled with a peer success
and the other 24 EMPTY. 20 timed calls after one compile call; prints JSON: median / best seconds, first call, the loss (equal
across trees when the math is unchanged) and the 1-min load before / after.
"""
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mrl_jax
from mrl_jax import learner, see
from mrl_jax.models import tiny_model
from mrl_jax.rows import own_rows
P, G, Tp, Tc, V, K = 8, 8, 16, 32, 512, 4
model = tiny_model("qwen2", V, hidden_size=128, num_layers=4, intermediate_size=384, num_heads=4, num_kv_heads=2)
graphdef, params = nnx.split(model)
rs = np.random.RandomState(0)
n = P * G
lens = rs.randint(Tc // 2, Tc + 1, n)
batch = own_rows(prompt_ids=jnp.asarray(rs.randint(3, V, (P, Tp)), jnp.int32), prompt_mask=jnp.ones((P, Tp), bool),
    completion_ids=jnp.asarray(rs.randint(3, V, (n, Tc)), jnp.int32),
    completion_mask=jnp.asarray(np.arange(Tc)[None] < lens[:, None], jnp.float32),
    old_logp=jnp.asarray(rs.uniform(-7, -5, (n, Tc)), jnp.float32), ref_logp=jnp.zeros((n, Tc)),
    rewards=jnp.asarray(rs.rand(n) < 0.3, jnp.float32), truncated=jnp.zeros((n,), bool))
S = P * K
kind = np.full(S, see.EMPTY, np.int32); kind[::K] = see.PEER          # one filled slot per prompt
pm = np.zeros((S, Tc), np.float32); pm[::K, :20] = 1
stats = np.zeros((P, 2, 4), np.float32); stats[:, 1] = [G, G / 2, G / 2, G / 2]
sview = see.empty_view(P, K, Tc, Tc, 2).replace(completion_ids=jnp.asarray(rs.randint(3, V, (S, Tc)), jnp.int32),
    completion_mask=jnp.asarray(pm), row_kind=jnp.asarray(kind), dst_chunk=jnp.asarray(np.where(pm > 0, np.arange(Tc)[None], -1), jnp.int32),
    chunk_valid=jnp.asarray(pm > 0), src_chunk_logp=jnp.asarray(pm * -0.1), rewards=jnp.asarray((kind == see.PEER).astype(np.float32)),
    source=jnp.asarray(np.where(kind == see.PEER, 1, -1), jnp.int32), peer_stats=jnp.asarray(stats))
cfg = learner.GRPOConfig(num_generations=G, max_completion_length=Tc, beta=0.0, loss_type="grpo")
opt = learner.make_optimizer(1e-6)
key = jax.random.PRNGKey(0)
out = {"tree": os.path.dirname(os.path.dirname(mrl_jax.__file__)), "jax": jax.__version__}
for name, probe, view in [("none", "none", see.empty_view(P, 1, Tc, 1, 1)), ("sgt_8_of_32_slots_filled", "sgt", sview)]:
    upd = learner.make_update_step(graphdef, opt, probe, cfg, donate=False)
    st = opt.init(params)
    t0 = time.perf_counter(); r = upd(params, st, batch, view, key); jax.block_until_ready(r); first = time.perf_counter() - t0
    ts = []
    la0 = os.getloadavg()[0]
    for _ in range(20):
        t0 = time.perf_counter(); r = upd(params, st, batch, view, key); jax.block_until_ready(r); ts.append(time.perf_counter() - t0)
    out[name] = dict(median_s=round(statistics.median(ts), 4), min_s=round(min(ts), 4), first_call_s=round(first, 2),
                     load_before=la0, load_after=os.getloadavg()[0], loss=float(r[2]["loss"]))
print(json.dumps(out))
