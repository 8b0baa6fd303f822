"""One-shot accelerator check (H200): rollout throughput vs the HBM roofline, plus hooks for more.

    python benchmarks/gpu_check.py [--out FILE] [--sections a,b,...] [--budget-s 280]
    python benchmarks/gpu_check.py --tiny          # tiny shapes: runs on CPU in ~1 min (smoke test)

Writes JSON to ``--out``, else ``$OUT/gpu_check.json``, else ``./gpu_check.json``; the file is rewritten
after EVERY section, so a timeout or crash keeps what was measured. Each section runs in try/except
(an error is recorded with its traceback and the next section runs). Sections are skipped once the
time budget is spent.

Sections (in order; see ``SECTIONS``):
  env             jax/flax/transformers/torch versions, devices, memory.
  copy_bandwidth  measured device copy bandwidth (y = x * 2 over a large bf16 buffer, read + write
                  bytes / time, median of repeats) -- the denominator of the roofline.
  model           random-init Qwen2.5-0.5B-shaped model (vocab 151936, hidden 896, 24 layers, 14 q /
                  2 kv heads, head_dim 64, SwiGLU 4864, qkv bias, tied head, bf16 params & compute).
  generate_b64, generate_b256
                  ``mrl_jax.sampler.generate``: 128-token prompts (left-padded, varied lengths), 256 new
                  tokens, multinomial T=1, no EOS stop. Reports: compile time, end-to-end tokens/s,
                  prefill time (a max_new_tokens=1 call), decode-only step time
                  (t_256 - t_1) / 255, and the HBM roofline fraction:
                      bytes/step = param bytes + KV-cache bytes read per step (the whole preallocated
                                   cache [L, B, Tp+N, kvh, hd] x {k, v}: static-shape attention reads
                                   every slot, masked)
                      ideal step = bytes/step / measured copy bandwidth
                      roofline_fraction = ideal step / measured decode step
                  (also with the KV bytes of the average *filled* length, i.e. what a length-aware
                  kernel would read, and the f32 [B, V] logits bytes, which the roofline omits).
  sampler_variants  B=256 decode step with top_p=0.95 (sort-free nucleus), top_k=50 + top_p=0.95,
                  and the early-stop while_loop (eos set, never hit) vs the fixed-trip loop.
  update_long_seq the update at 16 x (256 + 4096) tokens with remat + blockwise attention: compiled memory,
                  peak device memory, MFU.
  slots_longtail  ``sampler.generate_slots`` (S = every row, with and without the ladder) against
                  ``generate`` on long-tailed lengths: seconds, compiles, row-steps per kept token.
  cudnn_attention the update's attention (prompt-once-per-group layout, forward + backward) and the prefill's
                  (causal, left-padded, forward) through ``attention="cudnn"`` (cuDNN flash via
                  ``jax.nn.dot_product_attention``) beside ours (blockwise; dense at the short shapes): median
                  seconds per impl, speedup, and cudnn's largest difference from ours. Without a GPU it runs
                  only with ``--tiny`` (jax's XLA implementation in cuDNN's place: plumbing, no timing claim).
  update_step_mfu HOOK for the lead: fill in :func:`update_step_mfu` (GRPO update-step MFU); it gets
                  the shared context (model, graphdef, params, flop/byte helpers, peak numbers).

Extending: write ``def my_section(ctx: Context) -> dict`` and add it to ``SECTIONS`` (or call
``register_section``). ``ctx`` holds args, the model once built, and results of earlier sections.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np

# Peak numbers used for fractions (H200 SXM datasheet; dense bf16, no sparsity).
H200_PEAK_BF16_FLOPS = 989.4e12
H200_PEAK_HBM_BYTES_PER_S = 4.8e12

QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
    intermediate_size=4864, tie_word_embeddings=True, qkv_bias=True, rope_theta=1_000_000.0,
    norm_eps=1e-6, param_dtype="bfloat16", dtype="bfloat16",
)
TINY = dict(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, tie_word_embeddings=True, qkv_bias=True, rope_theta=1_000_000.0,
    norm_eps=1e-6, param_dtype="bfloat16", dtype="bfloat16",
)


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    out_path: str
    t_start: float
    results: dict
    model: Any = None
    graphdef: Any = None
    params: Any = None
    shape: dict = dataclasses.field(default_factory=dict)

    @property
    def tiny(self) -> bool:
        return bool(self.args.tiny)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()


# ------------------------------------------------------------------------------------------------ utils
def _block(x):
    import jax
    return jax.block_until_ready(x)


def timeit(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1) -> dict:
    """Median wall time of ``fn`` (which must block), after ``warmup`` calls; first call timed too."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def tree_bytes(tree) -> int:
    import jax
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")))


def _write(ctx: Context) -> None:
    tmp = ctx.out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(ctx.results, f, indent=2, default=str)
    os.replace(tmp, ctx.out_path)


# ------------------------------------------------------------------------------------------------ sections
def section_env(ctx: Context) -> dict:
    import flax
    import jax

    info = {"jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "tiny": ctx.tiny}
    for mod in ("transformers", "torch", "optax"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # pragma: no cover
            info[mod] = f"unavailable: {e}"
    try:
        info["memory_stats"] = {k: v for k, v in (jax.devices()[0].memory_stats() or {}).items()
                                if k in ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")}
    except Exception:
        pass
    return info


def section_copy_bandwidth(ctx: Context) -> dict:
    import jax
    import jax.numpy as jnp

    nbytes = (64 << 20) if ctx.tiny else (4 << 30)
    n = nbytes // 2
    x = _block(jnp.ones((n,), jnp.bfloat16))
    f = jax.jit(lambda a: a * 2)
    res = {}
    t = timeit(lambda: _block(f(x)), repeats=10, warmup=2)
    moved = 2 * nbytes  # read + write
    res["buffer_bytes"] = nbytes
    res["copy_bytes_per_s"] = moved / t["median_s"]
    res["copy_bytes_per_s_best"] = moved / t["min_s"]
    res["fraction_of_datasheet"] = res["copy_bytes_per_s"] / H200_PEAK_HBM_BYTES_PER_S
    ctx.shape["copy_bw"] = res["copy_bytes_per_s"]
    return res


def build_model(ctx: Context):
    import jax
    from flax import nnx

    from mrl_jax import models

    shape = TINY if ctx.tiny else QWEN25_05B
    kw = dict(shape)
    vocab = kw.pop("vocab_size")
    t0 = time.perf_counter()
    model = models.tiny_model("qwen2", vocab, seed=0, **kw)
    graphdef, params = nnx.split(model)
    params = _block(params)
    ctx.model, ctx.graphdef, ctx.params = model, graphdef, params
    ctx.shape.update(model=shape)
    return {
        "shape": shape,
        "param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
        "param_bytes": tree_bytes(params),
        "build_s": time.perf_counter() - t0,
    }


def section_model(ctx: Context) -> dict:
    return build_model(ctx)


def _prompts(b: int, tp: int, vocab: int, seed: int = 0):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    lens = rng.integers(tp // 2, tp + 1, size=b)
    lens[0] = tp
    ids = np.zeros((b, tp), np.int32)
    mask = np.zeros((b, tp), bool)
    for i, n in enumerate(lens):
        ids[i, tp - n:] = rng.integers(3, vocab, size=n)
        mask[i, tp - n:] = True
    return jnp.asarray(ids), jnp.asarray(mask), float(lens.mean())


def kv_cache_bytes(shape: dict, b: int, s: int) -> int:
    import jax.numpy as jnp
    item = jnp.dtype(shape["dtype"]).itemsize
    return 2 * shape["num_layers"] * b * s * shape["num_kv_heads"] * shape["head_dim"] * item


def measure_generation(ctx: Context, b: int, tp: int, n: int, config_kw: dict | None = None,
                       repeats: int = 3, with_prefill: bool = True) -> dict:
    import jax

    from mrl_jax.sampler import SamplingConfig, generate

    if ctx.params is None:
        build_model(ctx)
    shape = ctx.shape["model"]
    ids, mask, mean_len = _prompts(b, tp, shape["vocab_size"])
    cfg = SamplingConfig(max_new_tokens=n, **({"temperature": 1.0, "eos_id": None, "pad_id": 0} | (config_kw or {})))
    key = [jax.random.key(1)]

    def call(c):
        def f():
            key[0], k = jax.random.split(key[0])
            return _block(generate(ctx.graphdef, ctx.params, ids, mask, k, c))
        return f

    full = timeit(call(cfg), repeats=repeats)
    res = {"batch": b, "prompt_len": tp, "new_tokens": n, "sampling": dataclasses.asdict(cfg),
           "compile_plus_first_s": full["first_s"], "total_s": full["median_s"],
           "tokens_per_s": b * n / full["median_s"]}
    if with_prefill:
        pre = timeit(call(dataclasses.replace(cfg, max_new_tokens=1)), repeats=repeats)
        step = max((full["median_s"] - pre["median_s"]) / (n - 1), 1e-9)
        s = tp + n
        pbytes = tree_bytes(ctx.params)
        kv_full = kv_cache_bytes(shape, b, s)
        kv_filled = kv_cache_bytes(shape, b, 1) * (mean_len + n / 2)
        bw = ctx.shape.get("copy_bw") or H200_PEAK_HBM_BYTES_PER_S
        ideal = (pbytes + kv_full) / bw
        res.update({
            "prefill_s": pre["median_s"],
            "decode_step_s": step,
            "decode_tokens_per_s": b / step,
            "bytes_per_step": pbytes + kv_full,
            "param_bytes": pbytes,
            "kv_cache_bytes_full": kv_full,
            "kv_cache_bytes_avg_filled": kv_filled,
            "logits_bytes_per_step_f32": b * shape["vocab_size"] * 4,
            "copy_bw_bytes_per_s": bw,
            "ideal_step_s": ideal,
            "roofline_fraction": ideal / step,
            "roofline_fraction_filled_kv": (pbytes + kv_filled) / bw / step,
            "roofline_fraction_end_to_end": ideal * (n - 1) / full["median_s"],
        })
    return res


def _gen_shapes(ctx: Context):
    return (16, 16) if ctx.tiny else (128, 256)


def section_generate_b64(ctx: Context) -> dict:
    tp, n = _gen_shapes(ctx)
    return measure_generation(ctx, 4 if ctx.tiny else 64, tp, n)


def section_generate_b256(ctx: Context) -> dict:
    tp, n = _gen_shapes(ctx)
    return measure_generation(ctx, 8 if ctx.tiny else 256, tp, n)


def section_sampler_variants(ctx: Context) -> dict:
    tp, n = _gen_shapes(ctx)
    b = 8 if ctx.tiny else 256
    n = min(n, 64)  # enough steps to see the per-step cost; compiles dominate otherwise
    base = measure_generation(ctx, b, tp, n, repeats=2, with_prefill=False)
    out = {"baseline_T1": base}
    variants = {
        "top_p_0.95": {"top_p": 0.95},
        "top_k_50_top_p_0.95": {"top_k": 50, "top_p": 0.95},
        "greedy": {"greedy": True},
        "eos_while_loop": {"eos_id": 0, "stop_early": True},  # random model: EOS ~never hit
    }
    for name, kw in variants.items():
        if ctx.left() < 25:
            out[name] = {"skipped": "time budget"}
            continue
        try:
            r = measure_generation(ctx, b, tp, n, kw, repeats=2, with_prefill=False)
            r["slowdown_vs_baseline"] = r["total_s"] / base["total_s"]
            out[name] = r
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    return out


def section_slots_longtail(ctx: Context) -> dict:
    """The slot sampler on long-tailed lengths against the static sampler (issue 34): 256 rows (32 prompts x G 8;
    tiny: 16), 128 + 512 tokens, a stop set of V * 8 / N ids (the random model's lengths roughly geometric, mean
    ~N / 8). Reports each sampler's median seconds, first call (compiles), row-steps per kept token, and the
    fraction of tokens equal to the static sampler's (bf16: the two attention paths may round apart)."""
    import jax

    from mrl_jax.sampler import SamplingConfig, generate, generate_slots

    if ctx.params is None:
        build_model(ctx)
    vocab = ctx.shape["model"]["vocab_size"]
    p, g, tp, n = (2, 8, 16, 64) if ctx.tiny else (32, 8, 128, 512)
    ids, mask, _ = _prompts(p, tp, vocab)
    cfg = SamplingConfig(max_new_tokens=n, temperature=1.0, eos_id=tuple(range(3, 3 + max(1, vocab * 8 // n))),
                         pad_id=0)
    key, host_ids, host_mask = jax.random.key(7), np.asarray(ids), np.asarray(mask)
    t = timeit(lambda: _block(generate(ctx.graphdef, ctx.params, ids, mask, key, cfg, num_samples=g)))   # compiles
    static = jax.device_get(generate(ctx.graphdef, ctx.params, ids, mask, key, cfg, num_samples=g))
    kept = int(static.lengths.sum())
    res = {"rows": p * g, "prompt_len": tp, "new_tokens": n, "kept_tokens": kept,
           "mean_length": kept / (p * g), "max_length": int(static.lengths.max()), "static": t}
    for name, kw in {"slots_ladder": {}, "slots_fixed": {"shrink": False}}.items():
        if ctx.left() < 20:
            res[name] = {"skipped": "time budget"}
            continue
        t = timeit(lambda: generate_slots(ctx.graphdef, ctx.params, host_ids, host_mask, key, cfg, num_samples=g,
                                          **kw))   # first_s: with the compiles of every rung
        out, stats = generate_slots(ctx.graphdef, ctx.params, host_ids, host_mask, key, cfg, num_samples=g, **kw)
        res[name] = {**t, "rungs": list(stats["rungs"]), "row_steps_per_kept_token": stats["row_steps"] / kept,
                     "tokens_equal_fraction": float(np.mean(out.tokens == static.tokens)),
                     "speedup_vs_static": res["static"]["median_s"] / t["median_s"]}
    return res


def update_step_mfu(ctx: Context) -> dict:
    """The jitted GRPO update (probe ``none``, chunked log-softmax, AdamW) on batch 16 x 1024 tokens
    (64 prompt + 960 completion) of the bf16 model; MFU against a measured bf16 matmul ceiling and the
    H200 spec peak. FLOPs/token = 6 N_non-embedding + 6 hidden vocab + 12 L hidden T (GPU-ANCHORS.md)."""
    rows, tp, tc = (4, 8, 24) if ctx.tiny else (16, 64, 960)
    return dict(_update_mfu(ctx, rows, tp, tc, ctx.graphdef), hf_reference_tokens_per_s=88.7e3)


def update_long_seq(ctx: Context) -> dict:
    """The update at 16 x (256 + 4096) tokens with per-layer remat (``remat="full"``) and blockwise attention
    (``attention="blockwise"``): XLA's compiled memory analysis, the device's peak bytes in use, and MFU (the
    FLOPs count no recompute: remat's extra forward is overhead, as in the MFU convention)."""
    from flax import nnx

    from mrl_jax.models.factory import abstract_model

    rows, tp, tc = (4, 8, 40) if ctx.tiny else (16, 256, 4096)
    cfg = ctx.model.config.replace(remat="full", attention="blockwise")
    graphdef = nnx.split(abstract_model(cfg))[0]
    return _update_mfu(ctx, rows, tp, tc, graphdef, memory=True)


def _update_mfu(ctx: Context, rows: int, tp: int, tc: int, graphdef, memory: bool = False) -> dict:
    import jax
    import jax.numpy as jnp

    from mrl_jax import see
    from mrl_jax.learner import GRPOConfig, make_optimizer, make_update_step
    from mrl_jax.rows import own_rows

    m = ctx.shape["model"]
    n = 4096 if not ctx.tiny else 256
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    t_mm = timeit(lambda: mm(a).block_until_ready(), repeats=5, warmup=2)["median_s"]
    ceiling = 2 * n ** 3 / t_mm
    cfg = GRPOConfig(num_generations=8 if not ctx.tiny else 2, max_completion_length=tc, logprob_chunk_size=128)
    opt = make_optimizer(1e-6)
    update = make_update_step(graphdef, opt, "none", cfg)
    P = rows // cfg.num_generations
    key = jax.random.PRNGKey(0)
    batch = own_rows(prompt_ids=jax.random.randint(key, (P, tp), 0, m["vocab_size"], jnp.int32),
                  prompt_mask=jnp.ones((P, tp), bool),
                  completion_ids=jax.random.randint(key, (rows, tc), 0, m["vocab_size"], jnp.int32),
                  completion_mask=jnp.ones((rows, tc), jnp.float32), old_logp=jnp.full((rows, tc), -5.0),
                  ref_logp=jnp.zeros((rows, tc)), rewards=jnp.tile(jnp.array([0.0, 1.0]), rows // 2),
                  truncated=jnp.zeros((rows,), bool))
    view = see.empty_view(P, 1, tc, 1, 1)
    state = {"p": jax.tree.map(jnp.array, ctx.params)}
    state["o"] = opt.init(state["p"])
    out = {}
    if memory:
        mem = update.lower(state["p"], state["o"], batch, view, key).compile().memory_analysis()
        out["compiled_gb"] = {k: getattr(mem, f"{k}_size_in_bytes") / 1e9
                              for k in ("temp", "argument", "output", "alias")}

    def step():
        state["p"], state["o"], met = update(state["p"], state["o"], batch, view, key)
        jax.block_until_ready(met["loss"])

    t = timeit(step, repeats=5 if not memory else 3, warmup=1 if memory else 2)
    if memory:
        stats = jax.devices()[0].memory_stats() or {}
        out["peak_bytes_in_use_gb"] = stats.get("peak_bytes_in_use", 0) / 1e9
    tokens = rows * (tp + tc)
    n_emb = m["vocab_size"] * m["hidden_size"]
    n_params = int(sum(x.size for x in jax.tree.leaves(ctx.params)))
    flops_tok = 6 * (n_params - n_emb) + 6 * m["hidden_size"] * m["vocab_size"] + 12 * m["num_layers"] * m["hidden_size"] * (tp + tc)
    achieved = flops_tok * tokens / t["median_s"]
    return dict(out, rows=rows, tokens_per_step=tokens, step=t, tokens_per_s=tokens / t["median_s"],
                matmul_ceiling_flops=ceiling, mfu_vs_measured_ceiling=achieved / ceiling,
                mfu_vs_spec_peak=achieved / H200_PEAK_BF16_FLOPS)


def _attention_inputs(rng, b: int, t: int, h: int, kv: int, d: int):
    import jax.numpy as jnp
    return [jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16) for n in (h, kv, kv)]


def _time_attention(name: str, fn, args, impls, ref: str) -> dict:
    """Each impl's jitted ``fn(impl, *args)`` (returning a pytree of arrays): timing, and the largest absolute
    difference of its leaves from ``ref``'s (float32), also relative to the largest |ref| of that leaf. Prints
    one line."""
    import jax

    res, outs = {}, {}
    for impl in impls:
        f = jax.jit(lambda *a, _impl=impl: fn(_impl, *a))
        res[impl] = timeit(lambda: _block(f(*args)), repeats=5, warmup=2)
        outs[impl] = [np.asarray(x, np.float32) for x in jax.tree.leaves(f(*args))]
    for impl in impls:
        pairs = list(zip(outs[impl], outs[ref]))
        res[impl]["max_abs_diff_vs_" + ref] = max(float(np.max(np.abs(a - b))) for a, b in pairs)
        res[impl]["max_rel_diff_vs_" + ref] = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
                                                  for a, b in pairs)
        res[impl]["speedup_vs_" + ref] = res[ref]["median_s"] / res[impl]["median_s"]
    print(f"[gpu_check] cudnn_attention {name}: " + ", ".join(
        f"{i} {res[i]['median_s'] * 1e3:.3f} ms (x{res[i]['speedup_vs_' + ref]:.2f}, rel diff "
        f"{res[i]['max_rel_diff_vs_' + ref]:.1e})" for i in impls), flush=True)
    return res


def section_cudnn_attention(ctx: Context) -> dict:
    """cuDNN's flash attention beside ours at Qwen2.5-0.5B's heads (14 q / 2 kv, head dim 64, bf16): the update's
    prompt-once-per-group layout (P prompts x 8 completions, prompts left-padded, completions right-padded at
    long-tailed lengths), value and q/k/v gradients of sum(out * w) over the real tokens; the prefill's causal
    attention of left-padded prompts, forward. "implementation" says what ran in cuDNN's place ("xla" on a CPU)."""
    import jax
    import jax.numpy as jnp

    from mrl_jax.models import cudnn
    from mrl_jax.models.attention import CausalMask, PrefixMask, attention

    how = cudnn.implementation(jnp.bfloat16, 64, None)
    res = {"implementation": how, "backend": jax.default_backend()}
    if how != "cudnn" and not ctx.tiny:
        return dict(res, skipped="no CUDA GPU: cuDNN's path runs only there (use --tiny for the plumbing)")
    h, kv, d, scale = 14, 2, 64, 64 ** -0.5
    rng = np.random.default_rng(0)
    update_cases = [(2, 2, 8, 24, ("cudnn", "blockwise", "dense"))] if ctx.tiny else [
        (2, 8, 64, 960, ("cudnn", "blockwise", "dense")), (2, 8, 256, 4096, ("cudnn", "blockwise"))]
    for p, m, tp, tc, impls in update_cases:
        name = f"update_{p * m}x({tp}+{tc})"
        if ctx.left() < 20:
            res[name] = {"skipped": "time budget"}
            continue
        pm = np.arange(tp)[None, :] >= rng.integers(0, tp // 2, size=(p, 1))
        lengths = np.clip(rng.geometric(4 / tc, size=p * m), 1, tc)
        lengths[0] = tc
        cm = np.arange(tc)[None, :] < lengths[:, None]
        mask = PrefixMask.build(jnp.asarray(pm), jnp.asarray(cm))
        valid = jnp.concatenate([jnp.asarray(pm).reshape(-1), jnp.asarray(cm).reshape(-1)])[None, :, None, None]
        q, k, v = _attention_inputs(rng, 1, p * tp + p * m * tc, h, kv, d)
        w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

        def grads(impl, q, k, v):
            def loss(q, k, v):
                out = attention(q, k, v, mask, scale=scale, impl=impl)[0]
                return jnp.sum(jnp.where(valid, out.astype(jnp.float32) * w, 0.0))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        res[name] = dict(_time_attention(name, grads, (q, k, v), impls, "blockwise"),
                         completion_mean=float(lengths.mean()))
    b, t = (4, 16) if ctx.tiny else (256, 128)
    if ctx.left() >= 10:
        pad = rng.integers(0, t // 2, size=(b, 1))
        valid = jnp.asarray(np.arange(t)[None, :] >= pad)
        mask = CausalMask(kv_mask=valid, offset=0, num_queries=t)
        q, k, v = _attention_inputs(rng, b, t, h, kv, d)

        def prefill(impl, q, k, v):
            return jnp.where(valid[:, :, None, None], attention(q, k, v, mask, scale=scale, impl=impl)[0], 0)
        name = f"prefill_{b}x{t}"
        res[name] = _time_attention(name, prefill, (q, k, v), ("cudnn", "dense"), "dense")
    return res


def section_update_step_mfu(ctx: Context) -> dict:
    return update_step_mfu(ctx)


SECTIONS: list[tuple[str, Callable[[Context], dict], float]] = [
    # (name, fn, seconds of budget it needs to be started)
    ("env", section_env, 0),
    ("copy_bandwidth", section_copy_bandwidth, 10),
    ("model", section_model, 20),
    ("generate_b64", section_generate_b64, 40),
    ("generate_b256", section_generate_b256, 40),
    ("cudnn_attention", section_cudnn_attention, 30),
    ("update_step_mfu", section_update_step_mfu, 20),
    ("update_long_seq", update_long_seq, 60),
    ("sampler_variants", section_sampler_variants, 40),
    ("slots_longtail", section_slots_longtail, 90),
]


def register_section(name: str, fn: Callable[[Context], dict], min_budget_s: float = 20,
                     before: str | None = None) -> None:
    """Add a section (before the named one, else at the end)."""
    entry = (name, fn, min_budget_s)
    if before is not None:
        idx = [n for n, _, _ in SECTIONS].index(before)
        SECTIONS.insert(idx, entry)
    else:
        SECTIONS.append(entry)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or ./gpu_check.json)")
    p.add_argument("--sections", default=None, help="comma-separated subset of: "
                   + ",".join(n for n, _, _ in SECTIONS))
    p.add_argument("--budget-s", type=float, default=280.0, help="stop starting sections after this")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="wait at most SECONDS for the host to be quiet first (load below 0.25 per core)")
    args = p.parse_args(argv)
    from mrl_jax.bench import load as bench_load

    out = args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_check.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    ctx = Context(args=args, out_path=out, t_start=time.perf_counter(), results={"sections": {}})
    if args.wait_idle > 0:
        ctx.results["wait_idle"] = bench_load.wait_idle(args.wait_idle)
    wanted = set(args.sections.split(",")) if args.sections else None
    for name, fn, need in SECTIONS:
        if wanted is not None and name not in wanted:
            continue
        if ctx.left() < need:
            ctx.results["sections"][name] = {"skipped": f"time budget ({ctx.elapsed():.0f}s elapsed)"}
            _write(ctx)
            continue
        t0 = time.perf_counter()
        with bench_load.section(name) as load:  # host load: a busy host delays dispatch on any device
            try:
                r = fn(ctx)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        r["section_s"] = time.perf_counter() - t0
        r["load"], r["contended"] = load, load["contended"]
        ctx.results["sections"][name] = r
        ctx.results["elapsed_s"] = ctx.elapsed()
        _write(ctx)
        print(f"[gpu_check] {name}: {r.get('error', 'ok')} ({r['section_s']:.1f}s)", flush=True)
    print(json.dumps(ctx.results, indent=2, default=str))
    print(f"[gpu_check] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
