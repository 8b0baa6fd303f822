"""The slot sampler's state and steps: the static sampler's rows decoded in S slots that rows enter as slots free,
a round as ONE program (:func:`_round`; launched and read by :mod:`mrl_jax.sampler.rounds`).

Names, each for that quantity alone: P prompts; G samples per prompt (``num_samples``); B = P * G rows
(``num_rows``; row r = p * G + g, its prompt ``r // G``); N the completion length (``SamplingConfig.max_new_tokens``:
tokens per row, token 0 from the prefill); S slots (``slots``); Tp the prompt ids' width; ``width`` (W) the slots'
prompt width, W >= Tp (the prompt store's and a slot's prompt columns); ``devices`` (d) the devices the slots split
over (``rows``: the slots' sharding, None on one device).

How it works -- nothing is read on the host before the outputs, so no later round compiles, whatever its lengths:

* :func:`_start`: the P prompts are prefilled ONCE (the prompt store :class:`_Prompts`: keys L x [P, K, D, W],
  values L x [P, K, W, D], heads-major, left-aligned), every row's token 0 is sampled from its prompt's last logits,
  and the rows that still need decoding (token 0 not a stop id, N > 1) queue up in row order; the first S of them
  enter the slots (:class:`_State`).
* :func:`_decode`: decode steps over all S slots in a ``lax.while_loop``. Each slot has its own row, step index and
  position; a slot whose row ends (stop id or step N - 1) is refilled from the queue at the next step (at most
  ``admit`` rows per step; only with fewer slots than rows: otherwise nothing can queue).
* the ladder (:mod:`mrl_jax.sampler.ladder`, the ``heads`` cache layout): the first rung's loop stops at the step
  the queue is empty and the rows left fit the next rung (128 slots: 96, 64, 48, 32, 16, 8); :func:`_compact`
  moves them (and their cache entries) into that many slots and the next rung's loop goes on: a long tail of
  lengths decodes in few slots, at fixed shapes. A round whose rows end before a rung runs no step there. The
  ``pages`` layout (TPU) keeps S: there a free slot reads one page (:func:`~mrl_jax.sampler.ladder.paged_layout`).
* the cache (:class:`mrl_jax.models.SlotCache`) holds each slot's prompt (W entries, left-aligned as in the prompt
  store: copied in when a row is admitted) and its N - 1 generated entries; each decode step writes its token's
  key / value at its generated entry and attends over its prompt and generated entries up to its position -- a
  length per slot, which JAX's Pallas TPU paged attention kernel reads from the ``pages`` layout (see
  :mod:`mrl_jax.models.slot_cache`). A row's logits are those of the static sampler.
* shared prompts (:func:`shares_prompts`: a slot per row, S = B -- the default and every GRPO round --, the
  ``heads`` layout, G > 1): slot r decodes row r and holds only its generated entries; a step reads each prompt's
  entries once for its G slots from the prompt store, in one softmax with the slots' own entries (the static
  sampler's block-merged softmax), and the move to the ladder's second rung puts each kept row's prompt (from
  the store) in front of its first part, the layout of the rungs below.
* randomness: row r at its step i uses ``row_uniforms(key, B, N)[r, i]`` whatever slot it runs in, so the same
  key gives the same tokens and log-probs as :func:`mrl_jax.sampler.oracle.generate` for every S.

Memory: per slot 2 * L * K * D * C * dtype bytes, C = W + N - 1 (a row's prompt copied in), or N - 1 entries with
shared prompts; plus the prompt store P * W * the same per-token figure, plus the outputs [B, N]; a move down the
ladder holds both rungs' caches for its one program (1.75 x the cache at the first, 3/4, step; the ``pages``
layout makes none). Llama-3.1-8B (128 KiB per token, bf16), 64 prompts x G 8, W 1024, N 4096: C = 5119, 640 MiB
per slot; S = 64: 40 GiB, plus an 8 GiB prompt store; S = 512 (every row, shared prompts on the ``heads`` layout)
512 x 4095 x 128 KiB = 256 GiB plus the store, the static sampler's 264 GiB (copied, as on TPU's ``pages``: 320
GiB). Fewer slots than rows, and the ``pages`` layout, copy each row's prompt in: sharing there needs a gathered
read per step on the pure-JAX path, or shared pages whose last, partial page each slot copies.

On a mesh the prompt store and outputs are placed by XLA, the slots split over ``rows``; every host <-> device
transfer is explicit (``jax.transfer_guard("disallow")``).
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
    """The round's constants: the prompt store, keys pk (L x [P, K, D, W]) / values pv (L x [P, K, W, D]), each
    prompt left-aligned (entry e: position e; entries from its length on unused); plen int32[P] (prompt lengths);
    first_token int32[B] (each row's token 0); uniforms f32[B, N, 2] (None greedy); queue int32[B] (the rows to
    decode, in queue order); queued int32 (how many)."""

    pk: tuple
    pv: tuple
    plen: jax.Array
    first_token: jax.Array
    uniforms: jax.Array | None
    queue: jax.Array
    queued: jax.Array


@struct.dataclass
class _State:
    """The slots: row int32[S] (-1 free), step int32[S] (the token index it samples next; shared prompts: not kept,
    every slot at decode_steps + 1), token int32[S] (the token it feeds); decode_steps: decode steps run; row_steps:
    row-steps run (S per decode step); taken: queue rows taken; the outputs tokens int32[B, N], logps f32[B, N, 2]
    (behaviour, sampling), mask bool[B, N], ended bool[B] (stop id seen)."""

    cache: SlotCache
    row: jax.Array
    step: jax.Array
    token: jax.Array
    decode_steps: jax.Array
    row_steps: jax.Array
    taken: jax.Array
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
                         step=c(state.step, rows), token=c(state.token, rows))


def _split(rows) -> int:
    """The devices ``rows`` (a slot sharding; None: one) splits the slots over."""
    if rows is None:
        return 1
    axes = rows.spec[0] if isinstance(rows.spec[0], tuple) else (rows.spec[0],)
    return int(np.prod([rows.mesh.shape[a] for a in axes]))


def _prompt_split(rows, num_prompts: int):
    """Constrain a [P, ...] leaf (prefill input, prompt store) split over ``rows``' data axes when they divide P
    (the round pads P to the mesh size): each device prefills and stores P / d prompts, not all P; the admits
    gather the rows they need. Identity without ``rows`` or where P does not divide."""
    if rows is None or num_prompts % _split(rows):
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, rows)


def _busy(prompts: _Prompts, state: _State):
    return jnp.any(state.row >= 0) | (state.taken < prompts.queued)


def _fits(prompts: _Prompts, state: _State, devices: int, below: int | None):
    """Whether the rows could move down the ladder now: the queue empty and at most ``below`` (the next rung's slots
    per device block; None: no rung below) rows in each of the d blocks -- the host's test of the same status."""
    if below is None:
        return jnp.zeros((), bool)
    live = jnp.sum(state.row.reshape(devices, -1) >= 0, 1)
    return (state.taken >= prompts.queued) & (jnp.max(live) <= below)


def _positions(prompts: _Prompts, state: _State, num_samples: int) -> _State:
    """``state`` with each slot's position for its next step (the cache's qpos): its row's prompt length + its step
    - 1; a free slot 0 (it feeds row 0's token at position 0: it writes at most an entry that a row entering
    rewrites, and attends over one entry, so a length-aware kernel (TPU) reads one page of it, not a finished row's
    length). Set once per step for the next and carried, so the decode step's masks read it. Shared prompts: every
    slot at step decode_steps + 1, so its prompt length + decode_steps, live or not (a free slot's row has ended:
    what it computes is never written back)."""
    cache = state.cache
    if cache.group:
        return state.replace(cache=cache.replace(qpos=cache.plen + state.decode_steps))
    prompt = jnp.maximum(state.row, 0) // num_samples
    qpos = jnp.where(state.row >= 0, prompts.plen[prompt] + state.step - 1, 0)   # a live slot's step < N
    return state.replace(cache=cache.replace(qpos=qpos))


def _admit(prompts: _Prompts, state: _State, admit: int, num_samples: int) -> _State:
    """Up to ``admit`` queued rows into free slots: each one's prompt copied into its slot (`SlotCache.load`), its
    token 0 to feed, step 1."""
    slots, num_rows = state.row.shape[0], prompts.queue.shape[0]
    free = jnp.nonzero(state.row < 0, size=admit, fill_value=slots)[0]
    j = jnp.arange(admit, dtype=jnp.int32)
    ok = (free < slots) & (state.taken + j < prompts.queued)
    row = prompts.queue[jnp.minimum(state.taken + j, num_rows - 1)]
    idx = jnp.where(ok, free, slots)   # slots: dropped
    prompt = row // num_samples
    cache = state.cache.load(idx, tuple(k[prompt] for k in prompts.pk), tuple(v[prompt] for v in prompts.pv),
                             prompts.plen[prompt])
    admitted = state.replace(cache=cache, row=state.row.at[idx].set(row, mode="drop"),
                             step=state.step.at[idx].set(1, mode="drop"),
                             token=state.token.at[idx].set(prompts.first_token[row], mode="drop"),
                             taken=state.taken + jnp.sum(ok, dtype=jnp.int32))
    return _positions(prompts, admitted, num_samples)


def _record_shared(state: _State, i, live, tok, lp, slp, hit, config: SamplingConfig) -> _State:
    """Shared prompts (slot r decodes row r): the step's token written at column ``i`` of every live row's outputs
    in place; the others' entries stay as the round began."""
    def put(x, new, fill):
        return jax.lax.dynamic_update_index_in_dim(
            x, jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, fill).astype(x.dtype), i, 1)
    return state.replace(tokens=put(state.tokens, tok, config.pad_id),
                         logps=put(state.logps, jnp.stack([lp, slp], -1), 0.0),
                         mask=put(state.mask, live, False), ended=jnp.where(live, hit, state.ended))


def _record_rows(state: _State, out, i, tok, lp, slp, hit) -> _State:
    """The step's token written at column ``i`` of rows ``out`` (int32[S]; B: dropped)."""
    return state.replace(tokens=state.tokens.at[out, i].set(tok, mode="drop"),
                         logps=state.logps.at[out, i].set(jnp.stack([lp, slp], -1), mode="drop"),
                         mask=state.mask.at[out, i].set(True, mode="drop"),
                         ended=state.ended.at[out].set(hit, mode="drop"))


def _step(model, prompts: _Prompts, state: _State, config: SamplingConfig, num_samples: int) -> _State:
    """One decode step of every slot: feed its token at its position, sample its next token with its row's
    uniforms at its step, write it to the row's outputs; a row that ends frees its slot."""
    n, num_rows = config.max_new_tokens, prompts.first_token.shape[0]
    live, shared = state.row >= 0, state.cache.group
    # shared prompts: slot r decodes row r, every slot at step decode_steps + 1 (`SlotCache.group`): one column
    i = jnp.minimum(state.decode_steps + 1 if shared else state.step, n - 1)
    cache = state.cache   # its qpos: each slot's position this step (`_positions`)
    if shared:   # the prompt store, read by the step, not carried in the state
        cache = cache.replace(pk=prompts.pk, pv=prompts.pv)
    logits, cache = model.decode_step(state.token[:, None], cache.qpos[:, None], cache, 0)
    u = prompts.uniforms
    if shared:
        cache = cache.replace(pk=(), pv=())
        u = None if u is None else jax.lax.dynamic_index_in_dim(u, i, 1, keepdims=False).T[..., None]
    else:
        u = None if u is None else u[jnp.maximum(state.row, 0), i].T[..., None]
    tok, lp, slp = sample_rows(logits[:, -1], u, config)
    hit = (jnp.any(tok[:, None] == jnp.asarray(config.eos_ids, jnp.int32)[None], -1) if config.eos_ids
           else jnp.zeros_like(live))
    out = jnp.where(live, state.row, num_rows)   # the rows written (B: dropped)
    state = state.replace(cache=cache, row=jnp.where(live & (hit | (i >= n - 1)), -1, state.row),
                          step=state.step if shared else state.step + 1, token=tok,
                          decode_steps=state.decode_steps + 1, row_steps=state.row_steps + state.row.shape[0])
    if shared:
        state = _record_shared(state, i, live, tok, lp, slp, hit, config)
    else:
        state = _record_rows(state, out, i, tok, lp, slp, hit)
    return _positions(prompts, state, num_samples)


def _prefill(model, prompt_ids, prompt_mask, width: int):
    """The prompt store's keys / values (L x [P, K, D, W], L x [P, K, W, D]), each prompt left-aligned (its left
    padding dropped: entry e holds position e), plen int32[P] and the last position's hidden state [P, D];
    W = ``width`` >= Tp (entries from a prompt's length on: unused)."""
    num_prompts, tp = prompt_ids.shape
    pmask = prompt_mask.astype(bool)
    positions = jnp.maximum(jnp.cumsum(pmask.astype(jnp.int32), axis=-1) - 1, 0)
    kv = model.init_cache(num_prompts, tp)
    h, kv = model.decode_hidden(prompt_ids.astype(jnp.int32), positions, kv, 0, pmask)
    plen = jnp.sum(pmask, -1, dtype=jnp.int32)
    src = jnp.minimum(jnp.arange(width, dtype=jnp.int32)[None, :] + (tp - plen)[:, None], tp - 1)   # [P, W]

    def align(x):   # [P, Tp, K, D] -> [P, W, K, D]
        return jnp.take_along_axis(x, src[:, :, None, None], axis=1)

    pk = tuple(align(k).transpose(0, 2, 3, 1) for k in kv.k)
    pv = tuple(align(v).transpose(0, 2, 1, 3) for v in kv.v)
    return pk, pv, plen, h[:, -1]


def _first_state(prompts: _Prompts, cache: SlotCache, slots: int, config: SamplingConfig, lps, ended) -> _State:
    """The state before any row is admitted: every slot free, the outputs' column 0 (each row's token 0 and its
    log-probs ``lps`` f32[B, 2]) written, ``ended`` bool[B] (token 0 a stop id)."""
    num_rows, n = prompts.first_token.shape[0], config.max_new_tokens
    zero = jnp.zeros((), jnp.int32)
    return _State(cache=cache, row=jnp.full((slots,), -1, jnp.int32), step=jnp.zeros((slots,), jnp.int32),
                  token=jnp.zeros((slots,), jnp.int32), decode_steps=zero, row_steps=zero, taken=zero,
                  tokens=jnp.full((num_rows, n), config.pad_id, jnp.int32).at[:, 0].set(prompts.first_token),
                  logps=jnp.zeros((num_rows, n, 2), jnp.float32).at[:, 0].set(lps),
                  mask=jnp.zeros((num_rows, n), bool).at[:, 0].set(True), ended=ended)


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples", "slots", "width", "rows"))
def _start(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int, slots: int,
           width: int, rows=None):
    """Prefill, token 0 of every row, the queue, the first S rows admitted. Returns (_Prompts, _State)."""
    model = nnx.merge(graphdef, params)
    num_prompts, tp = prompt_ids.shape
    n = config.max_new_tokens
    num_rows = num_prompts * num_samples
    mcfg = getattr(model, "config", None)
    if getattr(mcfg, "family", None) == "gpt2" and tp + n > mcfg.max_position_embeddings:
        raise ValueError(f"generate_slots: prompt length {tp} + max_new_tokens {n} exceeds GPT-2's "
                         f"{mcfg.max_position_embeddings} learned positions")
    split = _prompt_split(rows, num_prompts)
    prompt_ids, prompt_mask = split(prompt_ids), split(prompt_mask)
    pk, pv, plen, h = jax.tree.map(split, _prefill(model, prompt_ids, prompt_mask, width))
    logits = jnp.repeat(model.head(h).astype(jnp.float32), num_samples, axis=0)   # [B, V]
    u = None if config.is_greedy else row_uniforms(key, num_rows, n)
    tok0, lp, slp = sample_rows(logits, None if u is None else u[:, 0].T[..., None], config)
    eos = jnp.asarray(config.eos_ids, jnp.int32)
    ended = jnp.any(tok0[:, None] == eos[None], -1) if config.eos_ids else jnp.zeros((num_rows,), bool)
    needs = ~ended & (n > 1)
    queue = jnp.nonzero(needs, size=num_rows, fill_value=0)[0].astype(jnp.int32)
    prompts = _Prompts(pk=pk, pv=pv, plen=plen, first_token=tok0, uniforms=u, queue=queue,
                       queued=jnp.sum(needs, dtype=jnp.int32))
    _, kv_heads, head_dim, _ = pk[0].shape
    paged = paged_layout(graphdef, params)
    group = num_samples if shares_prompts(paged, slots, num_prompts, num_samples, _split(rows)) else 0
    cache = SlotCache.zeros(slots, len(pk), kv_heads, head_dim, width, max(n - 1, 1), pk[0].dtype, paged=paged,
                            span=config.cache_bucket, group=group)
    state = _first_state(prompts, cache, slots, config, jnp.stack([lp, slp], -1), ended)
    if group:   # slot r decodes row r
        seated = state.replace(cache=cache.replace(plen=jnp.repeat(plen, num_samples, total_repeat_length=num_rows)),
                               row=jnp.where(needs, jnp.arange(num_rows, dtype=jnp.int32), -1),
                               step=jnp.ones((slots,), jnp.int32), token=tok0, taken=prompts.queued)
        state = _positions(prompts, seated, num_samples)
    else:
        state = _admit(prompts, state, slots, num_samples)
    return prompts, _constrain(state, rows)


def shares_prompts(paged: bool, slots: int, num_prompts: int, num_samples: int, devices: int = 1) -> bool:
    """Whether S ``slots`` share their prompts' cache entries (`SlotCache`'s ``group``): the ``heads`` layout, a
    slot per row (S = B, so slot r decodes row r), G > 1 (one row per prompt has nothing to share) and the prompts
    splitting evenly over the ``devices`` the slots do (each device's slots read its own prompts)."""
    return not paged and num_samples > 1 and slots == num_prompts * num_samples and num_prompts % devices == 0


def _advance(model, prompts: _Prompts, state: _State, config: SamplingConfig, num_samples: int, admit: int,
             rows) -> _State:
    """One decode step of every slot, free slots refilled first (<= ``admit`` rows; 0: no queue to refill from, as
    with a slot per row and below the first rung)."""
    if admit:
        refill = jnp.any(state.row < 0) & (state.taken < prompts.queued)
        state = jax.lax.cond(refill, lambda s: _admit(prompts, s, admit, num_samples), lambda s: s, state)
    return _constrain(_step(model, prompts, state, config, num_samples), rows)


def _decode(model, prompts: _Prompts, state: _State, config: SamplingConfig, num_samples: int, admit: int, rows,
            below: int | None) -> _State:
    """Decode steps (:func:`_advance`) while a row is left, stopping at the step the rows fit ``below`` slots per
    device block with the queue empty (`_fits`: not one step more at this rung before they move)."""
    devices = _split(rows)
    return jax.lax.while_loop(lambda s: _busy(prompts, s) & ~_fits(prompts, s, devices, below),
                              lambda s: _advance(model, prompts, s, config, num_samples, admit, rows), state)


def _compact(prompts: _Prompts, state: _State, *, slots: int, rows=None) -> _State:
    """The rows in ``state``'s slots moved into ``slots`` slots with their cache entries (shared prompts: each
    one's prompt block from ``prompts``' store), within each device's block of slots (at most ``slots`` / d rows in
    each of the d blocks, the queue empty: nothing crosses devices); the outputs unchanged."""
    devices, before = _split(rows), state.row.shape[0]
    local = jax.vmap(lambda r: jnp.nonzero(r >= 0, size=slots // devices, fill_value=before // devices)[0])(
        state.row.reshape(devices, -1))

    def take(x, fill=0):
        return take_blocks(x, local, 0, fill)
    cache = state.cache
    if cache.group:
        cache = cache.replace(pk=prompts.pk, pv=prompts.pv)
    # shared prompts: every slot at decode_steps + 1
    step = jnp.full((slots,), state.decode_steps + 1, jnp.int32) if cache.group else take(state.step)
    return _constrain(state.replace(cache=cache.take(local), row=take(state.row, -1), step=step,
                                    token=take(state.token)), rows)


@functools.partial(jax.jit, static_argnums=(0, 5), static_argnames=("num_samples", "rungs", "width", "admit", "rows"))
def _round(graphdef, params, prompt_ids, prompt_mask, key, config: SamplingConfig, *, num_samples: int, rungs: tuple,
           width: int, admit: int = 0, rows=None):
    """The round, one program: the prefill (`_start`, the first ``rungs[0]`` rows admitted), decode steps at each
    rung of the ladder ``rungs`` until the rows fit the next (`_decode`; ``admit`` rows refilled per step at the
    first rung, 0 where no row can queue), the move there (`_compact`), and the outputs. Nothing is decided on the
    host, so nothing is read before the end. Returns (Rollout [B, N], counts int32[3]: decode steps, row-steps
    (step 0 of every row + the slots of each decode step run), the deepest rung reached)."""
    global _TRACES
    _TRACES += 1
    devices = _split(rows)
    prompts, state = _start(graphdef, params, prompt_ids, prompt_mask, key, config, num_samples=num_samples,
                            slots=rungs[0], width=width, rows=rows)
    model = nnx.merge(graphdef, params)
    reached = jnp.zeros((), jnp.int32)
    for r in range(len(rungs)):
        below = rungs[r + 1] if r + 1 < len(rungs) else None
        state = _decode(model, prompts, state, config, num_samples, admit if r == 0 else 0, rows,
                        None if below is None else below // devices)
        if below is not None:   # the rows left move down (none left: an empty move, and no step below)
            reached = jnp.where(_busy(prompts, state), r + 1, reached)
            state = _compact(prompts, state, slots=below, rows=rows)
    out = Rollout(tokens=state.tokens, logprobs=state.logps[..., 0], sampling_logprobs=state.logps[..., 1],
                  mask=state.mask, lengths=state.mask.sum(-1, dtype=jnp.int32), truncated=~state.ended)
    return out, jnp.stack([state.decode_steps, state.tokens.shape[0] + state.row_steps, reached])
