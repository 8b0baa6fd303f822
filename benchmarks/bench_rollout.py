"""Rollout throughput: mrl_jax.sampler.generate (the static sampler) vs transformers' generate (torch CPU), SAME
weights.

For each model family a small random model is built with ``transformers`` (torch), saved with
``save_pretrained`` to a temp dir and loaded with ``mrl_jax.models.from_pretrained``; both samplers then
generate exactly ``max_new_tokens`` tokens (no EOS stop; multinomial sampling, temperature 1, no
top-k/top-p) for the same left-padded prompt batch. Reported: generated tokens/s of each (min over
``repeats`` interleaved timed calls after a warm-up / compile call) and the ratio ours / transformers.

    python benchmarks/bench_rollout.py [--quick] [--out FILE]
    python benchmarks/bench_rollout.py --lengths longtail [--untimed] [--quick] [--out FILE]

``run(quick) -> dict`` is what ``mrl bench`` calls.

``--lengths longtail``: completion lengths roughly geometric with mean ~ max_new_tokens / 8 (the tiny model's
logits are near uniform, and a stop set of V * 8 / N token ids gives each step a ~8 / N chance to end the
row). Compares the static sampler (``generate``: every row decodes until the longest ends), the slot sampler
(``mrl_jax.sampler.generate_slots`` at a few slot counts S: rows enter as slots free; at S = every row also
on a fine ladder, ``Ladder(0.9, 1)``) and
``transformers.generate`` with the same stop set: decode row-steps computed per kept token (S per decode step
run) and programs compiled per call over a few keys (a run's rounds; load-independent, also with ``--untimed``),
the first call's seconds with its compiles, tokens identical (static vs slots, checked), wall times; a table on stderr.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
import time

import numpy as np

# Cases: "demo" = the embedded demo's regime (tiny policies, 16 prompts x 8 samples);
# "medium" = an ~8M-parameter model where both sides are matmul-bound on CPU;
# "*_g8" = GRPO's layout: batch = prompts x 8 samples (ours: num_samples=8, each prompt prefilled once;
# transformers: num_return_sequences=8, which expands the prompts before its prefill).
CASES = {
    "demo": dict(batch=128, prompt_len=32, new_tokens=64, hidden=96, layers=2, heads=4, kv_heads=2,
                 vocab=512, repeats=3),
    "quick": dict(batch=32, prompt_len=16, new_tokens=32, hidden=64, layers=2, heads=4, kv_heads=2,
                  vocab=512, repeats=2),
    "medium": dict(batch=16, prompt_len=64, new_tokens=128, hidden=256, layers=4, heads=8, kv_heads=4,
                   vocab=8192, repeats=2),
    "demo_g8": dict(batch=128, samples=8, prompt_len=64, new_tokens=64, hidden=96, layers=2, heads=4,
                    kv_heads=2, vocab=512, repeats=3),
    "quick_g8": dict(batch=64, samples=8, prompt_len=32, new_tokens=32, hidden=64, layers=2, heads=4,
                     kv_heads=2, vocab=512, repeats=2),
}
LONGTAIL = {
    True: dict(batch=64, samples=8, prompt_len=16, new_tokens=128, hidden=64, layers=2, heads=4, kv_heads=2,
               vocab=512, repeats=2, rounds=3),
    False: dict(batch=128, samples=8, prompt_len=32, new_tokens=512, hidden=96, layers=2, heads=4, kv_heads=2,
                vocab=512, repeats=3, rounds=4),
}
# the slot sampler's variants: (S as a fraction of the rows, its ladder's ratio and floor; None: the default ladder)
SLOT_VARIANTS = {"slots_all": (1, None), "slots_all_fine": (1, (0.9, 1)), "slots_quarter": (4, None),
                 "slots_16th": (16, None)}


# ladders the default S (every row) could move down, to read off what a row-step target costs in decode programs:
# (ratio between rungs, the last rung's floor) of `mrl_jax.sampler.Ladder`; "default" is its default
LADDERS = {"halving_to_8": (0.5, 8), "halving_to_1": (0.5, 1), "four_per_doubling_to_1": (2 ** -0.25, 1),
           "eight_per_doubling_to_1": (2 ** -0.125, 1), "ratio_0.9_to_1": (0.9, 1)}


def slot_variants(rows: int) -> dict:
    """{name: (S, sampler.Ladder)} of :data:`SLOT_VARIANTS` for ``rows`` rows."""
    from mrl_jax.sampler import Ladder

    return {name: (max(1, rows // f), Ladder(*(shape or ()))) for name, (f, shape) in SLOT_VARIANTS.items()}
PLAN = {
    True: [("llama", "quick"), ("llama", "quick_g8")],
    False: [("llama", "demo"), ("gpt2", "demo"), ("llama", "medium"), ("llama", "demo_g8"), ("qwen3", "demo_g8"),
            ("phi3", "demo_g8"), ("gemma3_text", "demo_g8")],
}
# the distinctive parts of today's families at the case's shapes (head_dim as llama's)
_FAMILY_EXTRAS = {
    "qwen3": dict(tie_word_embeddings=True),
    "phi3": dict(partial_rotary_factor=0.75, pad_token_id=0),
    "gemma3_text": dict(query_pre_attn_scalar=24, sliding_window=32,
                        layer_types=["sliding_attention", "full_attention"]),
}


def _hf_model(family: str, s: dict, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    max_pos = 2 * (s["prompt_len"] + s["new_tokens"])
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            max_position_embeddings=max_pos, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            pad_token_id=0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=s["vocab"], n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"],
            n_positions=max_pos, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    elif family in _FAMILY_EXTRAS:
        cfg = transformers.AutoConfig.for_model(
            family, vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=4 * s["hidden"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            head_dim=s["hidden"] // s["heads"], max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2,
            **{"pad_token_id": 0, **_FAMILY_EXTRAS[family]})
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    else:
        raise ValueError(family)
    return model.eval().to(torch.float32)


def _prompts(s: dict, vocab: int, seed: int = 0):
    """(ids int32[P, Tp], mask bool[P, Tp]) left-padded random prompts, P = batch // samples."""
    rng = np.random.default_rng(seed)
    b, tp = s["batch"] // s.get("samples", 1), s["prompt_len"]
    lens = rng.integers(tp // 2, tp + 1, size=b)
    lens[0] = tp
    ids = np.zeros((b, tp), np.int32)
    mask = np.zeros((b, tp), bool)
    for i, n in enumerate(lens):
        ids[i, tp - n:] = rng.integers(3, vocab, size=n)
        mask[i, tp - n:] = True
    return ids, mask


def _has_num_samples(generate) -> bool:
    import inspect

    try:
        return "num_samples" in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_family(family: str, s: dict) -> dict:
    import jax
    import torch
    from flax import nnx

    from mrl_jax import models
    from mrl_jax.bench.load import section
    from mrl_jax.sampler import SamplingConfig, generate

    hf = _hf_model(family, s)
    ids, mask = _prompts(s, s["vocab"])
    b, n, g = s["batch"], s["new_tokens"], s.get("samples", 1)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        ours = models.from_pretrained(tmp)
    graphdef, params = nnx.split(ours)

    cfg = SamplingConfig(max_new_tokens=n, temperature=1.0, eos_id=None, pad_id=0)
    key = [jax.random.key(0)]
    jids, jmask = jax.numpy.asarray(ids), jax.numpy.asarray(mask)
    shared = g > 1 and _has_num_samples(generate)
    extra = {"num_samples": g} if shared else {}
    if g > 1 and not shared:  # an older mrl_jax (before/after figures): the prompts repeated G times
        jids, jmask = jax.numpy.repeat(jids, g, 0), jax.numpy.repeat(jmask, g, 0)

    def ours_fn():
        key[0], k = jax.random.split(key[0])  # a fresh key per call
        out = jax.block_until_ready(generate(graphdef, params, jids, jmask, k, cfg, **extra))
        assert out.tokens.shape == (b, n), out.tokens.shape
        return out

    slots_fn = _slots_fn(graphdef, params, ids, mask, key, cfg, g) if shared else None
    tids, tmask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def hf_fn():
        with torch.inference_mode():
            out = hf.generate(input_ids=tids, attention_mask=tmask, do_sample=True, max_new_tokens=n,
                              min_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                              num_return_sequences=g)
        assert out.shape == (b, ids.shape[1] + n), out.shape
        return out

    # Warm-up (our compile; torch's first-call allocations), then INTERLEAVED timed calls and the MIN
    # of each: the machine is shared, and interleaving + min keeps background load from favouring
    # either side. torch's OpenMP threads spin badly on oversubscribed cores, so torch runs with 1
    # thread and (once) with its default; the faster counts (conservative for our ratio).
    default_threads = torch.get_num_threads()
    compile_s = _once(ours_fn)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hf_fn()
    if slots_fn is not None:
        slots_compile_s = _once(slots_fn)
    ours_t, hf1_t, slots_t = [], [], []
    hf_by_threads = {}
    with section(f"{family}_b{b}") as load:
        for _ in range(s["repeats"]):
            ours_t.append(_once(ours_fn))
            if slots_fn is not None:
                slots_t.append(_once(slots_fn))
            hf1_t.append(_once(hf_fn))
        hf_by_threads[1] = min(hf1_t)
        if default_threads != 1:
            torch.set_num_threads(default_threads)
            hf_by_threads[default_threads] = _once(hf_fn)
            torch.set_num_threads(default_threads)
    ours_s, hf_s = min(ours_t), min(hf_by_threads.values())

    ours_tps = b * n / ours_s
    hf_tps = b * n / hf_s
    return {
        "family": family,
        "batch": b, "samples_per_prompt": g, "prefill_once": shared, "prompt_len": s["prompt_len"],
        "new_tokens": n,
        "model": {k: s[k] for k in ("hidden", "layers", "heads", "kv_heads", "vocab")},
        "params": int(sum(p.numel() for p in hf.parameters())),
        "ours_tokens_per_s": ours_tps,
        "hf_tokens_per_s": hf_tps,
        "speedup_vs_hf": ours_tps / hf_tps,
        "ours_seconds": ours_s,
        "hf_seconds": hf_s,
        "ours_seconds_all": ours_t,
        "hf_seconds_all_1_thread": hf1_t,
        "hf_seconds_by_torch_threads": hf_by_threads,
        "ours_first_call_seconds_incl_compile": compile_s,
        **({"slots_tokens_per_s": b * n / min(slots_t), "slots_vs_static": ours_s / min(slots_t),
            "slots_seconds_all": slots_t, "slots_first_call_seconds_incl_compile": slots_compile_s}
           if slots_t else {}),
        "load": load,
        "contended": load["contended"],
    }


def _slots_fn(graphdef, params, ids, mask, key, cfg, g: int):
    """The trainer's sampler on the same work: the slot sampler at S = every row (its default), a fresh key per
    call (GRPO's layout: an in-process A/B with the static ``generate``)."""
    import jax

    from mrl_jax.sampler import generate_slots

    def fn():
        key[0], k = jax.random.split(key[0])
        return generate_slots(graphdef, params, ids, mask, k, cfg, num_samples=g)[0]   # host arrays: done
    return fn


def _timed(fns: dict, repeats: int) -> dict:
    """Min wall seconds of each of ``fns`` over ``repeats`` interleaved calls (after one warm-up call each)."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(_once(fn))
    return {k: min(v) for k, v in times.items()}


def _longtail_setup(s: dict):
    """(hf model, ids, mask, graphdef, params, stop ids, SamplingConfig) of a long-tailed case."""
    from flax import nnx

    from mrl_jax import models
    from mrl_jax.sampler import SamplingConfig

    hf = _hf_model("llama", s)
    ids, mask = _prompts(s, s["vocab"])
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        graphdef, params = nnx.split(models.from_pretrained(tmp))
    stops = tuple(range(3, 3 + max(1, s["vocab"] * 8 // s["new_tokens"])))
    cfg = SamplingConfig(max_new_tokens=s["new_tokens"], temperature=1.0, eos_id=stops, pad_id=0)
    return hf, ids, mask, graphdef, params, stops, cfg


def longtail_counts(s: dict, graphdef, params, ids, mask, cfg) -> dict:
    """Load-independent figures over ``s["rounds"]`` keys (a run's rounds): row-steps per kept token of each
    sampler and the programs each call compiled (each sampler from empty jit caches, its rounds in order); raises
    when the slot sampler's tokens differ from the static ones."""
    import jax

    from mrl_jax.trainer.compile_stats import CompileCounter
    from mrl_jax.sampler import Ladder, generate, generate_slots, ladder_row_steps, min_row_steps

    g, b = s["samples"], s["batch"]
    jids, jmask = jax.numpy.asarray(ids), jax.numpy.asarray(mask)
    keys = [jax.random.fold_in(jax.random.key(0), r) for r in range(s["rounds"])]
    rows, statics = [], []
    jax.clear_caches()
    for key in keys:
        with CompileCounter() as cs:
            static = jax.device_get(generate(graphdef, params, jids, jmask, key, cfg, num_samples=g))
        statics.append(static)
        lengths = np.asarray(static.lengths)
        rows.append({"kept": int(lengths.sum()), "mean_length": float(lengths.mean()), "lengths": lengths.tolist(),
                     "max_length": int(lengths.max()), "static_row_steps": b * int(lengths.max()),
                     "static_compiles": cs.programs})
    variants = slot_variants(b)
    for name, (slots, shape) in variants.items():
        jax.clear_caches()
        for r, (key, static, row) in enumerate(zip(keys, statics, rows)):
            with CompileCounter() as cl:
                t0 = time.perf_counter()
                out, stats = generate_slots(graphdef, params, ids, mask, key, cfg, num_samples=g, slots=slots,
                                            ladder=shape)
                row[f"{name}_call_s"] = time.perf_counter() - t0
            if not (np.array_equal(out.tokens, static.tokens) and np.array_equal(out.mask, static.mask)):
                raise AssertionError(f"longtail round {r}: {name}'s tokens differ from the static sampler's")
            row.update({f"{name}_row_steps": stats["row_steps"], f"{name}_compiles": cl.programs,
                        f"{name}_bound": min_row_steps(out.lengths, stats["slots"]),
                        f"{name}_logprob_max_diff": float(np.abs(out.logprobs - static.logprobs).max())})
    kept, names = sum(x["kept"] for x in rows), ("static",) + tuple(variants)
    ladders = {"default": Ladder().rungs(b), **{k: Ladder(*v).rungs(b) for k, v in LADDERS.items()}}
    ladder_steps = {k: sum(ladder_row_steps(x["lengths"], v) for x in rows) / kept for k, v in ladders.items()}
    return {"rounds": rows, "tokens_identical": True, "slots": {k: v[0] for k, v in variants.items()},
            "ladder_shapes": {k: [v[1].ratio, v[1].floor] for k, v in variants.items()},
            "ladders": {k: {"rungs": len(v), "row_steps_per_kept_token": ladder_steps[k]} for k, v in ladders.items()},
            "row_steps_per_kept_token": {k: sum(x[f"{k}_row_steps"] for x in rows) / kept for k in names},
            "first_call_s": {k: rows[0][f"{k}_call_s"] for k in variants},
            "fixed_slots_bound_per_kept_token": {k: sum(x[f"{k}_bound"] for x in rows) / kept for k in variants},
            "compiles_per_round": {k: [x[f"{k}_compiles"] for x in rows] for k in names}}


def bench_longtail(s: dict, timed: bool = True) -> dict:
    """Static vs slot sampler vs transformers on long-tailed completion lengths (module docstring)."""
    import jax
    import torch

    from mrl_jax.bench.load import section
    from mrl_jax.sampler import generate, generate_slots

    hf, ids, mask, graphdef, params, stops, cfg = _longtail_setup(s)
    b, n, g, tp = s["batch"], s["new_tokens"], s["samples"], ids.shape[1]
    out = {"rows": b, "max_new_tokens": n, "stop_ids": len(stops),
           **longtail_counts(s, graphdef, params, ids, mask, cfg)}
    first, variants = out["rounds"][0], slot_variants(b)
    if not timed:
        return out
    jids, jmask, key = jax.numpy.asarray(ids), jax.numpy.asarray(mask), jax.random.fold_in(jax.random.key(0), 0)
    tids, tmask = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def hf_fn():
        with torch.inference_mode():
            return hf.generate(input_ids=tids, attention_mask=tmask, do_sample=True, max_new_tokens=n, top_k=0,
                               temperature=1.0, pad_token_id=0, eos_token_id=list(stops), num_return_sequences=g)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hf_gen = hf_fn()[:, tp:].numpy()   # the same distribution, its own random numbers
    ended = np.isin(hf_gen, stops)
    hf_len = np.where(ended.any(1), ended.argmax(1) + 1, hf_gen.shape[1])
    with section("longtail") as load:
        t = _timed({"static": lambda: jax.block_until_ready(generate(graphdef, params, jids, jmask, key, cfg,
                                                                      num_samples=g)),
                    **{name: functools.partial(generate_slots, graphdef, params, ids, mask, key, cfg, num_samples=g,
                                               slots=slots, ladder=shape)
                       for name, (slots, shape) in variants.items()},
                    "hf": hf_fn}, s["repeats"])
    out.update({
        "seconds": t, "kept_tokens_timed": {**{k: first["kept"] for k in ("static",) + tuple(out["slots"])},
                                            "hf": int(hf_len.sum())},
        "hf_row_steps_per_kept_token": b * hf_gen.shape[1] / hf_len.sum(),
        "slots_speedup_vs_static": {k: t["static"] / t[k] for k in out["slots"]},
        "slots_speedup_vs_hf": {k: t["hf"] / t[k] for k in out["slots"]},
        "load": load, "contended": load["contended"],
    })
    return out


def longtail_table(r: dict) -> str:
    """The figures of :func:`bench_longtail` as a markdown table."""
    rs = r["row_steps_per_kept_token"]
    lines = [f"long-tailed lengths: {r['rows']} rows, max {r['max_new_tokens']} new tokens, mean length "
             f"{np.mean([x['mean_length'] for x in r['rounds']]):.1f} over {len(r['rounds'])} keys; tokens identical "
             f"(static vs slots): {r['tokens_identical']}",
             "| sampler | row-steps per kept token | fewest any S slots can take | compiles per round | first call, "
             "with its compiles (s) | seconds | kept tokens / s |",
             "|---|---|---|---|---|---|---|"]
    sec, kept = r.get("seconds", {}), r.get("kept_tokens_timed", {})

    def shape(k):
        ratio, floor = r["ladder_shapes"][k]
        return "" if ratio is None else f", ladder ratio {ratio} to {floor}"
    labels = [("static", "static (generate)")] + [(k, f"slots (generate_slots), S = {v}{shape(k)}") for k, v in
                                                   r["slots"].items()] + [("hf", "transformers")]
    for name, label in labels:
        steps = rs.get(name, r.get("hf_row_steps_per_kept_token") if name == "hf" else None)
        comp = r["compiles_per_round"].get(name, "-")
        t = sec.get(name)
        bound = r.get("fixed_slots_bound_per_kept_token", {}).get(name)
        first = r["first_call_s"].get(name)
        lines.append(f"| {label} | {'-' if steps is None else f'{steps:.2f}'} | "
                     f"{'-' if bound is None else f'{bound:.2f}'} | {comp} | "
                     f"{'-' if first is None else f'{first:.1f}'} | "
                     f"{'-' if t is None else f'{t:.3f}'} | {'-' if t is None else f'{kept[name] / t:.0f}'} |")
    lines.append("row-steps per kept token at S = every row, moves at the first step the rows fit (exact, from the "
                 "lengths): " + ", ".join(f"{k} ({v['rungs']} rungs) {v['row_steps_per_kept_token']:.2f}"
                                          for k, v in r["ladders"].items()))
    if sec:
        lines.append("slots vs static / transformers: " + ", ".join(
            f"S {r['slots'][k]}{shape(k)}: {r['slots_speedup_vs_static'][k]:.2f}x / {r['slots_speedup_vs_hf'][k]:.2f}x"
            for k in r["slots"]) + f" (contended: {r['contended']})")
    return "\n".join(lines)


def run_longtail(quick: bool = False, timed: bool = True) -> dict:
    r = bench_longtail(LONGTAIL[bool(quick)], timed)
    print(longtail_table(r), file=sys.stderr)
    return {"benchmark": "rollout_longtail", "quick": quick, "timed": timed, "results": r}


def run(quick: bool = False) -> dict:
    import jax
    import torch

    result = {
        "benchmark": "rollout_tokens_per_s",
        "quick": quick,
        "backend": jax.default_backend(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "results": {},
    }
    for fam, case in PLAN[bool(quick)]:
        try:
            r = bench_family(fam, CASES[case])
            r["case"] = case
        except Exception as e:  # keep the other cases' numbers
            r = {"error": f"{type(e).__name__}: {e}"}
        result["results"][f"{fam}_{case}"] = r
    ratios = [r["speedup_vs_hf"] for r in result["results"].values() if "speedup_vs_hf" in r]
    result["min_speedup_vs_hf"] = min(ratios) if ratios else None
    result["note"] = ("tokens/s = batch * new_tokens / median wall time of a full generate call (prefill "
                      "included), min over interleaved repeats; same weights, same prompts, multinomial "
                      "T=1, no EOS stop; HF = faster of torch 1 thread / default threads")
    return result


def main(argv=None) -> int:
    import argparse

    from mrl_jax.bench import script_main

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed")
    ap.add_argument("--untimed", action="store_true", help="longtail: only the load-independent figures")
    known, rest = ap.parse_known_args(argv)
    if known.lengths == "longtail":
        return script_main(lambda quick: run_longtail(quick, not known.untimed), __doc__.splitlines()[0], rest)
    return script_main(run, __doc__.splitlines()[0], rest)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
