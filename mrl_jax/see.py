"""SEE — Shared Experience Exchange: an immutable pytree buffer of typed experience + per-consumer views.

    see = see_lib.init(capacity=4096, max_bytes=256, max_src_tokens=64, num_policies=2, num_prompts=1000)
    exp = see_lib.make_experience(texts, prompt_ids, source=0, rewards=r, src_ids=ids, src_logp=lp, round=t)
    see, info = jax.jit(see_lib.add)(see, exp)        # pure: the old buffer is unchanged
    view = see_lib.build_view(see, consumer=1, prompt_ids=batch_pids, align_batch=fn, ...)   # host
    # fn(texts, sources, src_ids) -> ViewAlignment (ViewAlignment.from_batches of thl.align_batch results)

Typed records (flax.struct dataclasses of fixed-capacity arrays + a write pointer):
- ``RolloutRecord`` (data level): prompt id, source policy, completion text (UTF-8 bytes [cap, max_bytes]
  + length + 32-bit hash), reward, truncated flag, round, the source's own token ids and behaviour
  log-probs (``src_ids``/``src_logp`` [cap, max_src_tokens]). Decision: log-probs are stored per *source
  token*; their per-THL-chunk aggregate depends on the consumer's tokenizer, so ``make_view`` sums them
  per chunk for each consumer (``src_chunk_logp``).
- ``SuccessRecord``: same fields, only verified successes (reward >= tau); its own capacity, so successes
  outlive the rollout ring.
- ``GroupStats`` (value level): a fixed table indexed directly by prompt id [num_prompts, N, 4] with
  (count, sum r, sum r^2, number of successes), cumulative (``total``) and for the latest round of each
  (prompt, policy) cell (``latest`` + ``latest_round``). Prompt ids outside [0, num_prompts) are not
  counted (``info["stats_dropped"]``). Stats count every sample, duplicates included.
Capacity/eviction: a ring pointer overwrites the oldest slot in ring order; when a prompt already holds
``per_prompt_cap`` records, the new one replaces that prompt's oldest record instead.
Multiplicity: the rollout ring keeps every sample, repeats included (a peer that samples "42" four times
contributes four rows): PRP estimates an expectation under the peer's policy and dropping repeats would
bias it towards novel outputs. De-duplication belongs to the success archive only: a success with the same
(source, prompt id, text length, text hash) as an archived one is not archived again.
Byte budget: a text longer than ``max_bytes`` is cut, marked ``truncated`` and never archived as a success
(``info["texts_cut"]`` counts them), so no consumer is taught a cut text as a verified answer.
``add`` is a ``lax.scan`` over the new entries: one compile per (buffer, experience) shape.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

if TYPE_CHECKING:
    from mrl_jax.thl import BatchAlignment

PEER, ARCHIVE, OWN_ARCHIVE, EMPTY = 1, 2, 3, -1      # same codes as mrl_jax.probes row kinds
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
    total: jax.Array          # f32[num_prompts, N, 4]: count, sum r, sum r^2, successes
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
    (S = P*K rows, slot row s = p*K + k), completions THL-retokenized into i's vocabulary.

    ids int32[S, Tc] (pad), mask f32[S, Tc], dst_chunk int32[S, Tc] (-1 = no chunk: pad, appended EOS,
    chunk >= C), src_chunk_logp f32[S, C] (source behaviour log-prob per chunk), chunk_valid bool[S, C]
    (False = THL residual / padding chunk), rewards f32[S], source int32[S], kind int32[S] (PEER=1
    current-round peer rollout, ARCHIVE=2 archived success, EMPTY=-1), prompt_slot int32[S],
    truncated bool[S] (source truncated, or retokenization longer than Tc), peer_stats f32[P, N, 4]
    (latest-round GroupStats of every policy except the consumer, whose column is zero),
    consumer int32[], tau f32[].
    """
    ids: jax.Array
    mask: jax.Array
    dst_chunk: jax.Array
    src_chunk_logp: jax.Array
    chunk_valid: jax.Array
    rewards: jax.Array
    source: jax.Array
    kind: jax.Array
    prompt_slot: jax.Array
    truncated: jax.Array
    peer_stats: jax.Array
    consumer: jax.Array
    tau: jax.Array


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


def make_experience(texts: Sequence[str], prompt_ids, source, rewards, *, src_ids: Sequence = None,
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
    return Experience(prompt_id=jnp.asarray(pad(prompt_ids, np.int32, -1)), source=jnp.asarray(pad(source, np.int32, -1)),
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
    """Insert the entries of exp where keep, sequentially (lax.scan); dedup: skip an entry equal to a
    stored one (same source, prompt, text). Returns (rec, added, dup, evicted)."""
    cap = rec.capacity
    h = text_hash(exp.text, exp.text_len)
    xs = {f: getattr(exp, f) for f in _ROW_FIELDS if f != "text_hash"}
    xs["text_hash"] = h
    xs["keep"] = keep

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

    rec, flags = jax.lax.scan(step, rec, xs)
    added, dup, ev = jnp.sum(flags, 0)
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


# ----------------------------------------------------------------------------- per-consumer views (host)

def select_peers(see: SEE, consumer: int, prompt_ids: Sequence[int], k_rollouts: int = 4,
                 k_successes: int = 0, k_own: int = 0) -> dict:
    """Host: choose K = k_rollouts + k_successes + k_own entries per batch prompt for ``consumer``.

    Rollout slots: the records of other policies from their latest round on that prompt (kind PEER), each
    peer's in sampling order, taken round-robin over peers (so every peer is represented), repeats kept:
    they are the peers' actual samples of that round, with their multiplicity.
    Success slots: the newest archived successes of other policies not already chosen (kind ARCHIVE).
    Own slots: the consumer's own newest archived successes (kind OWN_ARCHIVE, for the replay probe).
    Returns numpy arrays over S = P*K slots (table 0 = rollouts, 1 = successes, -1 = empty; index; kind;
    prompt_slot; source; reward; truncated) and lists (texts, src_ids, src_logp) over the filled slots
    in slot order (``filled`` = their slot indices).
    """
    ro, su = jax.device_get((see.rollouts, see.successes))   # a host SEE (numpy leaves) passes through
    lr = np.asarray(see.stats.latest_round)
    P, K = len(prompt_ids), k_rollouts + k_successes + k_own
    S = P * K
    out = {"table": np.full(S, -1, np.int32), "index": np.full(S, -1, np.int32),
           "kind": np.full(S, EMPTY, np.int32), "prompt_slot": np.repeat(np.arange(P, dtype=np.int32), K),
           "source": np.full(S, -1, np.int32), "reward": np.zeros(S, np.float32),
           "truncated": np.zeros(S, bool), "texts": [], "src_ids": [], "src_logp": [], "filled": []}
    latest = lr[np.clip(ro.prompt_id, 0, lr.shape[0] - 1), np.clip(ro.source, 0, lr.shape[1] - 1)]
    in_table = (ro.prompt_id >= 0) & (ro.prompt_id < lr.shape[0])
    peer_ro = _by_prompt(ro, ro.valid & (ro.source != consumer) & (~in_table | (ro.round == latest)))
    peer_su = _by_prompt(su, su.valid & (su.source != consumer))
    own_su = _by_prompt(su, su.valid & (su.source == consumer))
    none = np.zeros(0, np.int64)
    for p, pid in enumerate(prompt_ids):
        chosen = [(0, i) for i in _round_robin(ro, peer_ro.get(int(pid), none))[:k_rollouts]]
        seen = {(int(ro.source[i]), int(ro.text_hash[i]), int(ro.text_len[i])) for _, i in chosen}
        sidx = peer_su.get(int(pid), none)
        n_s = 0
        for i in sidx[np.argsort(-su.stamp[sidx], kind="stable")]:
            if n_s >= k_successes:
                break
            key = (int(su.source[i]), int(su.text_hash[i]), int(su.text_len[i]))
            if key not in seen:
                seen.add(key)
                chosen.append((1, int(i)))
                n_s += 1
        oidx = own_su.get(int(pid), none)
        chosen += [(2, int(i)) for i in oidx[np.argsort(-su.stamp[oidx], kind="stable")][:k_own]]
        for k, (tab, i) in enumerate(chosen):
            s = p * K + k
            rec = ro if tab == 0 else su
            out["table"][s], out["index"][s] = min(tab, 1), i
            out["kind"][s] = (PEER, ARCHIVE, OWN_ARCHIVE)[tab]
            out["source"][s], out["reward"][s] = rec.source[i], rec.reward[i]
            out["truncated"][s] = rec.truncated[i]
            out["texts"].append(decode_text(rec, i))
            out["src_ids"].append(np.asarray(rec.src_ids[i][: rec.src_len[i]]))
            out["src_logp"].append(np.asarray(rec.src_logp[i][: rec.src_len[i]]))
            out["filled"].append(s)
    return out


def _by_prompt(rec, keep: np.ndarray) -> dict[int, np.ndarray]:
    """{prompt id: the kept record indices of that prompt, ascending}: one pass over the buffer, so each
    batch prompt looks only at its own records."""
    idx = np.nonzero(keep)[0]
    idx = idx[np.argsort(rec.prompt_id[idx], kind="stable")]
    pids, starts = np.unique(rec.prompt_id[idx], return_index=True)
    return dict(zip(pids.tolist(), np.split(idx, starts[1:])))


def _round_robin(rec, idx: np.ndarray) -> list[int]:
    """Record indices ``idx`` ordered round-robin over sources (ascending source), each source's records in
    insertion order: [s0 first, s1 first, ..., s0 second, ...]."""
    per = [idx[rec.source[idx] == j] for j in np.unique(rec.source[idx])]
    per = [q[np.argsort(rec.stamp[q], kind="stable")] for q in per]
    out = []
    for k in range(max((len(q) for q in per), default=0)):
        out += [int(q[k]) for q in per if k < len(q)]
    return out


def peer_stats(see: SEE, consumer: int, prompt_ids: Sequence[int]) -> np.ndarray:
    """Latest-round GroupStats f32[P, N, 4] of the batch prompts, the consumer's column zeroed."""
    lat = np.asarray(see.stats.latest)
    pid = np.asarray(prompt_ids)
    ok = (pid >= 0) & (pid < lat.shape[0])
    st = np.where(ok[:, None, None], lat[np.clip(pid, 0, lat.shape[0] - 1)], 0.0).astype(np.float32)
    st[:, consumer] = 0.0
    return st


@dataclasses.dataclass(frozen=True)
class ViewAlignment:
    """THL arrays of the M filled slots of a view, in ``select_peers``' ``filled`` order (host numpy):
    ``dst_ids int32[M, Td]`` (the consumer's tokens), ``dst_chunk int32[M, Td]`` and ``src_chunk int32[M, Ts]``
    (chunk id per token, -1 = padding), ``chunk_valid bool[M, C]``, ``dst_len int32[M]`` (tokens per row)."""

    dst_ids: np.ndarray
    dst_chunk: np.ndarray
    src_chunk: np.ndarray
    chunk_valid: np.ndarray
    dst_len: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.dst_len.shape[0])

    @classmethod
    def from_batch(cls, batch: "BatchAlignment") -> "ViewAlignment":
        """The rows of one ``thl.BatchAlignment``."""
        return cls(dst_ids=batch.dst_ids, dst_chunk=batch.dst_chunk, src_chunk=batch.src_chunk,
                   chunk_valid=batch.chunk_valid, dst_len=batch.dst_lengths)

    @classmethod
    def from_batches(cls, num_rows: int, parts: Sequence[tuple[np.ndarray, Any]]) -> "ViewAlignment":
        """Rows ``rows int[k]`` of the view from each part of ``parts = [(rows, alignment), ...]`` (a
        ``thl.BatchAlignment`` per source tokenizer, or a ``ViewAlignment`` such as :meth:`identity`), padded to
        the widest part; every row in ``0..num_rows-1`` once."""
        parts = [(rows, a if isinstance(a, cls) else cls.from_batch(a)) for rows, a in parts]
        width = lambda f: max([getattr(a, f).shape[1] for _, a in parts] + [1])
        out = cls(dst_ids=np.zeros((num_rows, width("dst_ids")), np.int32),
                  dst_chunk=np.full((num_rows, width("dst_chunk")), -1, np.int32),
                  src_chunk=np.full((num_rows, width("src_chunk")), -1, np.int32),
                  chunk_valid=np.zeros((num_rows, width("chunk_valid")), bool), dst_len=np.zeros(num_rows, np.int32))
        for rows, a in parts:
            for f in ("dst_ids", "dst_chunk", "src_chunk", "chunk_valid"):
                getattr(out, f)[rows, :getattr(a, f).shape[1]] = getattr(a, f)
            out.dst_len[rows] = a.dst_len
        return out

    @classmethod
    def identity(cls, dst_ids: Sequence[Sequence[int]]) -> "ViewAlignment":
        """A same-tokenizer exchange: the ids as they are, each token its own valid chunk (policies sharing a
        tokenization, a policy's own replayed rows; tests)."""
        n = np.fromiter((len(x) for x in dst_ids), np.int64, len(dst_ids))
        pos = np.arange(max(int(n.max(initial=0)), 1))
        keep = pos[None, :] < n[:, None]
        ids = np.zeros(keep.shape, np.int32)
        if n.sum():
            ids[keep] = np.concatenate([np.asarray(x, np.int64).reshape(-1) for x in dst_ids])
        ch = np.where(keep, pos[None, :], -1).astype(np.int32)
        return cls(dst_ids=ids, dst_chunk=ch, src_chunk=ch.copy(), chunk_valid=keep, dst_len=n.astype(np.int32))


def make_view(sel: dict, aligned: ViewAlignment, *, consumer: int, stats: np.ndarray, max_completion_len: int,
              max_chunks: int, pad_id: int = 0, eos_id: Optional[int] = None, tau: float = 1.0) -> SeeView:
    """Host: build the consumer's ``SeeView`` from ``select_peers`` output and the THL arrays of its filled
    slots (``aligned``, one row per ``sel["filled"]`` entry).
    eos_id: appended after a non-truncated completion (no chunk: trained by SGT, masked from PRP).
    Retokenizations longer than max_completion_len are cut and flagged truncated; chunks >= max_chunks
    are dropped (their tokens get dst_chunk -1)."""
    if not isinstance(aligned, ViewAlignment):
        raise TypeError(f"see.make_view: the alignment is a {type(aligned).__name__}; pass a see.ViewAlignment "
                        "(ViewAlignment.from_batches of thl.align_batch results, or ViewAlignment.identity).")
    if aligned.num_rows != len(sel["filled"]):
        raise ValueError(f"see.make_view: the alignment has {aligned.num_rows} rows for {len(sel['filled'])} filled "
                         "slots; align exactly the texts select_peers returned, in order.")
    S, Tc, C = len(sel["kind"]), int(max_completion_len), int(max_chunks)
    ids = np.full((S, Tc), pad_id, np.int32)
    mask = np.zeros((S, Tc), np.float32)
    dchunk = np.full((S, Tc), -1, np.int32)
    sclp = np.zeros((S, C), np.float32)
    cvalid = np.zeros((S, C), bool)
    trunc = np.asarray(sel["truncated"], bool).copy()
    kind = np.asarray(sel["kind"], np.int32).copy()
    f = np.asarray(sel["filled"], np.int64)
    if f.size:
        eos_row = ~trunc[f] if eos_id is not None else None   # a finished source row ends with the EOS
        ids[f], dchunk[f], L = _slot_tokens(aligned, eos_row, Tc, C, pad_id, eos_id)
        mask[f] = np.arange(Tc)[None, :] < L[:, None]
        trunc[f] |= L < aligned.dst_len + (0 if eos_row is None else eos_row)   # cut at Tc
        kind[f[L == 0]] = EMPTY
        sclp[f] = _chunk_logp(sel["src_logp"], aligned.src_chunk, C)
        width = min(C, aligned.chunk_valid.shape[1])
        cvalid[f, :width] = aligned.chunk_valid[:, :width]
    view = SeeView(ids=ids, mask=mask, dst_chunk=dchunk, src_chunk_logp=sclp, chunk_valid=cvalid,
                   rewards=np.asarray(sel["reward"], np.float32), source=np.asarray(sel["source"], np.int32),
                   kind=kind, prompt_slot=np.asarray(sel["prompt_slot"], np.int32), truncated=trunc,
                   peer_stats=np.asarray(stats, np.float32), consumer=np.asarray(consumer, np.int32),
                   tau=np.asarray(tau, np.float32))
    return jax.device_put(view)   # one transfer of every field


def _slot_tokens(aligned: ViewAlignment, eos_row, Tc: int, C: int, pad_id: int, eos_id):
    """The M aligned rows as view tokens: (ids int32[M, Tc], dst_chunk int32[M, Tc], length int[M]); rows with
    ``eos_row`` get ``eos_id`` after their tokens (no chunk); cut at Tc; chunks >= C dropped (-1)."""
    M, Td = aligned.dst_ids.shape
    n = aligned.dst_len.astype(np.int64)
    W = max(Td + 1, Tc)
    pos = np.arange(W)[None, :]
    ids = np.full((M, W), pad_id, np.int32)
    ch = np.full((M, W), -1, np.int32)
    ids[:, :Td] = np.where(pos[:, :Td] < n[:, None], aligned.dst_ids, pad_id)
    ch[:, :Td] = np.where(pos[:, :Td] < n[:, None], aligned.dst_chunk, -1)
    if eos_row is not None:
        ids[np.nonzero(eos_row)[0], n[eos_row]] = eos_id
        n = n + eos_row
    L = np.minimum(n, Tc)
    keep = pos[:, :Tc] < L[:, None]
    return (np.where(keep, ids[:, :Tc], pad_id), np.where(keep & (ch[:, :Tc] < C), ch[:, :Tc], -1), L)


def _chunk_logp(src_logp: Sequence[np.ndarray], src_chunk: np.ndarray, C: int) -> np.ndarray:
    """f32[M, C]: each row's source-token log-probs summed per THL chunk (tokens without a chunk < C dropped)."""
    M, Ts = src_chunk.shape
    out = np.zeros((M, C), np.float32)
    n = np.asarray([min(len(lp), Ts) for lp in src_logp], np.int64)
    if n.sum():
        rows = np.repeat(np.arange(M), n)
        lp = np.concatenate([np.asarray(x, np.float32)[:k] for x, k in zip(src_logp, n)])
        sc = src_chunk[np.arange(Ts)[None, :] < n[:, None]]
        keep = (sc >= 0) & (sc < C)
        np.add.at(out, (rows[keep], sc[keep]), lp[keep])
    return out


def build_view(see: SEE, consumer: int, prompt_ids: Sequence[int], align_batch: Callable, *,
               k_rollouts: int = 4, k_successes: int = 0, k_own: int = 0, max_completion_len: int,
               max_chunks: int, pad_id: int = 0, eos_id: Optional[int] = None) -> SeeView:
    """Host convenience: select_peers -> align_batch(texts, sources, src_ids) -> make_view.
    ``align_batch`` retokenizes each text into the consumer's vocabulary (THL) and returns a ``ViewAlignment``
    (called only when some slot is filled). ``see`` may be host-resident (``jax.device_get``: read it once for
    several consumers)."""
    sel = select_peers(see, consumer, prompt_ids, k_rollouts, k_successes, k_own)
    srcs = [int(sel["source"][s]) for s in sel["filled"]]
    aligned = align_batch(sel["texts"], srcs, sel["src_ids"]) if sel["filled"] else ViewAlignment.identity([])
    return make_view(sel, aligned, consumer=consumer, stats=peer_stats(see, consumer, prompt_ids),
                     max_completion_len=max_completion_len, max_chunks=max_chunks, pad_id=pad_id,
                     eos_id=eos_id, tau=see.tau)


def empty_view(num_prompts: int, slots_per_prompt: int, max_completion_len: int, max_chunks: int,
               num_policies: int, consumer: int = 0, tau: float = 1.0) -> SeeView:
    """A view with no peers (every slot EMPTY, zero stats): what the update gets without sharing."""
    S, Tc, C = num_prompts * slots_per_prompt, max_completion_len, max_chunks
    return SeeView(ids=jnp.zeros((S, Tc), jnp.int32), mask=jnp.zeros((S, Tc), jnp.float32),
                   dst_chunk=jnp.full((S, Tc), -1, jnp.int32), src_chunk_logp=jnp.zeros((S, C), jnp.float32),
                   chunk_valid=jnp.zeros((S, C), bool), rewards=jnp.zeros((S,), jnp.float32),
                   source=jnp.full((S,), -1, jnp.int32), kind=jnp.full((S,), EMPTY, jnp.int32),
                   prompt_slot=jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), slots_per_prompt),
                   truncated=jnp.zeros((S,), bool),
                   peer_stats=jnp.zeros((num_prompts, num_policies, 4), jnp.float32),
                   consumer=jnp.asarray(consumer, jnp.int32), tau=jnp.asarray(tau, jnp.float32))
