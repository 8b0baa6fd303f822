"""Chunks of a batch: the common byte boundaries of two tokenizations of the same texts, each token's chunk id,
and the per-row residual (what did not map one to one), vectorised over the whole batch (numpy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mrl_jax.thl._spans import _map_row, _row_hashes, _segment_sums, _Side, _side
from mrl_jax.tokenization._bytes import ByteTable, _gather_index


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
    cbase, nchunks = lay.cbase, lay.nchunks
    (zs, rs_), (zd, rd_) = fix_s, fix_d

    def per_row(x):
        return _segment_sums(x, cbase, np.int64)

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
