"""The SEE's typed records and buffer (flax.struct pytrees), experience construction and the pure insertion
(``add``: a loop over the kept new entries). See :mod:`mrl_jax.see`."""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_HASH_BASE = np.uint32(16777619)


@struct.dataclass
class RolloutRecord:
    prompt_id: jax.Array      # int32[cap]
    source: jax.Array         # int32[cap]
    text: jax.Array           # uint8[cap, max_bytes]
    text_len: jax.Array       # int32[cap]
    text_hash: jax.Array      # uint32[cap]
    reward: jax.Array         # f32[cap]
    truncated: jax.Array      # bool[cap]
    round: jax.Array          # int32[cap]
    src_ids: jax.Array        # int32[cap, Ts]
    src_logp: jax.Array       # f32[cap, Ts]
    src_len: jax.Array        # int32[cap]
    stamp: jax.Array          # int32[cap] insertion counter (age)
    valid: jax.Array          # bool[cap]
    ptr: jax.Array            # int32[] ring write pointer
    counter: jax.Array        # int32[] records ever written
    per_prompt_cap: int = struct.field(pytree_node=False, default=32)

    @property
    def capacity(self) -> int:
        return self.prompt_id.shape[0]


@struct.dataclass
class SuccessRecord(RolloutRecord):
    """Verified successes (reward >= tau), same fields as RolloutRecord."""


@struct.dataclass
class GroupStats:
    total: jax.Array          # f32[num_prompts, N, 4]: count, sum r, sum r^2, successes (grpo.STAT_*)
    latest: jax.Array         # f32[num_prompts, N, 4] for the latest round of each cell
    latest_round: jax.Array   # int32[num_prompts, N] (-1 = never)


@struct.dataclass
class SEE:
    rollouts: RolloutRecord
    successes: SuccessRecord
    stats: GroupStats
    tau: float = struct.field(pytree_node=False, default=1.0)


@struct.dataclass
class Experience:
    """M new entries for ``add`` (see ``make_experience``); valid False rows are ignored."""
    prompt_id: jax.Array
    source: jax.Array
    text: jax.Array
    text_len: jax.Array
    reward: jax.Array
    truncated: jax.Array
    round: jax.Array
    src_ids: jax.Array
    src_logp: jax.Array
    src_len: jax.Array
    valid: jax.Array
    cut: jax.Array            # bool[M] text was longer than max_bytes (cut; implies truncated)


@struct.dataclass
class SeeView:
    """What consumer i's update reads from SEE for the current batch: P prompt slots x K peer slots
    (S = P*K rows, slot row s = p*K + k), completions THL-retokenized into i's vocabulary, under the field names
    of ``mrl_jax.rows.Rows`` (``rows.peer_rows`` lifts them into rows).

    completion_ids int32[S, Tc] (pad), completion_mask f32[S, Tc], dst_chunk int32[S, Tc] (-1 = no chunk: pad,
    appended EOS, chunk >= C), src_chunk_logp f32[S, C] (source behaviour log-prob per chunk), chunk_valid
    bool[S, C] (False = THL residual / padding chunk), rewards f32[S], source int32[S], row_kind int32[S]
    (PEER current-round peer rollout, ARCHIVE archived success, OWN_ARCHIVE own archived success, EMPTY),
    prompt_slot int32[S], truncated bool[S] (source truncated, or retokenization longer than Tc), peer_stats
    f32[P, N, 4] (latest-round GroupStats of every policy except the consumer, whose column is zero; columns
    ``grpo.STAT_*``), consumer int32[].
    """
    completion_ids: jax.Array
    completion_mask: jax.Array
    dst_chunk: jax.Array
    src_chunk_logp: jax.Array
    chunk_valid: jax.Array
    rewards: jax.Array
    source: jax.Array
    row_kind: jax.Array
    prompt_slot: jax.Array
    truncated: jax.Array
    peer_stats: jax.Array
    consumer: jax.Array


# ----------------------------------------------------------------------------- construction

def _records(cls, cap: int, max_bytes: int, max_src_tokens: int, per_prompt_cap: int):
    if cap <= 0 or max_bytes <= 0 or max_src_tokens <= 0 or per_prompt_cap <= 0:
        raise ValueError("capacity, max_bytes, max_src_tokens and per_prompt_cap must be > 0")
    z = lambda *s, dt=jnp.int32: jnp.zeros(s, dt)
    return cls(prompt_id=jnp.full((cap,), -1, jnp.int32), source=jnp.full((cap,), -1, jnp.int32),
               text=z(cap, max_bytes, dt=jnp.uint8), text_len=z(cap), text_hash=z(cap, dt=jnp.uint32),
               reward=z(cap, dt=jnp.float32), truncated=z(cap, dt=bool), round=z(cap),
               src_ids=z(cap, max_src_tokens), src_logp=z(cap, max_src_tokens, dt=jnp.float32),
               src_len=z(cap), stamp=z(cap), valid=z(cap, dt=bool), ptr=jnp.int32(0), counter=jnp.int32(0),
               per_prompt_cap=int(per_prompt_cap))


def init(capacity: int, max_bytes: int, max_src_tokens: int, num_policies: int, num_prompts: int, *,
         success_capacity: Optional[int] = None, per_prompt_cap: int = 32, success_per_prompt_cap: int = 8,
         tau: float = 1.0) -> SEE:
    """An empty buffer. num_prompts sizes the GroupStats table (prompt ids must lie in [0, num_prompts))."""
    if num_policies <= 0 or num_prompts <= 0:
        raise ValueError("num_policies and num_prompts must be > 0")
    sc = capacity if success_capacity is None else success_capacity
    return SEE(rollouts=_records(RolloutRecord, capacity, max_bytes, max_src_tokens, per_prompt_cap),
               successes=_records(SuccessRecord, sc, max_bytes, max_src_tokens, success_per_prompt_cap),
               stats=GroupStats(total=jnp.zeros((num_prompts, num_policies, 4), jnp.float32),
                                latest=jnp.zeros((num_prompts, num_policies, 4), jnp.float32),
                                latest_round=jnp.full((num_prompts, num_policies), -1, jnp.int32)),
               tau=float(tau))


def make_experience(texts: Sequence[str], prompt_index, source, rewards, *, src_ids: Sequence = None,
                    src_logp: Sequence = None, truncated=None, round: int = 0, max_bytes: int,
                    max_src_tokens: int, num_rows: Optional[int] = None) -> Experience:
    """Host helper: pad M texts (UTF-8) and token arrays into an ``Experience``.

    A text longer than max_bytes is cut there, flagged ``cut`` and ``truncated`` (never a success).
    source: int or per-entry ints; src_ids/src_logp: per-entry 1-D sequences (cut at max_src_tokens);
    num_rows pads M up to a fixed row count (extra rows invalid) so repeated adds reuse one compile.
    """
    M = len(texts)
    R = M if num_rows is None else int(num_rows)
    if R < M:
        raise ValueError(f"num_rows={R} < number of texts {M}")
    text = np.zeros((R, max_bytes), np.uint8)
    tlen = np.zeros((R,), np.int32)
    cut = np.zeros((R,), bool)
    for i, t in enumerate(texts):
        b = t.encode("utf-8") if isinstance(t, str) else bytes(t)
        cut[i] = len(b) > max_bytes
        b = b[:max_bytes]
        text[i, :len(b)] = np.frombuffer(b, np.uint8)
        tlen[i] = len(b)
    ids = np.zeros((R, max_src_tokens), np.int32)
    lps = np.zeros((R, max_src_tokens), np.float32)
    slen = np.zeros((R,), np.int32)
    for i in range(M):
        if src_ids is not None:
            a = np.asarray(src_ids[i], np.int32)[:max_src_tokens]
            ids[i, :len(a)] = a
            slen[i] = len(a)
        if src_logp is not None:
            a = np.asarray(src_logp[i], np.float32)[:max_src_tokens]
            lps[i, :len(a)] = a
    pad = lambda x, dt, fill=0: np.concatenate([np.broadcast_to(np.asarray(x, dt), (M,)),
                                                np.full((R - M,), fill, dt)])
    return Experience(prompt_id=jnp.asarray(pad(prompt_index, np.int32, -1)),
                      source=jnp.asarray(pad(source, np.int32, -1)),
                      text=jnp.asarray(text), text_len=jnp.asarray(tlen), reward=jnp.asarray(pad(rewards, np.float32)),
                      truncated=jnp.asarray(pad(False if truncated is None else truncated, bool) | cut),
                      round=jnp.asarray(pad(round, np.int32)), src_ids=jnp.asarray(ids), src_logp=jnp.asarray(lps),
                      src_len=jnp.asarray(slen), valid=jnp.asarray(pad(True, bool, False)), cut=jnp.asarray(cut))


def text_hash(text: jax.Array, text_len: jax.Array) -> jax.Array:
    """32-bit polynomial hash of the first text_len bytes (+ length), vectorised, wraps mod 2^32."""
    L = text.shape[-1]
    with np.errstate(over="ignore"):
        powers = jnp.asarray(np.cumprod(np.full((L,), _HASH_BASE, np.uint32), dtype=np.uint32))
    keep = jnp.arange(L) < text_len[..., None]
    b = jnp.where(keep, text.astype(jnp.uint32) + jnp.uint32(1), jnp.uint32(0))
    h = jnp.sum(b * powers, axis=-1, dtype=jnp.uint32)
    return h ^ (text_len.astype(jnp.uint32) * jnp.uint32(2654435761))


# ----------------------------------------------------------------------------- pure insertion

_ROW_FIELDS = ("prompt_id", "source", "text", "text_len", "text_hash", "reward", "truncated", "round",
               "src_ids", "src_logp", "src_len")


def _insert(rec: RolloutRecord, exp: Experience, keep: jax.Array, dedup: bool):
    """Insert the entries of exp where keep, one after the other in their order; dedup: skip an entry equal to
    a stored one (same source, prompt, text). Returns (rec, added, dup, evicted). The loop visits only the kept
    entries (moved to the front, order kept): an entry not kept changes nothing."""
    cap = rec.capacity
    order = jnp.argsort(~keep, stable=True)
    xs = {f: getattr(exp, f)[order] for f in _ROW_FIELDS if f != "text_hash"}
    xs["text_hash"] = text_hash(exp.text, exp.text_len)[order]
    xs["keep"] = keep[order]

    def step(r, x):
        same_p = r.valid & (r.prompt_id == x["prompt_id"])
        dup = dedup & jnp.any(same_p & (r.source == x["source"]) & (r.text_hash == x["text_hash"])
                              & (r.text_len == x["text_len"]))
        full_p = jnp.sum(same_p) >= r.per_prompt_cap
        oldest_p = jnp.argmin(jnp.where(same_p, r.stamp, jnp.iinfo(jnp.int32).max)).astype(jnp.int32)
        slot = jnp.where(full_p, oldest_p, r.ptr)
        write = x["keep"] & ~dup
        evicted = write & r.valid[slot]
        upd = {}
        for f in _ROW_FIELDS:
            a = getattr(r, f)
            upd[f] = a.at[slot].set(jnp.where(write, x[f].astype(a.dtype), a[slot]))
        upd["stamp"] = r.stamp.at[slot].set(jnp.where(write, r.counter, r.stamp[slot]))
        upd["valid"] = r.valid.at[slot].set(r.valid[slot] | write)
        upd["ptr"] = jnp.where(write & ~full_p, (r.ptr + 1) % cap, r.ptr).astype(jnp.int32)
        upd["counter"] = r.counter + write.astype(jnp.int32)
        return r.replace(**upd), jnp.stack([write, x["keep"] & dup, evicted]).astype(jnp.int32)

    def body(carry):
        i, r, flags = carry
        r, f = step(r, {k: v[i] for k, v in xs.items()})
        return i + 1, r, flags + f

    n = jnp.sum(keep.astype(jnp.int32))
    _, rec, (added, dup, ev) = jax.lax.while_loop(lambda c: c[0] < n, body,
                                                  (jnp.int32(0), rec, jnp.zeros((3,), jnp.int32)))
    return rec, added, dup, ev


def _update_stats(st: GroupStats, exp: Experience, tau: float):
    Pn, N, _ = st.total.shape
    ok = exp.valid & (exp.prompt_id >= 0) & (exp.prompt_id < Pn) & (exp.source >= 0) & (exp.source < N)
    cell = jnp.where(ok, exp.prompt_id * N + exp.source, 0)
    r = exp.reward.astype(jnp.float32)
    vals = jnp.stack([jnp.ones_like(r), r, r * r, (r >= tau).astype(jnp.float32)], -1) * ok[:, None]
    total = st.total.reshape(Pn * N, 4).at[cell].add(vals)
    lr = st.latest_round.reshape(Pn * N)
    newest = jnp.full((Pn * N,), -1, jnp.int32).at[cell].max(jnp.where(ok, exp.round, -1))
    reset = newest > lr
    latest = jnp.where(reset[:, None], 0.0, st.latest.reshape(Pn * N, 4))
    lr = jnp.where(reset, newest, lr)
    cur = ok & (exp.round == lr[cell])
    latest = latest.at[cell].add(vals * cur[:, None])
    return GroupStats(total=total.reshape(Pn, N, 4), latest=latest.reshape(Pn, N, 4),
                      latest_round=lr.reshape(Pn, N)), jnp.sum((exp.valid & ~ok).astype(jnp.int32))


def add(see: SEE, exp: Experience) -> tuple[SEE, dict]:
    """Pure insertion of new experience: returns (new buffer, info); ``see`` itself is unchanged.
    Every rollout goes to ``rollouts`` (repeats kept, ring eviction); verified successes (reward >= tau,
    not truncated) also to ``successes`` (de-duplicated); every valid entry updates ``stats`` (its true
    reward: a cut text was scored in full). Works under jit."""
    valid = exp.valid & (exp.prompt_id >= 0)
    ro, a, _, e = _insert(see.rollouts, exp, valid, dedup=False)
    su, sa, sd, se = _insert(see.successes, exp, valid & (exp.reward >= see.tau) & ~exp.truncated, dedup=True)
    st, dropped = _update_stats(see.stats, exp, see.tau)
    info = {"added": a, "evicted": e, "successes_added": sa, "success_duplicates": sd,
            "successes_evicted": se, "stats_dropped": dropped,
            "texts_cut": jnp.sum((valid & exp.cut).astype(jnp.int32))}
    return see.replace(rollouts=ro, successes=su, stats=st), info


def decode_text(rec: RolloutRecord, i: int) -> str:
    """Host: the UTF-8 text of record i."""
    t = np.asarray(rec.text[i])[: int(rec.text_len[i])]
    return t.tobytes().decode("utf-8", errors="replace")
