"""Continuous batching at fixed shapes: :func:`generate_slots`, the static sampler's tokens decoded in S slots that
rows enter as slots free.

    out, stats = generate_slots(graphdef, params, ids, mask, key, cfg, num_samples=G, slots=S)   # Rollout [P*G, N]
    stats["row_steps"] / out.lengths.sum()   # decode row-steps computed per token kept

How it works -- a round is ONE program (:func:`_round`, compiled once per sampler shape; nothing is read on the
host before the outputs, so no later round compiles, whatever its lengths):

* ``_start``: the P prompts are prefilled ONCE (the prompt store: each prompt's keys/values, heads-major), every
  row's token 0 is sampled from its prompt's last logits, and the rows that still need decoding (token 0 not a stop
  id, N > 1) queue up in row order; the first S of them enter the slots.
* ``_decode``: decode steps over all S slots in a ``lax.while_loop``. Each slot has its own row id, step index and
  position; a slot whose row ends (stop id or step N - 1) is refilled from the queue at the next step (at most
  ``admit`` rows per step; only with fewer slots than rows: otherwise nothing can queue).
* the ladder (:func:`ladder`, the ``heads`` cache layout): the first rung's loop stops at the step the queue is
  empty and the rows left fit the next rung (128 slots: 96, 64, 48, 32, 16, 8); ``_compact`` moves them (and their
  cache entries) into that many slots and the next rung's loop goes on: a long tail of lengths decodes in few
  slots, as the live sampler's compaction did, at fixed shapes. A round whose rows end before a rung runs no step
  there. The ``pages`` layout (TPU) keeps S: there a free slot reads one page (:func:`paged_layout`).
* the cache (:class:`mrl_jax.models.SlotCache`) holds each slot's prompt (Tc entries, left-aligned as in the
  prompt store: copied in when a row is admitted) and its N - 1 generated entries; each decode step writes its
  token's key / value at its generated entry and attends over its prompt and generated entries up to its position
  -- a length per slot, which JAX's Pallas TPU paged attention kernel reads from the ``pages`` layout (positions
  in order; on TPU the decode step runs it: see :mod:`mrl_jax.models.slot_cache`). A row's logits are those of
  the static sampler.
* shared prompts (:func:`shares_prompts`: a slot per row, S = P * G -- the default and every GRPO round --, the
  ``heads`` layout, G > 1): slot r decodes row r and holds only its generated entries; a step reads each prompt's
  entries once for its G slots from the prompt store, in one softmax with the slots' own entries (the static
  sampler's block-merged softmax), and the move to the ladder's second rung puts each kept row's prompt (from
  the store) in front of its first part, the layout of the rungs below.
* randomness: row r at its step i uses ``row_uniforms(key, P * G, N)[r, i]`` whatever slot it runs in, so the same
  key gives the same tokens and log-probs as :func:`mrl_jax.sampler.oracle.generate` for every S.

Memory: per slot 2 * L * K * D * C * dtype bytes, C = Tc + N - 1 (a row's prompt copied in), or N - 1 entries
with shared prompts; plus the prompt store P * Tc * the same per-token figure, plus the outputs [P * G, N]; a move
down the ladder holds both rungs' caches for its one program (1.75 x the cache at the first, 3/4, step; the weights
stay resident; the ``pages`` layout makes none). Llama-3.1-8B (128 KiB per token, bf16), 64 prompts x G 8, 1024 +
4096 tokens: C = 5119, 640 MiB per slot; S = 64: 40 GiB, plus an 8 GiB prompt store; S = 512 (every row, shared
prompts on the ``heads`` layout) 512 x 4095 x 128 KiB = 256 GiB plus the store, the static sampler's 264 GiB (copied,
as on TPU's ``pages``: 320 GiB). Fewer slots than rows, and the ``pages`` layout, copy each row's prompt in: sharing
there needs a gathered read per step on the pure-JAX path, or shared pages whose last, partial page each slot copies.

With ``mesh`` the slots (S rounded up to a multiple of the mesh's size) are split over its devices (the prompt
store and outputs placed by XLA); every host <-> device transfer is explicit (``jax.transfer_guard("disallow")``).
Several processes (``jax.distributed``): the round's program is launched in lockstep by every process of the mesh
(`mrl_jax.mwra.lockstep`); nothing is read on the host before the end, so no process decides anything alone. The
outputs stay the mesh's arrays and every process reads them with ``trainer.placement.fetch``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mrl_jax.models.slot_cache import SlotCache, take_blocks
from mrl_jax.sampler.batch import Rollout
from mrl_jax.sampler.ladder import paged_layout
from mrl_jax.sampler.sampling import SamplingConfig, row_uniforms, sample_rows

__all__ = ["admit_count", "shares_prompts", "trace_count"]

_TRACES = 0


def admit_count(slots: int, admit: int | None = None) -> int:
    """Rows admitted per decode step at most: ``admit``, default max(8, S / 8), never above S."""
    return min(int(slots), int(admit) if admit is not None else max(8, int(slots) // 8))


def trace_count() -> int:
    """How many times the slot sampler's round program (:func:`_round`) has been traced in this process."""
    return _TRACES


@struct.dataclass
class _Prompts:
    """The round's constants: prompt keys pk (L x [P, K, D, Tc]) / values pv (L x [P, K, Tc, D]), each prompt
    left-aligned (entry e: position e; entries from its length on unused), plen int32[P], tok0 int32[B],
    u f32[B, N, 2] (None greedy), order int32[B] (rows to decode, queue order), count int32 (how many)."""

    pk: tuple
    pv: tuple
    plen: jax.Array
    tok0: jax.Array
    u: jax.Array | None
    order: jax.Array
    count: jax.Array


@struct.dataclass
class _State:
    """Slots: row int32[S] (-1 free), step int32[S] (the token index it samples next; shared prompts: not kept, every
    slot at t + 1), tok int32[S] (the token it feeds); t: decode steps run; work: row-steps run (S per decode step);
    ptr: queue rows taken; outputs tokens [B, N], logps [B, N, 2], mask [B, N], ended bool[B] (stop id seen)."""

    cache: SlotCache
    row: jax.Array
    step: jax.Array
    tok: jax.Array
    t: jax.Array
    work: jax.Array
    ptr: jax.Array
    tokens: jax.Array
    logps: jax.Array
    mask: jax.Array
    ended: jax.Array


def _constrain(state: _State, rows) -> _State:
    """The slot-dim leaves of ``state`` split over ``rows`` (a sharding; None: unchanged)."""
    if rows is None:
        return state
    c = jax.lax.with_sharding_constraint
    return state.replace(cache=state.cache.constrain(rows), row=c(state.row, rows),
                         step=c(state.step, rows), tok=c(state.tok, rows))


def _split(rows) -> int:
    """The devices ``rows`` (a slot sharding; None: one) splits the slots over."""
    if rows is None:
        return 1
    axes = rows.spec[0] if isinstance(rows.spec[0], tuple) else (rows.spec[0],)
    return int(np.prod([rows.mesh.shape[a] for a in axes]))


def _prompt_split(rows, p: int):
    """Constrain a [P, ...] leaf (prefill input, prompt store) split over ``rows``' data axes when they divide P
    (the round pads P to the mesh size): each device prefills and stores P / d prompts, not all P; the admits
    gather the rows they need. Identity without ``rows`` or where P does not divide."""
    if rows is None or p % _split(rows):
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, rows)


def _busy(p: _Prompts, st: _State):
    return jnp.any(st.row >= 0) | (st.ptr < p.count)


def _fits(p: _Prompts, st: _State, d: int, below: int | None):
    """Whether the rows could move down the ladder now: the queue empty and at most ``below`` (the next rung's slots
    per device block; None: no rung below) rows in each of the d blocks -- the host's test of the same status."""
    if below is None:
        return jnp.zeros((), bool)
    return (st.ptr >= p.count) & (jnp.max(jnp.sum(st.row.reshape(d, -1) >= 0, 1)) <= below)


def _positions(p: _Prompts, st: _State, g: int) -> _State:
    """``st`` with each slot's position for its next step (the cache's qpos): its row's prompt length + its step - 1;
    a free slot 0 (it feeds row 0's token at position 0: it writes at most an entry that a row entering rewrites,
    and attends over one entry, so a length-aware kernel (TPU) reads one page of it, not a finished row's length).
    Set once per step for the next and carried, so the decode step's masks read it (computed inside the step,
    XLA:CPU fused its arithmetic into every layer's softmax). Shared prompts: every slot at step t + 1, so its
    prompt length + t, live or not (a free slot's row has ended: what it computes is never written back)."""
    if st.cache.group:
        return st.replace(cache=st.cache.replace(qpos=st.cache.plen + st.t))
    qpos = jnp.where(st.row >= 0, p.plen[jnp.maximum(st.row, 0) // g] + st.step - 1, 0)   # a live slot's step < N
    return st.replace(cache=st.cache.replace(qpos=qpos))


def _admit(p: _Prompts, st: _State, a: int, g: int) -> _State:
    """Up to ``a`` queued rows into free slots: each one's prompt copied into its slot (`SlotCache.load`), its token 0
    to feed, step 1."""
    s, b = st.row.shape[0], p.order.shape[0]
    free = jnp.nonzero(st.row < 0, size=a, fill_value=s)[0]
    j = jnp.arange(a, dtype=jnp.int32)
    ok = (free < s) & (st.ptr + j < p.count)
    row = p.order[jnp.minimum(st.ptr + j, b - 1)]
    idx = jnp.where(ok, free, s)   # s: dropped
    pr = row // g
    cache = st.cache.load(idx, tuple(k[pr] for k in p.pk), tuple(v[pr] for v in p.pv), p.plen[pr])
    return _positions(p, st.replace(cache=cache, row=st.row.at[idx].set(row, mode="drop"),
                                    step=st.step.at[idx].set(1, mode="drop"),
                                    tok=st.tok.at[idx].set(p.tok0[row], mode="drop"),
                                    ptr=st.ptr + jnp.sum(ok, dtype=jnp.int32)), g)


def _step(model, p: _Prompts, st: _State, config: SamplingConfig, g: int) -> _State:
    """One decode step of every slot: feed its token at its position, sample its next token with its row's
    uniforms at its step, write it to the row's outputs; a row that ends frees its slot."""
    n, b = config.max_new_tokens, p.tok0.shape[0]
    live, shared = st.row >= 0, st.cache.group
    # shared prompts: slot r decodes row r, every slot at step t + 1 (`SlotCache.group`): the outputs' one column
    i = jnp.minimum(st.t + 1 if shared else st.step, n - 1)
    cache = st.cache   # its qpos: each slot's position this step (`_positions`)
    if shared:   # the prompt store, read by the step, not carried in the state
        cache = cache.replace(pk=p.pk, pv=p.pv)
    logits, cache = model.decode_step(st.tok[:, None], cache.qpos[:, None], cache, 0)
    if shared:
        cache = cache.replace(pk=(), pv=())
        u = None if p.u is None else jax.lax.dynamic_index_in_dim(p.u, i, 1, keepdims=False).T[..., None]
    else:
        u = None if p.u is None else p.u[jnp.maximum(st.row, 0), i].T[..., None]
    tok, lp, slp = sample_rows(logits[:, -1], u, config)
    hit = (jnp.any(tok[:, None] == jnp.asarray(config.eos_ids, jnp.int32)[None], -1) if config.eos_ids
           else jnp.zeros_like(live))
    out = jnp.where(live, st.row, b)   # the rows written (b: dropped)
    st = st.replace(cache=cache, row=jnp.where(live & (hit | (i >= n - 1)), -1, st.row),
                    step=st.step if shared else st.step + 1, tok=tok,
                    t=st.t + 1, work=st.work + st.row.shape[0])
    if shared:
        def put(x, new, fill):   # column i in place: the live rows' entries; the others' stay as the round began
            return jax.lax.dynamic_update_index_in_dim(
                x, jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, fill).astype(x.dtype), i, 1)
        st = st.replace(tokens=put(st.tokens, tok, config.pad_id), logps=put(st.logps, jnp.stack([lp, slp], -1), 0.0),
                        mask=put(st.mask, live, False), ended=jnp.where(live, hit, st.ended))
    else:
        st = st.replace(tokens=st.tokens.at[out, i].set(tok, mode="drop"),
                        logps=st.logps.at[out, i].set(jnp.stack([lp, slp], -1), mode="drop"),
                        mask=st.mask.at[out, i].set(True, mode="drop"), ended=st.ended.at[out].set(hit, mode="drop"))
    return _positions(p, st, g)


def _prefill(model, prompt_ids, prompt_mask, width: int):
    """The prompt store's keys / values (L x [P, K, D, Tc], L x [P, K, Tc, D]), each prompt left-aligned (its
    left padding dropped: entry e holds position e), plen int32[P] and the last position's hidden state [P, D];
    Tc = ``width`` >= Tp (entries from a prompt's length on: unused)."""
    p, tp = prompt_ids.shape
    pmask = prompt_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(pmask.astype(jnp.int32), axis=-1) - 1, 0)
    kv = model.init_cache(p, tp)
    h, kv = model.decode_hidden(prompt_ids.astype(jnp.int32), positions, kv, 0, pmask)
    plen = jnp.sum(pmask, -1, dtype=jnp.int32)
    src = jnp.minimum(jnp.arange(width, dtype=jnp.int32)[None, :] + (tp - plen)[:, None], tp - 1)   # [P, Tc]

    def align(x):   # [P, Tp, K, D] -> [P, Tc, K, D]
        return jnp.take_along_axis(x, src[:, :, None, None], axis=1)

    pk = tuple(align(k).transpose(0, 2, 3, 1) for k in kv.k)
    pv = tuple(align(v).transpose(0, 2, 1, 3) for v in kv.v)
    return pk, pv, plen, h[:, -1]


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples", "slots", "width", "rows"))
def _start(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int, slots: int,
           width: int, rows=None):
    """Prefill, token 0 of every row, the queue, the first S rows admitted. Returns (_Prompts, _State)."""
    model = nnx.merge(graphdef, params)
    p, tp = prompt_ids.shape
    g, n = num_samples, config.max_new_tokens
    b = p * g
    mcfg = getattr(model, "config", None)
    if getattr(mcfg, "family", None) == "gpt2" and tp + n > mcfg.max_position_embeddings:
        raise ValueError(f"generate_slots: prompt length {tp} + max_new_tokens {n} exceeds GPT-2's "
                         f"{mcfg.max_position_embeddings} learned positions")
    split = _prompt_split(rows, p)
    prompt_ids, prompt_mask = split(prompt_ids), split(prompt_mask)
    pk, pv, plen, h = jax.tree.map(split, _prefill(model, prompt_ids, prompt_mask, width))
    logits = jnp.repeat(model.head(h).astype(jnp.float32), g, axis=0)   # [B, V]
    u = None if config.is_greedy else row_uniforms(key, b, n)
    tok0, lp, slp = sample_rows(logits, None if u is None else u[:, 0].T[..., None], config)
    eos = jnp.asarray(config.eos_ids, jnp.int32)
    ended = jnp.any(tok0[:, None] == eos[None], -1) if config.eos_ids else jnp.zeros((b,), bool)
    needs = ~ended & (n > 1)
    order = jnp.nonzero(needs, size=b, fill_value=0)[0].astype(jnp.int32)
    prompts = _Prompts(pk=pk, pv=pv, plen=plen, tok0=tok0, u=u, order=order, count=jnp.sum(needs, dtype=jnp.int32))
    _, K, D, _ = pk[0].shape
    paged = paged_layout(graphdef, params)
    group = g if shares_prompts(paged, slots, p, g, _split(rows)) else 0
    cache = SlotCache.zeros(slots, len(pk), K, D, width, max(n - 1, 1), pk[0].dtype, paged=paged,
                            span=config.cache_bucket, group=group)
    zero = jnp.zeros((), jnp.int32)
    state = _State(cache=cache, row=jnp.full((slots,), -1, jnp.int32), step=jnp.zeros((slots,), jnp.int32),
                   tok=jnp.zeros((slots,), jnp.int32), t=zero, work=zero, ptr=zero,
                   tokens=jnp.full((b, n), config.pad_id, jnp.int32).at[:, 0].set(tok0),
                   logps=jnp.zeros((b, n, 2), jnp.float32).at[:, 0].set(jnp.stack([lp, slp], -1)),
                   mask=jnp.zeros((b, n), bool).at[:, 0].set(True), ended=ended)
    if group:   # slot r decodes row r
        seated = state.replace(cache=cache.replace(plen=jnp.repeat(plen, g, total_repeat_length=b)),
                               row=jnp.where(needs, jnp.arange(b, dtype=jnp.int32), -1),
                               step=jnp.ones((slots,), jnp.int32), tok=tok0, ptr=prompts.count)
        state = _positions(prompts, seated, g)
    else:
        state = _admit(prompts, state, slots, g)
    return prompts, _constrain(state, rows)


def shares_prompts(paged: bool, slots: int, prompts: int, g: int, devices: int = 1) -> bool:
    """Whether S ``slots`` share their prompts' cache entries (`SlotCache`'s ``group``): the ``heads`` layout, a
    slot per row (S = P * G, so slot r decodes row r), G > 1 (one row per prompt has nothing to share) and the
    prompts splitting evenly over the ``devices`` the slots do (each device's slots read its own prompts)."""
    return not paged and g > 1 and slots == prompts * g and prompts % devices == 0


def _advance(model, p: _Prompts, st: _State, config: SamplingConfig, g: int, admit: int, rows) -> _State:
    """One decode step of every slot, free slots refilled first (<= ``admit`` rows; 0: no queue to refill from, as
    with a slot per row and below the first rung)."""
    if admit:
        refill = jnp.any(st.row < 0) & (st.ptr < p.count)
        st = jax.lax.cond(refill, lambda s: _admit(p, s, admit, g), lambda s: s, st)
    return _constrain(_step(model, p, st, config, g), rows)


def _decode(model, p: _Prompts, st: _State, config: SamplingConfig, g: int, admit: int, rows,
            below: int | None) -> _State:
    """Decode steps (:func:`_advance`) while a row is left, stopping at the step the rows fit ``below`` slots per
    device block with the queue empty (`_fits`: not one step more at this rung before they move)."""
    d = _split(rows)
    return jax.lax.while_loop(lambda s: _busy(p, s) & ~_fits(p, s, d, below),
                              lambda s: _advance(model, p, s, config, g, admit, rows), st)


def _compact(prompts: _Prompts, state: _State, *, slots: int, rows=None) -> _State:
    """The rows in ``state``'s slots moved into ``slots`` slots with their cache entries (shared prompts: each
    one's prompt block from ``prompts``' store), within each device's block of slots (at most ``slots`` / d rows in
    each of the d blocks, the queue empty: nothing crosses devices); the outputs unchanged."""
    d, s = _split(rows), state.row.shape[0]
    local = jax.vmap(lambda r: jnp.nonzero(r >= 0, size=slots // d, fill_value=s // d)[0])(state.row.reshape(d, -1))

    def take(x, fill=0):
        return take_blocks(x, local, 0, fill)
    cache = state.cache
    if cache.group:
        cache = cache.replace(pk=prompts.pk, pv=prompts.pv)
    step = jnp.full((slots,), state.t + 1, jnp.int32) if cache.group else take(state.step)   # shared: all at t + 1
    return _constrain(state.replace(cache=cache.take(local), row=take(state.row, -1), step=step,
                                    tok=take(state.tok)), rows)


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples", "rungs", "width", "admit", "rows"))
def _round(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int, rungs: tuple,
           width: int, admit: int = 0, rows=None):
    """The round, one program: the prefill (`_start`, the first ``rungs[0]`` rows admitted), decode steps at each
    rung of the ladder ``rungs`` until the rows fit the next (`_decode`; ``admit`` rows refilled per step at the
    first rung, 0 where no row can queue), the move there (`_compact`), and the outputs. Nothing is decided on the
    host, so nothing is read before the end. Returns (Rollout [P * G, N], counts int32[3]: decode steps, row-steps
    (step 0 of every row + the slots of each decode step run), the deepest rung reached)."""
    global _TRACES
    _TRACES += 1
    g, d = num_samples, _split(rows)
    prompts, state = _start(graphdef, params, prompt_ids, prompt_mask, key, config, num_samples=g, slots=rungs[0],
                            width=width, rows=rows)
    model = nnx.merge(graphdef, params)
    reached = jnp.zeros((), jnp.int32)
    for r in range(len(rungs)):
        below = rungs[r + 1] if r + 1 < len(rungs) else None
        state = _decode(model, prompts, state, config, g, admit if r == 0 else 0, rows,
                        None if below is None else below // d)
        if below is not None:   # the rows left move down (none left: an empty move, and no step below)
            reached = jnp.where(_busy(prompts, state), r + 1, reached)
            state = _compact(prompts, state, slots=below, rows=rows)
    return Rollout(tokens=state.tokens, logprobs=state.logps[..., 0], sampling_logprobs=state.logps[..., 1],
                   mask=state.mask, lengths=state.mask.sum(-1, dtype=jnp.int32),
                   truncated=~state.ended), jnp.stack([state.t, state.tokens.shape[0] + state.work, reached])
