"""Host side of the THL: byte spans from the vocabulary, common boundaries, chunk ids, residual (numpy)."""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mrl_jax.tokenization import HASH_BASE, ByteTable, Tokenizer, powers, prefix_hashes

__all__ = ["Alignment", "BatchAlignment", "align", "align_batch"]

_SPACE = 0x20


# ----------------------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class Alignment:
    """Alignment of one text between a source and a destination tokenization.

    ``src_ids: int32[Ts]``, ``dst_ids: int32[Td]``, ``src_chunk: int32[Ts]``, ``dst_chunk: int32[Td]``
    (chunk ids ``0..num_chunks-1``, non-decreasing, every id used on both sides except in a zero-byte text),
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
# inputs


def _flatten(ids, lengths=None, mask=None) -> tuple[np.ndarray, np.ndarray]:
    """(flat int64[M], row offsets int64[B+1]) from a list of sequences or a padded 2-D array."""
    if (isinstance(ids, np.ndarray) and ids.ndim == 2) or lengths is not None or mask is not None:
        arr = np.asarray(ids)
        if arr.ndim != 2:
            raise ValueError(f"padded ids must be 2-D [B, T], got shape {arr.shape}")
        if mask is not None:
            mask = np.asarray(mask, dtype=bool)
            lengths = mask.sum(axis=1)
        if lengths is None:
            lengths = np.full(arr.shape[0], arr.shape[1])
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.min(initial=0) < 0 or lengths.max(initial=0) > arr.shape[1]:
            raise ValueError("lengths out of range for the padded ids")
        keep = np.arange(arr.shape[1])[None, :] < lengths[:, None]
        flat = arr[keep].astype(np.int64)
    else:
        seqs = list(ids)
        if seqs and all(isinstance(s, np.ndarray) for s in seqs):
            lengths = np.fromiter((s.shape[0] for s in seqs), dtype=np.int64, count=len(seqs))
            flat = np.concatenate([s.reshape(-1) for s in seqs]).astype(np.int64) if seqs else np.zeros(0, np.int64)
        else:
            lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
            flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    off = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return flat, off


# ----------------------------------------------------------------------------------------------------------
# one side: byte spans of the actual ids, checked against the text


@dataclass
class _Side:
    ids: np.ndarray        # int64[M]
    off: np.ndarray        # int64[B+1] token offsets of the rows
    counts: np.ndarray     # int64[B]
    L: np.ndarray          # int64[M] bytes of each token (after the dummy-prefix strip)
    start: np.ndarray      # int64[M] global text position where the token starts (slow rows: carried)
    end: np.ndarray        # int64[M] global text position where it ends (-1: not a usable boundary)
    ok: np.ndarray         # bool[B] the tokens' bytes equal the text
    stripped: np.ndarray   # bool[B] a dummy leading space was stripped
    cut: np.ndarray        # bool[B] the tokens end inside a UTF-8 character


_PW: list[np.ndarray] = [powers(1 << 16)]
_PINV = np.uint64(pow(int(HASH_BASE), -1, 1 << 64))


def _powers(n: int) -> np.ndarray:
    """``HASH_BASE ** arange(>= n)`` (cached, grown geometrically)."""
    pw = _PW[0]
    if pw.shape[0] < n:
        pw = powers(max(n, 2 * pw.shape[0]))
        _PW[0] = pw
    return pw


def _side(table: ByteTable, ids: np.ndarray, off: np.ndarray, boff: np.ndarray, H: np.ndarray,
          what: str) -> _Side:
    """Byte spans of the actual ids from the vocabulary table; each row checked against the text's hash."""
    B = off.shape[0] - 1
    M = ids.shape[0]
    if M and (int(ids.min()) < 0 or int(ids.max()) >= table.size):
        bad = ids[(ids < 0) | (ids >= table.size)][0]
        raise ValueError(f"{what} id {int(bad)} out of range for a vocabulary of {table.size}")
    counts = np.diff(off)
    L = table.lengths[ids].astype(np.int64)
    cs = np.zeros(M + 1, dtype=np.int64)
    np.cumsum(L, out=cs[1:])
    rs = cs[off]
    rowlen = np.diff(rs)
    textlen = np.diff(boff)
    h = table.hashes[ids]
    stripped = np.zeros(B, dtype=bool)
    if table.prefix_space:
        cand = np.nonzero((rowlen == textlen + 1) & (counts > 0))[0]
        if cand.size:
            first = np.searchsorted(cs[1:], rs[cand], side="right")  # the row's first token with bytes
            keep = table.first_byte[ids[first]] == _SPACE
            cand, first = cand[keep], first[keep]
            if cand.size:  # strip the dummy prefix: one space byte off that token
                stripped[cand] = True
                h[first] = (h[first] - np.uint64(_SPACE)) * _PINV
                L[first] -= 1
                np.cumsum(L, out=cs[1:])
                rs = cs[off]
                rowlen = np.diff(rs)
    pw = _powers(int(boff[-1]) + int(cs[-1]) + 2)
    start = cs[:-1] + np.repeat(boff[:-1] - rs[:-1], counts)  # stream position -> text position
    pc = np.zeros(M + 1, dtype=np.uint64)
    np.cumsum(h * pw[start], out=pc[1:])  # hash of the row's token bytes, placed at the row's text offset
    ok = (rowlen == textlen) & (np.diff(pc[off]) == H[boff[1:]] - H[boff[:-1]])
    return _Side(ids=ids, off=off, counts=counts, L=L, start=start, end=start + L, ok=ok, stripped=stripped,
                 cut=np.zeros(B, dtype=bool))


def _map_row(table: ByteTable, ids: np.ndarray, text: bytes, base: int, bad: np.ndarray, extra: list) -> tuple:
    """Slow path for a row whose token bytes differ from the text: map token boundaries through the longest
    common subsequence of (token bytes, text bytes); boundaries in changed regions are dropped (their tokens
    merge into one chunk) and the changed text bytes are marked in ``bad``. Returns (byte lengths, start, end,
    stripped, cut_mid_char) with text positions offset by ``base``."""
    L = table.lengths[ids].astype(np.int64)
    S = table.join(ids)
    stripped = False
    if table.prefix_space and S[:1] == b" " and (len(S) == len(text) + 1 or not text.startswith(b" ")):
        nz = np.nonzero(L)[0]
        L[nz[0]] -= 1
        S = S[1:]
        stripped = True
    try:
        S.decode("utf-8")
        cut = False
    except UnicodeDecodeError as e:
        cut = e.reason == "unexpected end of data"
    ends = np.cumsum(L)
    n = len(text)
    if ids.size == 0:
        if n:
            bad[base: base + n] = True
        return L, ends, ends, stripped, cut
    sm = difflib.SequenceMatcher(None, S, text, autojunk=False)
    eq = [(i1, i2, j1) for tag, i1, i2, j1, j2 in sm.get_opcodes() if tag == "equal"]
    for tag, i1, i2, j1, j2 in sm.get_opcodes():  # tags turn the token bytes S into the text
        if tag in ("replace", "insert") and j2 > j1:  # text bytes the tokens do not spell
            bad[base + j1: base + j2] = True
        elif tag == "delete":  # token bytes that are not in the text
            if table.space_optional and S[i1:i2].strip(b" ") == b"":
                continue  # WordPiece's conventional space before a piece: not a change of the text
            if n == 0:
                extra.append(True)
            else:
                bad[base + max(j1 - 1, 0)] = True
                bad[base + min(j1, n - 1)] = True
    mapped = np.full(ends.shape[0], -1, dtype=np.int64)
    if eq:
        i1s, i2s, j1s = (np.array(x, dtype=np.int64) for x in zip(*eq))
        k = np.searchsorted(i1s, ends, side="left") - 1  # blocks with i1 < q
        kl = np.maximum(k, 0)
        left_ok = (k >= 0) & (ends <= i2s[kl])
        left = j1s[kl] + ends - i1s[kl]
        k2 = np.searchsorted(i1s, ends, side="right") - 1  # blocks with i1 <= q
        kr = np.maximum(k2, 0)
        right_ok = (k2 >= 0) & (ends < i2s[kr])
        right = j1s[kr] + ends - i1s[kr]
        mapped = np.where(left_ok, left, np.where(right_ok, right, -1))
        mapped[left_ok & right_ok & (left != right)] = -1
    mapped[-1] = n
    carried = np.maximum.accumulate(np.concatenate([[0], mapped[:-1]]))
    start = carried + base
    end = np.where(mapped >= 0, mapped + base, -1)
    return L, start, end, stripped, cut


# ----------------------------------------------------------------------------------------------------------
# the alignment


def _repeat(per_row: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return np.repeat(per_row, counts)


def _core(tb: np.ndarray, boff: np.ndarray, src_table: ByteTable, src_ids, src_off, dst_table: ByteTable,
          dst_ids, dst_off, src_normalizes: bool, dst_normalizes: bool) -> dict:
    B = boff.shape[0] - 1
    N = tb.shape[0]
    H = prefix_hashes(tb, _powers(N + 2))
    bad = None
    extra_rows = np.zeros(B, dtype=bool)
    sides = []
    slow_any = False
    for table, ids, off, what in ((src_table, src_ids, src_off, "source"), (dst_table, dst_ids, dst_off, "destination")):
        side = _side(table, ids, off, boff, H, what)
        slow = np.nonzero(~side.ok)[0]
        if slow.size:
            slow_any = True
            if bad is None:
                bad = np.zeros(N + 1, dtype=bool)
            for r in slow:
                a, b = side.off[r], side.off[r + 1]
                extra: list = []
                side.L[a:b], side.start[a:b], side.end[a:b], side.stripped[r], side.cut[r] = _map_row(
                    table, side.ids[a:b], tb[boff[r]:boff[r + 1]].tobytes(), int(boff[r]), bad, extra)
                extra_rows[r] |= bool(extra)
        sides.append(side)
    src, dst = sides

    # token indices needing care: zero-byte tokens and every token of a slow row
    def fixups(side: _Side) -> np.ndarray:
        idx = np.nonzero(side.L == 0)[0]
        if slow_any:
            slow_rows = np.nonzero(~side.ok | ~(src.ok & dst.ok))[0]
            if slow_rows.size:
                tok = np.concatenate([np.arange(side.off[r], side.off[r + 1]) for r in slow_rows])
                idx = np.union1d(idx, tok)
        return idx

    zs, zd = fixups(src), fixups(dst)
    messy = slow_any or zs.size > 0 or zd.size > 0

    # common boundaries (global text positions) plus every row boundary -> C (sorted, unique)
    se, de = src.end, dst.end
    if slow_any:
        se, de = se[se >= 0], de[de >= 0]
    if de.size and se.size:
        j = np.searchsorted(de, se)
        np.minimum(j, de.size - 1, out=j)
        common = se[de[j] == se]
    else:
        common = se[:0]
    if messy and common.size > 1:
        common = common[np.concatenate([[True], common[1:] != common[:-1]])]
    if common.size:
        jb = np.minimum(np.searchsorted(common, boff), common.size - 1)
        missing = boff[common[jb] != boff]
    else:
        missing = boff
    if missing.size and (not common.size or missing[-1] < common[0]):
        C = np.concatenate([np.unique(missing), common])
    elif missing.size:
        C = np.unique(np.concatenate([common, missing]))
    else:
        C = common
    fc = np.searchsorted(C, boff[:-1], side="left")
    nbc = np.searchsorted(C, boff[1:], side="left") - fc  # byte chunks per row
    ns, nd = src.counts, dst.counts

    # zero-byte special runs at the start / end of a row on both sides get chunks of their own
    def runs(side: _Side, idx: np.ndarray, table: ByteTable):
        r = np.searchsorted(side.off, idx, side="right") - 1
        zsp = (side.L[idx] == 0) & table.special[side.ids[idx]]
        lead = zsp & (side.start[idx] == boff[r])
        trail = zsp & (side.start[idx] == boff[r + 1]) & ~lead
        return r, lead, trail

    rs_, lead_s, trail_s = runs(src, zs, src_table)
    rd_, lead_d, trail_d = runs(dst, zd, dst_table)
    has_lead = np.zeros(B, dtype=bool)
    has_trail = np.zeros(B, dtype=bool)
    if messy:
        has_lead[np.intersect1d(rs_[lead_s], rd_[lead_d])] = True
        has_trail[np.intersect1d(rs_[trail_s], rd_[trail_d])] = True
        has_lead &= nbc > 0
        has_trail &= nbc > 0
    nchunks = np.where(nbc > 0, nbc + has_lead + has_trail, ((ns + nd) > 0).astype(np.int64))
    cbase = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(nchunks, out=cbase[1:])
    K = int(cbase[-1])
    any_extra = bool((nchunks != nbc).any())
    any_lead = bool(has_lead.any())

    def chunk_ids(side: _Side, idx, r, lead, trail):
        k = np.searchsorted(C, side.start, side="right") - 1  # global byte chunk
        local = k - _repeat(fc, side.counts)
        if any_lead:
            local += _repeat(has_lead, side.counts)
        if idx.size:
            hl = has_lead[r].astype(np.int64)
            v = np.clip(local[idx], hl, hl + np.maximum(nbc[r] - 1, 0))
            v = np.where(lead & has_lead[r], 0, v)
            v = np.where(trail & has_trail[r], nbc[r] + hl, v)
            local[idx] = np.where(nbc[r] > 0, v, 0)
        if any_extra:
            g = local + _repeat(cbase[:-1], side.counts)
        else:  # cbase == fc: the global chunk is the byte chunk, except where fixed up
            g = k
            g[idx] = local[idx] + cbase[r]
        return local, g

    src_local, src_g = chunk_ids(src, zs, rs_, lead_s, trail_s)
    dst_local, dst_g = chunk_ids(dst, zd, rd_, lead_d, trail_d)

    # per-chunk arrays, flat over the batch: row r's chunks are cbase[r] .. cbase[r+1]-1
    if any_extra:
        cstart = _repeat(boff[:-1], nchunks)
        cend = cstart.copy()
        if C.size > 1:
            brow = _repeat(np.arange(B), nbc)
            gb = cbase[:-1][brow] + has_lead[brow] + (np.arange(C.size - 1) - fc[brow])
            cstart[gb], cend[gb] = C[:-1], C[1:]
        tr = np.nonzero(has_trail)[0]
        cstart[cbase[1:][tr] - 1] = boff[1:][tr]
        cend[cbase[1:][tr] - 1] = boff[1:][tr]
    else:
        cstart, cend = C[:-1], C[1:]
    cnt_s = np.bincount(src_g, minlength=K)
    cnt_d = np.bincount(dst_g, minlength=K)
    one = (cnt_s == 1) & (cnt_d == 1)
    cbytes = cend - cstart
    if bad is not None or extra_rows.any():
        bad_cs = np.zeros(N + 1, dtype=np.int64)
        if bad is not None:
            np.cumsum(bad[:N], out=bad_cs[1:])
        valid = (bad_cs[cend] - bad_cs[cstart]) == 0
        valid &= ~_repeat(extra_rows, nchunks)
    else:
        valid = np.ones(K, dtype=bool)

    def per_row(x):
        c = np.zeros(K + 1, dtype=np.int64)
        np.cumsum(x, out=c[1:])
        return c[cbase[1:]] - c[cbase[:-1]]

    def count(side_rows, mask):
        return np.bincount(side_rows[mask], minlength=B).astype(np.int64)

    textlen = np.diff(boff)
    b11 = per_row(np.where(one & valid, cbytes, 0))
    residual = {
        "text_bytes": textlen.astype(np.int64),
        "src_tokens": ns.astype(np.int64), "dst_tokens": nd.astype(np.int64),
        "num_chunks": nchunks.astype(np.int64),
        "src_roundtrip": src.ok.copy(), "dst_roundtrip": dst.ok.copy(),
        "bytes_one_to_one": b11,
        "frac_bytes_one_to_one": np.where(textlen > 0, b11 / np.maximum(textlen, 1), 1.0),
        "chunks_one_to_one": per_row(one),
        "invalid_bytes": per_row(np.where(valid, 0, cbytes)),
        "invalid_chunks": per_row(~valid),
        "src_tokens_per_chunk": ns / np.maximum(nchunks, 1), "dst_tokens_per_chunk": nd / np.maximum(nchunks, 1),
        "src_special": count(rs_, src_table.special[src.ids[zs]]),
        "dst_special": count(rd_, dst_table.special[dst.ids[zd]]),
        "src_unknown": count(rs_, src_table.unknown[src.ids[zs]]),
        "dst_unknown": count(rd_, dst_table.unknown[dst.ids[zd]]),
        "src_dummy_prefix": src.stripped, "dst_dummy_prefix": dst.stripped,
        "cut_mid_char": src.cut,
        "normalized": (~src.ok & src_normalizes) | (~dst.ok & dst_normalizes),
    }
    return dict(src_chunk=src_local, dst_chunk=dst_local, nchunks=nchunks, cbase=cbase, valid=valid, one=one,
                cstart=cstart, cbytes=cbytes, residual=residual)


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


def _pad(flat: np.ndarray, off: np.ndarray, width: int, fill) -> tuple[np.ndarray, np.ndarray]:
    B = off.shape[0] - 1
    lengths = np.diff(off)
    out = np.full((B, width), fill, dtype=np.int32)
    mask = np.arange(width)[None, :] < np.minimum(lengths, width)[:, None]
    keep = (np.arange(flat.shape[0]) - np.repeat(off[:-1], lengths)) < width
    out[mask] = flat[keep]
    return out, mask


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
    ``chunks_one_to_one``, ``invalid_bytes``, ``invalid_chunks``, ``src_tokens_per_chunk``,
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
    src_ids, src_m = _pad(s_flat, s_off, Ts, spad)
    dst_ids, dst_m = _pad(d_flat, d_off, Td, dpad)
    src_chunk, _ = _pad(out["src_chunk"], s_off, Ts, -1)
    dst_chunk, _ = _pad(out["dst_chunk"], d_off, Td, -1)
    src_chunk[~src_m] = -1
    dst_chunk[~dst_m] = -1

    # truncation: a chunk is complete on a side iff it is below the chunk of that side's first cut token
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
        chunk_start=take(out["cstart"], 0).astype(np.int32),
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
