"""Host side of the THL: common boundaries, chunk ids, padding and residual, vectorised over a batch (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mrl_jax.thl._spans import _flatten, _map_row, _row_hashes, _Side, _side
from mrl_jax.tokenization import ByteTable, Tokenizer, _gather_index

__all__ = ["Alignment", "BatchAlignment", "align", "align_batch"]


# ----------------------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class Alignment:
    """Alignment of one text between a source and a destination tokenization.

    ``src_ids: int32[Ts]``, ``dst_ids: int32[Td]``, ``src_chunk: int32[Ts]``, ``dst_chunk: int32[Td]``
    (chunk ids ``0..num_chunks-1``, non-decreasing; every chunk holds tokens on both sides unless the text has
    no byte or one side has no token),
    ``num_chunks``; per chunk: ``chunk_valid: bool[C]`` (the chunk's bytes are the text's bytes on both
    sides), ``chunk_one_to_one: bool[C]`` (exactly one token each side), ``chunk_start: int32[C]`` and
    ``chunk_bytes: int32[C]`` (byte span in the UTF-8 text). ``src_roundtrip`` / ``dst_roundtrip``: the
    tokens' bytes equal the text. ``residual``: the per-text figures of :class:`BatchAlignment.residual`.
    """

    src_ids: np.ndarray
    dst_ids: np.ndarray
    src_chunk: np.ndarray
    dst_chunk: np.ndarray
    num_chunks: int
    chunk_valid: np.ndarray
    chunk_one_to_one: np.ndarray
    chunk_start: np.ndarray
    chunk_bytes: np.ndarray
    src_roundtrip: bool
    dst_roundtrip: bool
    residual: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BatchAlignment:
    """Padded alignment of a batch (pad token id: the tokenizer's ``pad_id`` or 0; pad chunk id: -1).

    Tokens: ``src_ids, src_chunk: int32[B, Ts]``, ``src_mask: bool[B, Ts]``, ``src_lengths: int32[B]`` (and the
    same for ``dst``). Chunks: ``num_chunks: int32[B]``, ``chunk_valid, chunk_one_to_one: bool[B, C]`` (False on
    padding), ``chunk_start, chunk_bytes: int32[B, C]``. ``truncated: bool[B]``: tokens or chunks were cut
    by ``max_src_len`` / ``max_dst_len`` / ``max_chunks`` (chunks not complete on both sides are invalid).
    ``residual``: per-row numpy arrays (see :func:`align_batch`); ``metrics``: aggregated floats.
    """

    src_ids: np.ndarray
    src_chunk: np.ndarray
    src_mask: np.ndarray
    src_lengths: np.ndarray
    dst_ids: np.ndarray
    dst_chunk: np.ndarray
    dst_mask: np.ndarray
    dst_lengths: np.ndarray
    num_chunks: np.ndarray
    chunk_valid: np.ndarray
    chunk_one_to_one: np.ndarray
    chunk_start: np.ndarray
    chunk_bytes: np.ndarray
    truncated: np.ndarray
    residual: dict
    metrics: dict

    @property
    def batch_size(self) -> int:
        return int(self.src_ids.shape[0])

    @property
    def max_chunks(self) -> int:
        return int(self.chunk_valid.shape[1])

    def row(self, i: int) -> Alignment:
        """Row ``i`` without padding."""
        ns, nd, nc = int(self.src_lengths[i]), int(self.dst_lengths[i]), int(self.num_chunks[i])
        res = {k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in self.residual.items()}
        return Alignment(
            src_ids=self.src_ids[i, :ns].copy(), dst_ids=self.dst_ids[i, :nd].copy(),
            src_chunk=self.src_chunk[i, :ns].copy(), dst_chunk=self.dst_chunk[i, :nd].copy(), num_chunks=nc,
            chunk_valid=self.chunk_valid[i, :nc].copy(), chunk_one_to_one=self.chunk_one_to_one[i, :nc].copy(),
            chunk_start=self.chunk_start[i, :nc].copy(), chunk_bytes=self.chunk_bytes[i, :nc].copy(),
            src_roundtrip=bool(res["src_roundtrip"]), dst_roundtrip=bool(res["dst_roundtrip"]), residual=res)


# ----------------------------------------------------------------------------------------------------------
# the alignment


def _repeat(per_row: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.repeat(per_row, counts)


@dataclass
class _Layout:
    """How row ``r``'s byte chunks ``fc[r] .. fc[r] + nbc[r] - 1`` (intervals of ``C``) become its chunks
    ``cbase[r] .. cbase[r+1] - 1``: plus one leading / trailing chunk of zero-byte specials where ``has_lead`` /
    ``has_trail``. Per row: ``fc, nbc, nchunks: int64[B]``, ``has_lead, has_trail: bool[B]``; ``cbase: int64[B+1]``.
    """

    fc: np.ndarray
    nbc: np.ndarray
    has_lead: np.ndarray
    has_trail: np.ndarray
    nchunks: np.ndarray
    cbase: np.ndarray

    @property
    def K(self) -> int:  # chunks of the whole batch
        return int(self.cbase[-1])

    @property
    def any_extra(self) -> bool:  # some row has a chunk that is not a byte chunk (or none at all)
        return bool((self.nchunks != self.nbc).any())


def _sides(tb: np.ndarray, boff: np.ndarray, src_table: ByteTable, src_ids, src_off, dst_table: ByteTable,
           dst_ids, dst_off) -> tuple[_Side, _Side, np.ndarray | None, np.ndarray]:
    """Byte spans of both sides; the rows whose bytes differ from the text are mapped by :func:`_map_row`.

    Returns ``(src, dst, bad, extra_rows)``: ``bad: bool[N+1]`` marks text bytes a side does not spell (None:
    every row of both sides round-trips), ``extra_rows: bool[B]`` rows with token bytes beyond an empty text.
    """
    B = boff.shape[0] - 1
    text_hash = _row_hashes(tb, boff)
    bad = None
    extra_rows = np.zeros(B, dtype=bool)
    sides = []
    for table, ids, off, what in ((src_table, src_ids, src_off, "source"),
                                  (dst_table, dst_ids, dst_off, "destination")):
        side = _side(table, ids, off, boff, text_hash, what)
        slow = np.nonzero(~side.ok)[0]
        if slow.size and bad is None:
            bad = np.zeros(tb.shape[0] + 1, dtype=bool)
        for r in slow:
            a, b = side.off[r], side.off[r + 1]
            extra: list = []
            side.L[a:b], side.start[a:b], side.end[a:b], side.stripped[r], side.cut[r] = _map_row(
                table, side.ids[a:b], tb[boff[r]:boff[r + 1]].tobytes(), int(boff[r]), bad, extra)
            extra_rows[r] |= bool(extra)
        sides.append(side)
    return sides[0], sides[1], bad, extra_rows


def _fixups(side: _Side, slow_rows: np.ndarray) -> np.ndarray:
    """Token indices needing care (sorted int64): zero-byte tokens and every token of ``slow_rows``."""
    idx = np.nonzero(side.L == 0)[0]
    if slow_rows.size:
        tok = np.concatenate([np.arange(side.off[r], side.off[r + 1]) for r in slow_rows])
        idx = np.union1d(idx, tok)
    return idx


def _byte_chunks(src: _Side, dst: _Side, zs: np.ndarray, zd: np.ndarray, boff: np.ndarray, N: int,
                 slow: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Common boundaries plus every row boundary ``C: int64[n]`` (global text positions, sorted, unique) and the
    global byte chunk of each token, ``k_src: int64[Ms]``, ``k_dst: int64[Md]`` (the number of ``C`` values
    ``<=`` its start, minus one). ``zs`` / ``zd``: the fix-up tokens of :func:`_fixups`."""
    if slow:
        se, de = src.end[src.end >= 0], dst.end[dst.end >= 0]
        if de.size and se.size:
            j = np.searchsorted(de, se)
            np.minimum(j, de.size - 1, out=j)
            common = se[de[j] == se]
        else:
            common = se[:0]
        C = np.unique(np.concatenate([common, boff]))
        return C, np.searchsorted(C, src.start, side="right") - 1, np.searchsorted(C, dst.start, side="right") - 1
    # every row round-trips: the ends of the tokens with bytes increase strictly over the whole batch, the row
    # ends are common ends, and a token's chunk counts the common ends before it (no binary search)
    nzs = src.L > 0 if zs.size else slice(None)
    nzd = dst.L > 0 if zd.size else slice(None)
    se, de = src.end[nzs], dst.end[nzd]
    mark = np.zeros(N + 1, dtype=bool)  # positions are bytes of the batch: membership by bitmap
    mark[de] = True
    m_s = mark[se]
    mark[:] = False
    mark[se] = True
    m_d = mark[de]
    common = se[m_s]
    C = np.concatenate([[0], common]) if not (common.size and common[0] == 0) else common
    k_sd = []
    for side, idx, nz, m in ((src, zs, nzs, m_s), (dst, zd, nzd, m_d)):
        kc = np.cumsum(m) - m
        if idx.size:
            k = np.empty(side.ids.shape[0], dtype=np.int64)
            k[nz] = kc
            k[idx] = np.searchsorted(C, side.start[idx], side="right") - 1
        else:
            k = kc.astype(np.int64)
        k_sd.append(k)
    jb = np.minimum(np.searchsorted(C, boff), C.size - 1)
    if (C[jb] != boff).any():  # cannot happen when every row round-trips; stay safe
        C = np.unique(np.concatenate([C, boff]))
        k_sd = [np.searchsorted(C, side.start, side="right") - 1 for side in (src, dst)]
    return C, k_sd[0], k_sd[1]


def _runs(side: _Side, idx: np.ndarray, table: ByteTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For the fix-up tokens ``idx``: their row, whether in the row's leading run of zero-byte specials, whether in
    its trailing run (``int64[n], bool[n], bool[n]``)."""
    r = np.searchsorted(side.off, idx, side="right") - 1
    zsp = (side.L[idx] == 0) & table.special[side.ids[idx]]
    p, rr = idx[zsp], r[zsp]
    first = np.searchsorted(rr, rr, side="left")
    rank = np.arange(p.size) - first  # rank among the row's zero-byte specials
    n_in_row = np.searchsorted(rr, rr, side="right") - first
    lead, trail = np.zeros(idx.size, dtype=bool), np.zeros(idx.size, dtype=bool)
    lead[zsp] = p - side.off[rr] == rank
    trail[zsp] = (side.off[rr + 1] - 1 - p == n_in_row - 1 - rank)
    trail &= ~lead
    return r, lead, trail


def _layout(C: np.ndarray, boff: np.ndarray, src: _Side, dst: _Side, runs_s, runs_d, messy: bool) -> _Layout:
    """Chunks per row: leading / trailing zero-byte special runs present on *both* sides get chunks of their
    own, in rows that round-trip on both sides, provided both sides keep tokens for the byte chunks."""
    B = boff.shape[0] - 1
    fc = np.searchsorted(C, boff[:-1], side="left")
    nbc = np.searchsorted(C, boff[1:], side="left") - fc  # byte chunks per row
    ns, nd = src.counts, dst.counts
    has_lead = np.zeros(B, dtype=bool)
    has_trail = np.zeros(B, dtype=bool)
    if messy:
        (rs_, lead_s, trail_s), (rd_, lead_d, trail_d) = runs_s, runs_d
        nls, nld = np.bincount(rs_[lead_s], minlength=B), np.bincount(rd_[lead_d], minlength=B)
        nts, ntd = np.bincount(rs_[trail_s], minlength=B), np.bincount(rd_[trail_d], minlength=B)
        clean = src.ok & dst.ok & (nbc > 0)
        has_lead = clean & (nls > 0) & (nld > 0) & (nls < ns) & (nld < nd)
        has_trail = clean & (nts > 0) & (ntd > 0) & (nts + nls * has_lead < ns) & (ntd + nld * has_lead < nd)
    # a text without tokens on either side has no chunk; a zero-byte text with tokens has one
    nchunks = np.where(ns + nd == 0, 0, np.where(nbc > 0, nbc + has_lead + has_trail, 1))
    cbase = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(nchunks, out=cbase[1:])
    return _Layout(fc=fc, nbc=nbc, has_lead=has_lead, has_trail=has_trail, nchunks=nchunks, cbase=cbase)


def _chunk_ids(side: _Side, k: np.ndarray, idx: np.ndarray, runs, lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """Chunk of each token: ``(local: int64[M]`` within its row, ``global: int64[M]`` over the batch)."""
    r, lead, trail = runs
    local = k - _repeat(lay.fc, side.counts)
    if lay.has_lead.any():
        local += _repeat(lay.has_lead, side.counts)
    if idx.size:
        hl = lay.has_lead[r].astype(np.int64)
        v = np.clip(local[idx], hl, hl + np.maximum(lay.nbc[r] - 1, 0))
        v = np.where(lead & lay.has_lead[r], 0, v)
        v = np.where(trail & lay.has_trail[r], lay.nbc[r] + hl, v)
        local[idx] = np.where(lay.nbc[r] > 0, v, 0)
    if lay.any_extra:
        g = local + _repeat(lay.cbase[:-1], side.counts)
    else:  # cbase == fc: the global chunk is the byte chunk, except where fixed up
        g = k
        g[idx] = local[idx] + lay.cbase[r]
    return local, g


def _chunk_spans(C: np.ndarray, boff: np.ndarray, lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """Global text span ``[cstart, cend)`` of every chunk (``int64[K]``; special-run chunks are empty)."""
    if not lay.any_extra:
        return C[:-1], C[1:]
    B = boff.shape[0] - 1
    cstart = _repeat(boff[:-1], lay.nchunks)
    cend = cstart.copy()
    if C.size > 1:
        brow = _repeat(np.arange(B), lay.nbc)
        gb = lay.cbase[:-1][brow] + lay.has_lead[brow] + (np.arange(C.size - 1) - lay.fc[brow])
        used = lay.nchunks[brow] > 0
        cstart[gb[used]], cend[gb[used]] = C[:-1][used], C[1:][used]
    tr = np.nonzero(lay.has_trail)[0]
    cstart[lay.cbase[1:][tr] - 1] = boff[1:][tr]
    cend[lay.cbase[1:][tr] - 1] = boff[1:][tr]
    return cstart, cend


def _text_valid(bad: np.ndarray | None, extra_rows: np.ndarray, cstart: np.ndarray, cend: np.ndarray,
                lay: _Layout, N: int) -> np.ndarray:
    """``bool[K]``: the chunk holds no text byte that a side does not spell (and its row no extra bytes)."""
    if bad is None and not extra_rows.any():
        return np.ones(lay.K, dtype=bool)
    bad_cs = np.zeros(N + 1, dtype=np.int64)
    if bad is not None:
        np.cumsum(bad[:N], out=bad_cs[1:])
    valid = (bad_cs[cend] - bad_cs[cstart]) == 0
    valid &= ~_repeat(extra_rows, lay.nchunks)
    return valid


def _row_tokens(side: _Side, rows: np.ndarray) -> np.ndarray:
    """Flat indices (sorted int64) of the tokens of ``rows`` (sorted)."""
    n = side.counts[rows]
    return _gather_index(side.off[rows], n)


def _stream(table: ByteTable, side: _Side, tok: np.ndarray, g: np.ndarray, drop_spaces: bool):
    """Bytes of the tokens ``tok`` in order, dummy prefix stripped (``uint8[n]``), and each byte's global chunk
    (``int64[n]``, non-decreasing); ``drop_spaces``: without the space bytes."""
    ids, L = side.ids[tok], side.L[tok]
    data = table.data[_gather_index(table.offsets[ids] + (table.lengths[ids] - L), L)]
    chunk = np.repeat(g[tok], L)
    if drop_spaces:
        keep = data != 0x20
        data, chunk = data[keep], chunk[keep]
    if chunk.size > 1 and (chunk[1:] < chunk[:-1]).any():  # not expected: chunk ids grow with the tokens
        order = np.argsort(chunk, kind="stable")
        data, chunk = data[order], chunk[order]
    return data, chunk


def _chunks_agree(src_table: ByteTable, src: _Side, src_g: np.ndarray, zs: np.ndarray, dst_table: ByteTable,
                  dst: _Side, dst_g: np.ndarray, zd: np.ndarray, slow_rows: np.ndarray, lay: _Layout) -> np.ndarray:
    """Safety net, ``bool[K]``: the chunk's source token bytes equal its destination token bytes, and no side holds
    an unknown token there (its bytes are not known).

    The bytes are compared (vectorised, O(bytes)) in ``slow_rows``, the rows where a side's bytes differ from the
    text; in the other rows both sides spell the text (row hash) and every chunk lies between common token ends,
    so its bytes are the text's on both sides by construction. WordPiece (``space_optional``): spaces are not
    compared. ``zs`` / ``zd``: the fix-up tokens (they hold every zero-byte token, hence every unknown one).
    """
    agree = np.ones(lay.K, dtype=bool)
    if slow_rows.size:
        drop = src_table.space_optional or dst_table.space_optional
        a, ca = _stream(src_table, src, _row_tokens(src, slow_rows), src_g, drop)
        b, cb = _stream(dst_table, dst, _row_tokens(dst, slow_rows), dst_g, drop)
        na, nb = np.bincount(ca, minlength=lay.K), np.bincount(cb, minlength=lay.K)
        agree = na == nb
        eq = np.nonzero(agree & (na > 0))[0]
        if eq.size:
            n = na[eq]
            diff = a[_gather_index((np.cumsum(na) - na)[eq], n)] != b[_gather_index((np.cumsum(nb) - nb)[eq], n)]
            if diff.any():
                agree[np.repeat(eq, n)[diff]] = False
    for table, side, g, z in ((src_table, src, src_g, zs), (dst_table, dst, dst_g, zd)):
        unk = z[table.unknown[side.ids[z]]]
        if unk.size:
            agree[g[unk]] = False
    return agree


def _residual(boff, src: _Side, dst: _Side, lay: _Layout, valid, mismatch, one, cbytes, fix_s, fix_d, src_table,
              dst_table, src_normalizes: bool, dst_normalizes: bool) -> dict:
    """Per-row residual figures (see :func:`align_batch`). ``fix_s`` / ``fix_d``: (fix-up token indices, their
    rows)."""
    B = boff.shape[0] - 1
    K, cbase, nchunks = lay.K, lay.cbase, lay.nchunks
    (zs, rs_), (zd, rd_) = fix_s, fix_d

    def per_row(x):
        c = np.zeros(K + 1, dtype=np.int64)
        np.cumsum(x, out=c[1:])
        return c[cbase[1:]] - c[cbase[:-1]]

    def count(side_rows, mask):
        return np.bincount(side_rows[mask], minlength=B).astype(np.int64)

    textlen = np.diff(boff)
    ns, nd = src.counts, dst.counts
    b11 = per_row(np.where(one & valid, cbytes, 0))
    return {
        "text_bytes": textlen.astype(np.int64),
        "src_tokens": ns.astype(np.int64), "dst_tokens": nd.astype(np.int64),
        "num_chunks": nchunks.astype(np.int64),
        "src_roundtrip": src.ok.copy(), "dst_roundtrip": dst.ok.copy(),
        "bytes_one_to_one": b11,
        "frac_bytes_one_to_one": np.where(textlen > 0, b11 / np.maximum(textlen, 1), 1.0),
        "chunks_one_to_one": per_row(one),
        "invalid_bytes": per_row(np.where(valid, 0, cbytes)) + np.where(nchunks == 0, textlen, 0),
        "invalid_chunks": per_row(~valid),
        "byte_mismatch_chunks": per_row(mismatch),
        "src_tokens_per_chunk": ns / np.maximum(nchunks, 1), "dst_tokens_per_chunk": nd / np.maximum(nchunks, 1),
        "src_special": count(rs_, src_table.special[src.ids[zs]]),
        "dst_special": count(rd_, dst_table.special[dst.ids[zd]]),
        "src_unknown": count(rs_, src_table.unknown[src.ids[zs]]),
        "dst_unknown": count(rd_, dst_table.unknown[dst.ids[zd]]),
        "src_dummy_prefix": src.stripped, "dst_dummy_prefix": dst.stripped,
        "cut_mid_char": src.cut,
        "normalized": (~src.ok & src_normalizes) | (~dst.ok & dst_normalizes),
    }


def _core(tb: np.ndarray, boff: np.ndarray, src_table: ByteTable, src_ids, src_off, dst_table: ByteTable,
          dst_ids, dst_off, src_normalizes: bool, dst_normalizes: bool) -> dict:
    """Chunks of a batch, flat: per token (local chunk ids), per chunk (``cbase``-indexed), residual per row.

    ``tb: uint8[N]`` the texts' bytes with row offsets ``boff: int64[B+1]``; ids flat with row offsets.
    """
    N = tb.shape[0]
    src, dst, bad, extra_rows = _sides(tb, boff, src_table, src_ids, src_off, dst_table, dst_ids, dst_off)
    slow = bad is not None
    slow_rows = np.nonzero(~(src.ok & dst.ok))[0] if slow else np.zeros(0, dtype=np.int64)
    zs, zd = _fixups(src, slow_rows), _fixups(dst, slow_rows)
    C, k_src, k_dst = _byte_chunks(src, dst, zs, zd, boff, N, slow)
    runs_s, runs_d = _runs(src, zs, src_table), _runs(dst, zd, dst_table)
    lay = _layout(C, boff, src, dst, runs_s, runs_d, messy=slow or zs.size > 0 or zd.size > 0)
    src_local, src_g = _chunk_ids(src, k_src, zs, runs_s, lay)
    dst_local, dst_g = _chunk_ids(dst, k_dst, zd, runs_d, lay)
    cstart, cend = _chunk_spans(C, boff, lay)
    cnt_s = np.bincount(src_g, minlength=lay.K)
    cnt_d = np.bincount(dst_g, minlength=lay.K)
    one = (cnt_s == 1) & (cnt_d == 1)
    cbytes = cend - cstart
    valid = _text_valid(bad, extra_rows, cstart, cend, lay, N)
    mismatch = valid & ~_chunks_agree(src_table, src, src_g, zs, dst_table, dst, dst_g, zd, slow_rows, lay)
    valid &= ~mismatch
    residual = _residual(boff, src, dst, lay, valid, mismatch, one, cbytes, (zs, runs_s[0]), (zd, runs_d[0]),
                         src_table, dst_table, src_normalizes, dst_normalizes)
    return dict(src_chunk=src_local, dst_chunk=dst_local, nchunks=lay.nchunks, cbase=lay.cbase, valid=valid,
                one=one, cstart=cstart, cbytes=cbytes, residual=residual)


def _metrics(res: dict) -> dict:
    tb = int(res["text_bytes"].sum())
    nc = int(res["num_chunks"].sum())
    B = int(res["text_bytes"].shape[0])
    return {
        "texts": B,
        "text_bytes": tb,
        "chunks": nc,
        "frac_bytes_one_to_one": float(res["bytes_one_to_one"].sum() / tb) if tb else 1.0,
        "frac_bytes_invalid": float(res["invalid_bytes"].sum() / tb) if tb else 0.0,
        "frac_chunks_one_to_one": float(res["chunks_one_to_one"].sum() / nc) if nc else 1.0,
        "frac_chunks_invalid": float(res["invalid_chunks"].sum() / nc) if nc else 0.0,
        "byte_mismatch_chunks": int(res["byte_mismatch_chunks"].sum()),
        "src_tokens_per_chunk": float(res["src_tokens"].sum() / nc) if nc else 0.0,
        "dst_tokens_per_chunk": float(res["dst_tokens"].sum() / nc) if nc else 0.0,
        "src_non_roundtrip_texts": int((~res["src_roundtrip"]).sum()),
        "dst_non_roundtrip_texts": int((~res["dst_roundtrip"]).sum()),
        "src_special_tokens": int(res["src_special"].sum()),
        "dst_special_tokens": int(res["dst_special"].sum()),
        "unknown_tokens": int(res["src_unknown"].sum() + res["dst_unknown"].sum()),
        "cut_mid_char_texts": int(res["cut_mid_char"].sum()),
        "normalized_texts": int(res["normalized"].sum()),
    }


def _pad(off: np.ndarray, width: int, *arrays_fills) -> tuple[np.ndarray, list[np.ndarray]]:
    """Scatter flat per-row arrays into ``[B, width]`` (rows cut at ``width``). Returns (mask, padded arrays)."""
    B = off.shape[0] - 1
    lengths = np.diff(off)
    mask = np.arange(width)[None, :] < np.minimum(lengths, width)[:, None]
    keep = None
    if lengths.max(initial=0) > width:
        keep = (np.arange(off[-1]) - np.repeat(off[:-1], lengths)) < width
    outs = []
    for flat, fill in arrays_fills:
        out = np.full((B, width), fill, dtype=np.int32)
        out[mask] = flat if keep is None else flat[keep]
        outs.append(out)
    return mask, outs


def _truncation(out: dict, s_off, d_off, Ts: int, Td: int, src_chunk: np.ndarray, dst_chunk: np.ndarray,
                max_chunks: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Rows cut at ``Ts`` / ``Td`` tokens or ``max_chunks`` chunks. Returns ``(truncated: bool[B], nkeep: int[B]``
    chunks kept, ``complete: int[B]`` chunks complete on both sides, ``Cw`` the chunk width); chunk ids past
    ``Cw`` in the padded ``src_chunk`` / ``dst_chunk: int32[B, T]`` become -1 (in place)."""
    ns, nd, nchunks = np.diff(s_off), np.diff(d_off), out["nchunks"]
    B = nchunks.shape[0]
    # a chunk is complete on a side iff it is below the chunk of that side's first cut token
    truncated = (ns > Ts) | (nd > Td)
    nkeep = nchunks.copy()
    complete = np.full(B, np.iinfo(np.int64).max)
    for flat_chunk, off, T, n in ((out["src_chunk"], s_off, Ts, ns), (out["dst_chunk"], d_off, Td, nd)):
        cut = np.nonzero(n > T)[0]
        if cut.size:
            complete[cut] = np.minimum(complete[cut], flat_chunk[off[cut] + T])
    if truncated.any():
        last = np.maximum(src_chunk.max(axis=1, initial=-1), dst_chunk.max(axis=1, initial=-1)) + 1
        nkeep = np.where(truncated, np.minimum(nchunks, last), nchunks)
    Cw = max_chunks if max_chunks is not None else max(int(nkeep.max(initial=0)), 1)
    over = nkeep > Cw
    if over.any():
        truncated |= over
        complete = np.where(over, np.minimum(complete, Cw), complete)
        nkeep = np.minimum(nkeep, Cw)
        src_chunk[src_chunk >= Cw] = -1
        dst_chunk[dst_chunk >= Cw] = -1
    return truncated, nkeep, complete, Cw


def align_batch(texts: Sequence[str], src_tokenizer: Tokenizer, dst_tokenizer: Tokenizer, src_ids_list=None,
                max_src_len: int | None = None, max_dst_len: int | None = None, *, dst_ids_list=None,
                src_lengths=None, src_mask=None, max_chunks: int | None = None,
                continuation: bool = True) -> BatchAlignment:
    """Align a batch of texts; see :mod:`mrl_jax.thl`. Vectorised over the whole batch.

    ``src_ids_list``: per-text source ids (list of sequences, or a padded ``int[B, T]`` array with
    ``src_lengths`` / ``src_mask``); None: ``src_tokenizer.encode_batch(texts, continuation=...)``.
    ``dst_ids_list``: precomputed destination ids (default: ``dst_tokenizer.encode_batch(texts,
    continuation=continuation, parse_special=False)``). ``max_src_len`` / ``max_dst_len`` / ``max_chunks``: pad
    widths (default: the batch maxima); longer rows are cut and flagged in ``truncated``.

    ``residual`` holds per-row arrays: ``text_bytes``, ``src_tokens``, ``dst_tokens``, ``num_chunks``,
    ``src_roundtrip``, ``dst_roundtrip``, ``bytes_one_to_one``, ``frac_bytes_one_to_one``,
    ``chunks_one_to_one``, ``invalid_bytes``, ``invalid_chunks``, ``byte_mismatch_chunks`` (chunks the
    per-chunk byte check made invalid: the two sides' token bytes differ there, or a side holds an unknown token;
    0 when the vocabulary byte tables are right), ``src_tokens_per_chunk``,
    ``dst_tokens_per_chunk``, ``src_special``, ``dst_special``, ``src_unknown``, ``dst_unknown``,
    ``src_dummy_prefix``, ``dst_dummy_prefix``, ``cut_mid_char``, ``normalized``; ``metrics`` aggregates them.
    """
    texts = list(texts)
    B = len(texts)
    if src_ids_list is None:
        src_ids_list = src_tokenizer.encode_batch(texts, continuation=continuation, parse_special=False)
    if dst_ids_list is None:
        dst_ids_list = dst_tokenizer.encode_batch(texts, continuation=continuation, parse_special=False)
    s_flat, s_off = _flatten(src_ids_list, src_lengths, src_mask)
    d_flat, d_off = _flatten(dst_ids_list)
    if s_off.shape[0] - 1 != B or d_off.shape[0] - 1 != B:
        raise ValueError(f"{B} texts but {s_off.shape[0] - 1} source and {d_off.shape[0] - 1} destination id rows")
    enc = [t.encode("utf-8") for t in texts]
    boff = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(np.fromiter((len(e) for e in enc), dtype=np.int64, count=B), out=boff[1:])
    tb = np.frombuffer(b"".join(enc), dtype=np.uint8)
    out = _core(tb, boff, src_tokenizer.byte_table, s_flat, s_off, dst_tokenizer.byte_table, d_flat, d_off,
                src_tokenizer.normalizes, dst_tokenizer.normalizes)

    ns, nd, nchunks = np.diff(s_off), np.diff(d_off), out["nchunks"]
    Ts = max_src_len if max_src_len is not None else max(int(ns.max(initial=0)), 1)
    Td = max_dst_len if max_dst_len is not None else max(int(nd.max(initial=0)), 1)
    spad = src_tokenizer.pad_id if src_tokenizer.pad_id is not None else 0
    dpad = dst_tokenizer.pad_id if dst_tokenizer.pad_id is not None else 0
    src_m, (src_ids, src_chunk) = _pad(s_off, Ts, (s_flat, spad), (out["src_chunk"], -1))
    dst_m, (dst_ids, dst_chunk) = _pad(d_off, Td, (d_flat, dpad), (out["dst_chunk"], -1))

    truncated, nkeep, complete, Cw = _truncation(out, s_off, d_off, Ts, Td, src_chunk, dst_chunk, max_chunks)
    cidx = np.arange(Cw)[None, :]
    cmask = cidx < nkeep[:, None]
    gidx = np.minimum(out["cbase"][:-1, None] + cidx, max(out["valid"].shape[0] - 1, 0))

    def take(a, fill):
        if a.shape[0] == 0:
            return np.full((B, Cw), fill, dtype=a.dtype)
        return np.where(cmask, a[gidx], fill)

    chunk_valid = take(out["valid"], False) & (cidx < complete[:, None])
    chunk_one = take(out["one"], False) & (cidx < complete[:, None])
    residual = out["residual"]
    residual["truncated"] = truncated
    return BatchAlignment(
        src_ids=src_ids, src_chunk=src_chunk, src_mask=src_m, src_lengths=np.minimum(ns, Ts).astype(np.int32),
        dst_ids=dst_ids, dst_chunk=dst_chunk, dst_mask=dst_m, dst_lengths=np.minimum(nd, Td).astype(np.int32),
        num_chunks=nkeep.astype(np.int32), chunk_valid=chunk_valid, chunk_one_to_one=chunk_one,
        chunk_start=np.where(cmask, take(out["cstart"], 0) - boff[:-1, None], 0).astype(np.int32),
        chunk_bytes=take(out["cbytes"], 0).astype(np.int32), truncated=truncated, residual=residual,
        metrics=_metrics(residual))


def align(text: str, src_tokenizer: Tokenizer, dst_tokenizer: Tokenizer, src_ids=None, *, dst_ids=None,
          continuation: bool = True) -> Alignment:
    """Align ``text`` between ``src_tokenizer`` and ``dst_tokenizer`` (see :mod:`mrl_jax.thl`).

    ``src_ids``: the exact (possibly non-canonical) source tokens of ``text``, e.g. a rollout's completion;
    None: ``src_tokenizer.encode(text, continuation=continuation, parse_special=False)``.
    ``dst_ids``: default ``dst_tokenizer.encode(text, continuation=continuation, parse_special=False)``.
    """
    if src_ids is None:
        src_ids = src_tokenizer.encode(text, continuation=continuation, parse_special=False)
    if dst_ids is None:
        dst_ids = dst_tokenizer.encode(text, continuation=continuation, parse_special=False)
    ba = align_batch([text], src_tokenizer, dst_tokenizer, [np.asarray(src_ids, dtype=np.int64).reshape(-1)],
                     dst_ids_list=[np.asarray(dst_ids, dtype=np.int64).reshape(-1)])
    return ba.row(0)
