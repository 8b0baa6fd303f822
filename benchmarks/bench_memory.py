"""XLA's compiled memory analysis of the jitted GRPO update at real model shapes (nothing is allocated).

The update (``learner.make_update_step``, probe ``none``, AdamW, bf16 params and compute, 16 rows = 2 prompts x
G 8 in one micro-batch) is lowered on abstract params / optimizer state / batch and compiled; the figures are
``compiled.memory_analysis()`` (bytes, load-independent). Three variants per shape:

* ``none``: no rematerialisation, dense attention (one float32 [B, K, g, T, S] score array per layer);
* ``remat``: every decoder layer under ``jax.checkpoint`` (``remat="full"``), dense attention;
* ``remat+blockwise``: remat and ``models.flash`` blockwise attention (no T x S array, recomputing backward).

    python benchmarks/bench_memory.py                       # 0.5B and 1.5B, 256+1024 and 256+4096
    python benchmarks/bench_memory.py --models qwen2.5-0.5b --completions 1024 --variants remat+blockwise
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_memory.py --models llama-3.1-8b \\
        --completions 1024 --variants remat+blockwise --fsdp 8      # per device, params/optimizer sharded

Prints one JSON line per measurement: temp_gb (temporaries), args_gb, out_gb, alias_gb, total_gb =
args + out + temp - alias (the step's peak estimate), state_gb (params + AdamW state). The figures come from
the library's memory plan (``mrl_jax.mwra.memory_plan.step_memory``, the one ``mrl train`` checks a run with).
"""
from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from flax import nnx

from mrl_jax import learner, see
from mrl_jax.models.config import ModelConfig
from mrl_jax.models.factory import abstract_model
from mrl_jax.mwra import sharding
from mrl_jax.mwra.memory_plan import step_memory, tree_bytes
from mrl_jax.trainer.memory import abstract_rows, placed

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14,
                         num_kv_heads=2, head_dim=64, intermediate_size=4864, tie_word_embeddings=True, qkv_bias=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, head_dim=128, intermediate_size=8960, tie_word_embeddings=True,
                         qkv_bias=True),
    "smollm2-360m": dict(model_type="llama", vocab_size=49152, hidden_size=960, num_layers=32, num_heads=15,
                         num_kv_heads=5, head_dim=64, intermediate_size=2560, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                         rope_theta=500000.0),
}
VARIANTS = {"none": ("none", "dense"), "remat": ("full", "dense"), "remat+blockwise": ("full", "blockwise")}
_GB = 1e9


def _placed(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def update_memory(config: ModelConfig, P: int, G: int, Tp: int, Tc: int, micro_batch_size: int = 0,
                  fsdp: int = 1, probe: str = "none", slots: int = 1) -> dict:
    """memory_analysis() of the compiled update (bytes) for ``config`` on abstract inputs (``probe`` with a SEE
    view of ``slots`` per prompt); fsdp > 1: params, optimizer state and batch sharded over that many devices
    (figures per device)."""
    graphdef, params = nnx.split(abstract_model(config))
    opt = learner.make_optimizer(1e-6)
    opt_state = jax.eval_shape(opt.init, params)
    cfg = learner.GRPOConfig(num_generations=G, max_completion_length=Tc, beta=0.0)
    update = learner.make_update_step(graphdef, opt, probe, cfg, micro_batch_size, donate=True)
    batch = abstract_rows(P, G, Tp, Tc)
    view = jax.eval_shape(lambda: see.empty_view(P, slots, Tc, Tc, 2))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    if fsdp > 1:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:fsdp]), ("data",))
        ps = sharding.param_shardings(params, mesh)
        params, opt_state = _placed(params, ps), _placed(opt_state, sharding.opt_state_shardings(opt_state, ps, mesh))
        batch, view, key = placed(batch, mesh), placed(view, mesh), placed(key, mesh)
    mem = step_memory(update, params, opt_state, batch, view, key)
    return dict(mem._asdict(), total=mem.peak, state=tree_bytes(params) + tree_bytes(opt_state))


def rows(models, completions, variants, prompt: int = 256, prompts: int = 2, generations: int = 8,
         fsdp: int = 1, shapes=SHAPES, micro_batch: int = 0, probe: str = "none", slots: int = 1) -> list[dict]:
    """One record per (model, completion length, variant): the update's compiled memory in GB."""
    out = []
    for name in models:
        for tc in completions:
            for variant in variants:
                remat, attn = VARIANTS[variant]
                cfg = ModelConfig(family="llama", **shapes[name], dtype="bfloat16", param_dtype="bfloat16",
                                  remat=remat, attention=attn)
                m = update_memory(cfg, prompts, generations, prompt, tc, micro_batch, fsdp, probe, slots)
                out.append(dict(model=name, tokens=f"{prompt}+{tc}", rows=prompts * generations, variant=variant,
                                fsdp=fsdp, micro_batch=micro_batch, probe=probe,
                                **{k + "_gb": round(v / _GB, 3) for k, v in m.items()}))
    return out


TINY = {"tiny": dict(model_type="qwen2", vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, intermediate_size=512, tie_word_embeddings=True, qkv_bias=True)}


def run(quick: bool = False) -> dict:
    """``mrl bench``: the Qwen2.5-0.5B rows of RESULTS section 8 (quick: a 4-layer d128 model at 256 + 256 and
    256 + 1024 tokens, none vs remat+blockwise), with the temporaries' growth over the token range per variant."""
    if quick:
        recs = rows(["tiny"], [256, 1024], ["none", "remat+blockwise"], shapes=TINY)
    else:
        recs = rows(["qwen2.5-0.5b"], [1024, 4096], ["remat+blockwise"])
    growth = {}
    for variant in {r["variant"] for r in recs}:
        temps = [r["temp_gb"] for r in recs if r["variant"] == variant]
        growth[variant] = round(temps[-1] / temps[0], 2)
    return {"rows": recs, "temp_growth": growth}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"], choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completions", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=0, help="rows per micro-batch (0 = all rows in one)")
    ap.add_argument("--probe", default="none", help="probe chain of the update (e.g. xgrpo+sgt)")
    ap.add_argument("--slots", type=int, default=1, help="SEE view slots per prompt")
    a = ap.parse_args(argv)
    for name in a.models:
        for tc in a.completions:
            for variant in a.variants:
                for rec in rows([name], [tc], [variant], a.prompt, a.prompts, a.generations, a.fsdp,
                                micro_batch=a.micro_batch, probe=a.probe, slots=a.slots):
                    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
