"""A sampler whose work follows the live rows: :func:`generate_live`, the static sampler's tokens with the
batch compacted to its unfinished rows every few steps.

    out, stats = generate_live(graphdef, params, ids, mask, key, cfg, num_samples=G)   # Rollout as generate's
    stats["row_steps"] / out.lengths.sum()   # decode row-steps computed per token kept

:func:`mrl_jax.rollout.generate` decodes every row until the longest one ends: with long-tailed completion
lengths (reasoning RL) most of its row-steps are spent on finished rows. Here the P prompts are prefilled once,
their caches copied to their G rows (the joint layout of :class:`mrl_jax.models.SampleCache`), and decoding
runs in segments of ``segment`` steps (never across a cache length bucket, :func:`mrl_jax.rollout.gen_buckets`).
After a segment the host reads which rows are done and gathers the live rows' caches, last tokens and
uniforms into a batch of the next row bucket (:func:`row_bucket`: <= 25 % padding, a few sizes per
doubling so a run compiles a handful of segment programs). Every live row is at the same step, so a segment is
the static sampler's decode loop on fewer rows.

Same key => same tokens as :func:`mrl_jax.rollout.generate`: a row's uniforms at step i are
``row_uniforms(key, B, N)[row, i]`` wherever the row sits, and its logits do not depend on the other rows.

The training round runs one :func:`live_rollout` per policy (a generator that yields after dispatching each
program) and :func:`drive` steps them in turn, so one policy's segment runs while the host reads another's.
With ``mesh`` the rows are split over the mesh's devices (every batch size a multiple of its size) and every
host <-> device transfer is explicit, so it runs under ``jax.transfer_guard("disallow")``. Programs compiled:
one prefill per prompt shape, one segment program per (row size, cache bucket) met and one row gather per
(rows before, rows after, cache bucket): ``per_doubling=1`` (power-of-two row sizes) bounds them more tightly
at the price of more padding rows (``benchmarks/RESULTS.md`` §3g).
"""
from __future__ import annotations

import functools
import inspect
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mrl_jax.rollout import Rollout, SamplingConfig, _record, gen_buckets, row_uniforms
from mrl_jax.sampling import sample_rows

__all__ = ["generate_live", "live_rollout", "drive", "row_bucket"]


def row_bucket(n: int, total: int, multiple: int = 1, per_doubling: int = 4) -> int:
    """Rows a batch of ``n`` live rows is padded to: ``n`` rounded up to a multiple of 1 / ``per_doubling`` of its
    largest power of two (``per_doubling`` 4: <= 25 % padding, 4 sizes per doubling; 1: powers of two, fewer
    programs to compile), then to a multiple of ``multiple`` (the devices the rows are split over), never above
    ``total``."""
    if n > per_doubling:
        step = (1 << (n.bit_length() - 1)) // per_doubling
        n = -(-n // step) * step
    return min(-(-n // multiple) * multiple, total)


def _constrain(tree, rows):
    """``tree``'s leaves (rows first) split over ``rows`` (a sharding; None: unchanged)."""
    if rows is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows), tree)


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples", "rows"))
def _start(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int, rows=None):
    """Prefill once, copy each prompt's cache to its G rows (joint layout), sample token 0. Returns (cache,
    tok int32[B], logprobs f32[B, 2], prompt_len int32[B], uniforms f32[B, N, 2] or None), rows split over
    ``rows``."""
    model = nnx.merge(graphdef, params)
    p, tp = prompt_ids.shape
    g, n = num_samples, config.max_new_tokens
    mcfg = getattr(model, "config", None)
    if getattr(mcfg, "family", None) == "gpt2" and tp + n > mcfg.max_position_embeddings:
        raise ValueError(f"generate_live: prompt length {tp} + max_new_tokens {n} exceeds GPT-2's "
                         f"{mcfg.max_position_embeddings} learned positions")
    pmask = prompt_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(pmask.astype(jnp.int32), axis=-1) - 1, 0)
    buckets = gen_buckets(n, config.cache_bucket)
    h, cache = model.prefill_shared(prompt_ids.astype(jnp.int32), positions, pmask, num_rows=p,
                                    gen_len=buckets[0] if buckets else 1)
    cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0), cache)
    logits = jnp.repeat(model.head(h).astype(jnp.float32), g, axis=0)
    u = None if config.is_greedy else row_uniforms(key, p * g, n)
    tok, lp, slp = sample_rows(logits, None if u is None else u[:, 0].T[..., None], config)
    prompt_len = jnp.repeat(jnp.sum(pmask, -1, dtype=jnp.int32), g)
    return _constrain((cache, tok, jnp.stack([lp, slp], -1), prompt_len, u), rows)


@functools.partial(jax.jit, static_argnums=(0, 7, 8, 9), static_argnames=("rows",))
def _segment(graphdef, params, cache, tok, done, prompt_len, u, config: SamplingConfig, width: int, gen_len: int,
             start, stop, *, rows=None):
    """Decode steps [start, stop) (stop - start <= width) of S rows on a joint cache grown to ``gen_len``;
    stops early when every row is done. Returns (cache, tok, done, tokens int32[S, width], logps f32[S, 2, width],
    mask bool[S, width]) with step i in column i - start, rows split over ``rows``."""
    model = nnx.merge(graphdef, params)
    s = tok.shape[0]
    pad = jnp.int32(config.pad_id)
    eos = jnp.asarray(config.eos_ids, jnp.int32) if config.eos_ids else None
    cache = cache.grow(gen_len)

    def body(state):
        i, cache, tok, done, tokens, logps, out_mask = state
        logits, cache = model.decode_step(tok[:, None], (prompt_len + i - 1)[:, None], cache, i - 1)
        ui = None if u is None else jax.lax.dynamic_index_in_dim(u, i, axis=1, keepdims=False).T[..., None]
        tok, lp, slp = sample_rows(logits[:, -1], ui, config)
        rec = _record(i - start, tok, jnp.stack([lp, slp]), done, tokens, logps, out_mask, pad, eos)
        return (i + 1, cache) + rec

    def cond(state):
        return (state[0] < stop) & ~jnp.all(state[3])

    init = (start, cache, tok, done, jnp.full((s, width), pad, jnp.int32),
            jnp.zeros((2, s, width), jnp.float32), jnp.zeros((s, width), bool))
    _, cache, tok, done, tokens, logps, out_mask = jax.lax.while_loop(cond, body, init)
    return _constrain((cache, tok, done, tokens, logps.transpose(1, 0, 2), out_mask), rows)


@functools.partial(jax.jit, static_argnames=("rows",))
def _take_rows(tree, idx, pad_done, *, rows=None):
    """(cache, tok, done, prompt_len, u)'s rows ``idx``; ``done`` replaced by ``pad_done`` (padding rows)."""
    cache, tok, _, prompt_len, u = jax.tree.map(lambda x: x[idx], tree)
    return _constrain((cache, tok, pad_done, prompt_len, u), rows)


def _segments(n: int, config: SamplingConfig, width: int):
    """[(start, stop, gen_len)]: decode steps 1..n-1 in pieces of <= width steps inside one length bucket."""
    out, start = [], 1
    for size in gen_buckets(n, config.cache_bucket):
        end = min(size + 1, n)
        while start < end:
            out.append((start, min(start + width, end), size))
            start = out[-1][1]
    return out


def _placement(mesh, b: int):
    """(rows sharding or None, a function placing a host value replicated / on the default device, devices)."""
    if mesh is None:
        return None, jax.device_put, 1
    from jax.sharding import NamedSharding, PartitionSpec

    from mrl_jax.mwra import batch_sharding

    d = int(mesh.devices.size)
    if b % d:
        raise ValueError(f"generate_live: {b} rows do not split over the mesh's {d} devices; pad the prompts to a "
                         f"multiple of {d} (mrl_jax.trainer.placement.pad_prompts)")
    repl = NamedSharding(mesh, PartitionSpec())
    return batch_sharding(mesh), lambda x: jax.device_put(x, repl), d


def live_rollout(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int = 1,
                 segment: int = 8, mesh=None, per_doubling: int = 4):
    """:func:`generate_live` as a generator, its prefill already dispatched: it yields after dispatching each
    device program (before reading its result), so :func:`drive` can interleave several policies' samplers; its
    return value is (Rollout, stats). ``mesh``: rows split over its devices (P * G a multiple of its size), every
    transfer explicit (it runs under ``jax.transfer_guard("disallow")``). ``per_doubling``: row sizes per doubling
    (:func:`row_bucket`)."""
    if int(segment) < 1:
        raise ValueError(f"generate_live: segment must be >= 1, got {segment}")
    if per_doubling not in (1, 2, 4, 8):
        raise ValueError(f"generate_live: per_doubling must be 1, 2, 4 or 8, got {per_doubling}")
    b = int(np.shape(prompt_ids)[0]) * int(num_samples)
    gen = _live(graphdef, params, prompt_ids, prompt_mask, key, config, int(num_samples), int(segment),
                int(per_doubling), *_placement(mesh, b))
    next(gen)
    return gen


def _live(graphdef, params, prompt_ids, prompt_mask, key, config, g, segment, per_doubling, rows_s, put, d):
    """The body of :func:`live_rollout` (rows_s, put, d: :func:`_placement`)."""
    n = config.max_new_tokens
    b = int(np.shape(prompt_ids)[0]) * g
    put_rows = put if rows_s is None else (lambda x: jax.device_put(x, rows_s))
    state = _start(graphdef, params, put_rows(prompt_ids), put_rows(prompt_mask), put(key), config,
                   num_samples=g, rows=rows_s)
    yield
    tok0, lp0 = jax.device_get(state[1:3])
    eos = np.asarray(config.eos_ids, np.int64)
    tokens = np.full((b, n), config.pad_id, np.int32)
    logps, mask = np.zeros((b, 2, n), np.float32), np.zeros((b, n), bool)
    tokens[:, 0], logps[:, :, 0], mask[:, 0] = tok0, lp0, True
    done = np.isin(tokens[:, 0], eos)
    state = (state[0], state[1], put_rows(done), state[3], state[4])
    slots = np.arange(b)                         # global row of each slot; -1: a padding slot
    stats = {"row_steps": b, "segments": 0, "batch_sizes": []}   # step 0 (from the prefill) on every row
    for start, stop, gen_len in _segments(n, config, segment):
        live = np.flatnonzero((slots >= 0) & ~done[np.maximum(slots, 0)])   # slots of unfinished rows
        if live.size == 0:
            break
        size = row_bucket(live.size, b, d, per_doubling)
        if size < slots.size:   # compact: the live slots first, padded with copies of one (marked done)
            idx = np.concatenate([live, np.full(size - live.size, live[0])]).astype(np.int32)
            state = _take_rows(state, put(idx), put_rows(np.arange(size) >= live.size), rows=rows_s)
            slots = np.concatenate([slots[live], np.full(size - live.size, -1)])
        cache, tok, dn, seg_tok, seg_lp, seg_mask = _segment(
            graphdef, params, *state, config, segment, gen_len, put(np.int32(start)), put(np.int32(stop)),
            rows=rows_s)
        state = (cache, tok, dn, state[3], state[4])
        yield
        seg_tok, seg_lp, seg_mask, dn = jax.device_get((seg_tok, seg_lp, seg_mask, dn))
        real, w = slots >= 0, stop - start
        tokens[slots[real], start:stop] = seg_tok[real, :w]
        logps[slots[real], :, start:stop] = seg_lp[real, :, :w]
        mask[slots[real], start:stop] = seg_mask[real, :w]
        done[slots[real]] = dn[real]
        stats["row_steps"] += slots.size * int(np.max(seg_mask.sum(-1)))
        stats["segments"] += 1
        stats["batch_sizes"].append(int(slots.size))
    out = Rollout(tokens=tokens, logprobs=logps[:, 0], sampling_logprobs=logps[:, 1], mask=mask,
                  lengths=mask.sum(-1, dtype=np.int32), truncated=~done)
    return out, stats


def drive(items: Sequence, stats: list | None = None) -> list:
    """Run the :func:`live_rollout` generators among ``items`` to the end, one step of each in turn (each one's
    device work overlaps the others' host reads); returns their Rollouts, other items unchanged. ``stats``: a
    list that gets each item's stats dict (None for the other items)."""
    out, pending = list(items), [i for i, x in enumerate(items) if inspect.isgenerator(x)]
    info = [None] * len(out)
    while pending:
        for i in list(pending):
            try:
                next(out[i])
            except StopIteration as stop:
                out[i], info[i] = stop.value
                pending.remove(i)
    if stats is not None:
        stats.extend(info)
    return out


def generate_live(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *,
                  num_samples: int = 1, segment: int = 8, mesh=None, per_doubling: int = 4) -> tuple[Rollout, dict]:
    """:func:`mrl_jax.rollout.generate`'s rows (same key => same tokens), computed on the live rows only.

    Args as ``generate``; ``segment``: decode steps between two compactions (each one host read of the rows'
    done flags); ``mesh``, ``per_doubling``: see :func:`live_rollout`. Returns (:class:`Rollout` of host numpy
    arrays [P * G, N], stats): ``row_steps`` (row-steps computed, step 0 and padding rows included; the static sampler's is
    B * max(lengths)), ``segments`` and ``batch_sizes`` (rows of each segment).
    """
    stats: list = []
    out = drive([live_rollout(graphdef, params, prompt_ids, prompt_mask, key, config, num_samples=num_samples,
                              segment=segment, mesh=mesh, per_doubling=per_doubling)], stats)
    return out[0], stats[0]
