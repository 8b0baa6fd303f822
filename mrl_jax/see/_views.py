"""Per-consumer views of the SEE (host side): which peer rollouts and successes a consumer sees for its batch
prompts (``select_peers`` -> ``PeerSelection``), their THL arrays (``ViewAlignment``) and the padded device
``SeeView``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mrl_jax.rows import ARCHIVE, EMPTY, OWN_ARCHIVE, PEER
from mrl_jax.see._records import SEE, SeeView, decode_text

if TYPE_CHECKING:
    from mrl_jax.thl import BatchAlignment


@struct.dataclass
class ViewShape:
    """Static layout of a consumer's SEE view slots per prompt (the same for every probe, so every probe
    compiles the same shapes)."""

    peer_rollouts: int = struct.field(pytree_node=False, default=8)
    peer_successes: int = struct.field(pytree_node=False, default=2)
    own_successes: int = struct.field(pytree_node=False, default=1)

    @property
    def slots(self) -> int:
        return self.peer_rollouts + self.peer_successes + self.own_successes


@dataclasses.dataclass(frozen=True)
class PeerSelection:
    """What ``select_peers`` chose for one consumer (host numpy): S = P*K slots, slot s = p*K + k.

    row_kind int32[S] (PEER: a record of the rollout ring; ARCHIVE / OWN_ARCHIVE: of the success archive; EMPTY),
    record int32[S] (the record's index in its table, -1 when empty), prompt_slot int32[S], source int32[S],
    rewards f32[S], truncated bool[S]; and over the M filled slots in slot order: filled int[M] (their slots),
    texts [M], src_ids [M] of int32[n], src_logp [M] of f32[n] (the source's tokens and behaviour log-probs)."""

    row_kind: np.ndarray
    record: np.ndarray
    prompt_slot: np.ndarray
    source: np.ndarray
    rewards: np.ndarray
    truncated: np.ndarray
    filled: list
    texts: list
    src_ids: list
    src_logp: list


def select_peers(see: SEE, consumer: int, prompt_index: Sequence[int], k_rollouts: int = 4,
                 k_successes: int = 0, k_own: int = 0) -> PeerSelection:
    """Host: choose K = k_rollouts + k_successes + k_own entries per batch prompt for ``consumer``.

    Rollout slots: the records of other policies from their latest round on that prompt (kind PEER), each
    peer's in sampling order, taken round-robin over peers (so every peer is represented), repeats kept:
    they are the peers' actual samples of that round, with their multiplicity.
    Success slots: the newest archived successes of other policies not already chosen (kind ARCHIVE).
    Own slots: the consumer's own newest archived successes (kind OWN_ARCHIVE, for the replay probe).
    """
    ro, su = jax.device_get((see.rollouts, see.successes))   # a host SEE (numpy leaves) passes through
    lr = np.asarray(see.stats.latest_round)
    P, K = len(prompt_index), k_rollouts + k_successes + k_own
    S = P * K
    sel = PeerSelection(row_kind=np.full(S, EMPTY, np.int32), record=np.full(S, -1, np.int32),
                        prompt_slot=np.repeat(np.arange(P, dtype=np.int32), K), source=np.full(S, -1, np.int32),
                        rewards=np.zeros(S, np.float32), truncated=np.zeros(S, bool), filled=[], texts=[],
                        src_ids=[], src_logp=[])
    latest = lr[np.clip(ro.prompt_id, 0, lr.shape[0] - 1), np.clip(ro.source, 0, lr.shape[1] - 1)]
    in_table = (ro.prompt_id >= 0) & (ro.prompt_id < lr.shape[0])
    peer_ro = _by_prompt(ro, ro.valid & (ro.source != consumer) & (~in_table | (ro.round == latest)))
    peer_su = _by_prompt(su, su.valid & (su.source != consumer))
    own_su = _by_prompt(su, su.valid & (su.source == consumer))
    none = np.zeros(0, np.int64)
    for p, pid in enumerate(prompt_index):
        chosen = [(PEER, i) for i in _round_robin(ro, peer_ro.get(int(pid), none))[:k_rollouts]]
        seen = {(int(ro.source[i]), int(ro.text_hash[i]), int(ro.text_len[i])) for _, i in chosen}
        sidx = peer_su.get(int(pid), none)
        n_s = 0
        for i in sidx[np.argsort(-su.stamp[sidx], kind="stable")]:
            if n_s >= k_successes:
                break
            key = (int(su.source[i]), int(su.text_hash[i]), int(su.text_len[i]))
            if key not in seen:
                seen.add(key)
                chosen.append((ARCHIVE, int(i)))
                n_s += 1
        oidx = own_su.get(int(pid), none)
        chosen += [(OWN_ARCHIVE, int(i)) for i in oidx[np.argsort(-su.stamp[oidx], kind="stable")][:k_own]]
        for k, (kind, i) in enumerate(chosen):
            _fill(sel, p * K + k, kind, ro if kind == PEER else su, i)
    return sel


def _fill(sel: PeerSelection, s: int, kind: int, rec, i: int) -> None:
    """Slot ``s`` of ``sel`` holds record ``i`` of table ``rec``."""
    sel.row_kind[s], sel.record[s], sel.source[s] = kind, i, rec.source[i]
    sel.rewards[s], sel.truncated[s] = rec.reward[i], rec.truncated[i]
    sel.filled.append(s)
    sel.texts.append(decode_text(rec, i))
    sel.src_ids.append(np.asarray(rec.src_ids[i][: rec.src_len[i]]))
    sel.src_logp.append(np.asarray(rec.src_logp[i][: rec.src_len[i]]))


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


def peer_stats(see: SEE, consumer: int, prompt_index: Sequence[int]) -> np.ndarray:
    """Latest-round GroupStats f32[P, N, 4] of the batch prompts, the consumer's column zeroed."""
    lat = np.asarray(see.stats.latest)
    pid = np.asarray(prompt_index)
    ok = (pid >= 0) & (pid < lat.shape[0])
    st = np.where(ok[:, None, None], lat[np.clip(pid, 0, lat.shape[0] - 1)], 0.0).astype(np.float32)
    st[:, consumer] = 0.0
    return st


@dataclasses.dataclass(frozen=True)
class ViewAlignment:
    """THL arrays of the M filled slots of a view, in ``PeerSelection.filled`` order (host numpy):
    ``dst_ids int32[M, Td]`` (the consumer's tokens), ``dst_chunk int32[M, Td]`` and ``src_chunk int32[M, Ts]``
    (chunk id per token, -1 = padding), ``chunk_valid bool[M, C]``, ``dst_lengths int32[M]`` (tokens per row)."""

    dst_ids: np.ndarray
    dst_chunk: np.ndarray
    src_chunk: np.ndarray
    chunk_valid: np.ndarray
    dst_lengths: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.dst_lengths.shape[0])

    @classmethod
    def from_batch(cls, batch: "BatchAlignment") -> "ViewAlignment":
        """The rows of one ``thl.BatchAlignment``."""
        return cls(dst_ids=batch.dst_ids, dst_chunk=batch.dst_chunk, src_chunk=batch.src_chunk,
                   chunk_valid=batch.chunk_valid, dst_lengths=batch.dst_lengths)

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
                  chunk_valid=np.zeros((num_rows, width("chunk_valid")), bool), dst_lengths=np.zeros(num_rows, np.int32))
        for rows, a in parts:
            for f in ("dst_ids", "dst_chunk", "src_chunk", "chunk_valid"):
                getattr(out, f)[rows, :getattr(a, f).shape[1]] = getattr(a, f)
            out.dst_lengths[rows] = a.dst_lengths
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
        return cls(dst_ids=ids, dst_chunk=ch, src_chunk=ch.copy(), chunk_valid=keep, dst_lengths=n.astype(np.int32))


def make_view(sel: PeerSelection, aligned: ViewAlignment, *, consumer: int, stats: np.ndarray, max_completion_length: int,
              max_chunks: int, pad_id: int = 0, eos_id: Optional[int] = None) -> SeeView:
    """Host: build the consumer's ``SeeView`` from a ``PeerSelection`` and the THL arrays of its filled
    slots (``aligned``, one row per ``sel.filled`` entry).
    eos_id: appended after a non-truncated completion (no chunk: trained by SGT, masked from PRP).
    Retokenizations longer than max_completion_length are cut and flagged truncated; chunks >= max_chunks
    are dropped (their tokens get dst_chunk -1)."""
    if not isinstance(aligned, ViewAlignment):
        raise TypeError(f"see.make_view: the alignment is a {type(aligned).__name__}; pass a see.ViewAlignment "
                        "(ViewAlignment.from_batches of thl.align_batch results, or ViewAlignment.identity).")
    if aligned.num_rows != len(sel.filled):
        raise ValueError(f"see.make_view: the alignment has {aligned.num_rows} rows for {len(sel.filled)} filled "
                         "slots; align exactly the texts select_peers returned, in order.")
    S, Tc, C = len(sel.row_kind), int(max_completion_length), int(max_chunks)
    ids = np.full((S, Tc), pad_id, np.int32)
    mask = np.zeros((S, Tc), np.float32)
    dchunk = np.full((S, Tc), -1, np.int32)
    sclp = np.zeros((S, C), np.float32)
    cvalid = np.zeros((S, C), bool)
    trunc = sel.truncated.copy()
    kind = sel.row_kind.copy()
    f = np.asarray(sel.filled, np.int64)
    if f.size:
        eos_row = ~trunc[f] if eos_id is not None else None   # a finished source row ends with the EOS
        ids[f], dchunk[f], L = _slot_tokens(aligned, eos_row, Tc, C, pad_id, eos_id)
        mask[f] = np.arange(Tc)[None, :] < L[:, None]
        trunc[f] |= L < aligned.dst_lengths + (0 if eos_row is None else eos_row)   # cut at Tc
        kind[f[L == 0]] = EMPTY
        sclp[f] = _chunk_logp(sel.src_logp, aligned.src_chunk, C)
        width = min(C, aligned.chunk_valid.shape[1])
        cvalid[f, :width] = aligned.chunk_valid[:, :width]
    view = SeeView(completion_ids=ids, completion_mask=mask, dst_chunk=dchunk, src_chunk_logp=sclp,
                   chunk_valid=cvalid, rewards=sel.rewards, source=sel.source, row_kind=kind,
                   prompt_slot=sel.prompt_slot, truncated=trunc, peer_stats=np.asarray(stats, np.float32),
                   consumer=np.asarray(consumer, np.int32))
    return jax.device_put(view)   # one transfer of every field


def _slot_tokens(aligned: ViewAlignment, eos_row, Tc: int, C: int, pad_id: int, eos_id):
    """The M aligned rows as view tokens: (ids int32[M, Tc], dst_chunk int32[M, Tc], length int[M]); rows with
    ``eos_row`` get ``eos_id`` after their tokens (no chunk); cut at Tc; chunks >= C dropped (-1)."""
    M, Td = aligned.dst_ids.shape
    n = aligned.dst_lengths.astype(np.int64)
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


def build_view(see: SEE, consumer: int, prompt_index: Sequence[int], align_batch: Callable, *,
               k_rollouts: int = 4, k_successes: int = 0, k_own: int = 0, max_completion_length: int,
               max_chunks: int, pad_id: int = 0, eos_id: Optional[int] = None) -> SeeView:
    """Host convenience: select_peers -> align_batch(texts, sources, src_ids) -> make_view.
    ``align_batch`` retokenizes each text into the consumer's vocabulary (THL) and returns a ``ViewAlignment``
    (called only when some slot is filled). ``see`` may be host-resident (``jax.device_get``: read it once for
    several consumers)."""
    sel = select_peers(see, consumer, prompt_index, k_rollouts, k_successes, k_own)
    srcs = [int(sel.source[s]) for s in sel.filled]
    aligned = align_batch(sel.texts, srcs, sel.src_ids) if sel.filled else ViewAlignment.identity([])
    return make_view(sel, aligned, consumer=consumer, stats=peer_stats(see, consumer, prompt_index),
                     max_completion_length=max_completion_length, max_chunks=max_chunks, pad_id=pad_id,
                     eos_id=eos_id)


def empty_view(num_prompts: int, slots_per_prompt: int, max_completion_length: int, max_chunks: int,
               num_policies: int, consumer: int = 0) -> SeeView:
    """A view with no peers (every slot EMPTY, zero stats): what the update gets without sharing."""
    S, Tc, C = num_prompts * slots_per_prompt, max_completion_length, max_chunks
    return SeeView(completion_ids=jnp.zeros((S, Tc), jnp.int32), completion_mask=jnp.zeros((S, Tc), jnp.float32),
                   dst_chunk=jnp.full((S, Tc), -1, jnp.int32), src_chunk_logp=jnp.zeros((S, C), jnp.float32),
                   chunk_valid=jnp.zeros((S, C), bool), rewards=jnp.zeros((S,), jnp.float32),
                   source=jnp.full((S,), -1, jnp.int32), row_kind=jnp.full((S,), EMPTY, jnp.int32),
                   prompt_slot=jnp.repeat(jnp.arange(num_prompts, dtype=jnp.int32), slots_per_prompt),
                   truncated=jnp.zeros((S,), bool),
                   peer_stats=jnp.zeros((num_prompts, num_policies, 4), jnp.float32),
                   consumer=jnp.asarray(consumer, jnp.int32))
