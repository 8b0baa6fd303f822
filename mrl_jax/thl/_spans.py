"""Byte spans of the actual token ids (from the vocabulary byte tables), checked against the text (numpy)."""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass

import numpy as np

from mrl_jax.tokenization import HASH_BASE, ByteTable, powers

_SPACE = 0x20


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
            flat = _ints(seqs, int(lengths.sum()))
    off = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=off[1:])
    return flat, off


def _ints(seqs, n: int) -> np.ndarray:
    """The ints of ``seqs`` (sequences of Python ints) concatenated, int64[n]. Read as int32 first (1.6x faster
    than int64 from Python ints); ids beyond int32 fall back to int64 (and are then out of any vocabulary)."""
    try:
        return np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=n).astype(np.int64)
    except OverflowError:
        return np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=n)


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


def _row_hashes(tb: np.ndarray, boff: np.ndarray) -> np.ndarray:
    """``sum_{j in row} tb[j] * P**j`` per row (uint64[B]; j: position in the whole batch)."""
    return _segment_sums(tb * _powers(tb.shape[0])[: tb.shape[0]], boff)


def _segment_sums(x: np.ndarray, off: np.ndarray, dtype=None) -> np.ndarray:
    """``x[off[r]:off[r + 1]].sum()`` per row (``[B]``, 0 for an empty row; ``off: int64[B+1]``, ``off[-1]`` the
    length of ``x``), accumulated in ``dtype`` (default ``x.dtype``; give an integer type for booleans)."""
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    out = np.zeros(off.shape[0] - 1, dtype=dtype)
    nonempty = off[1:] > off[:-1]
    if x.shape[0]:
        out[nonempty] = np.add.reduceat(x, off[:-1][nonempty], dtype=dtype)
    return out


def _powers(n: int) -> np.ndarray:
    """``HASH_BASE ** arange(>= n)`` (cached, grown geometrically)."""
    pw = _PW[0]
    if pw.shape[0] < n:
        pw = powers(max(n, 2 * pw.shape[0]))
        _PW[0] = pw
    return pw


def _side(table: ByteTable, ids: np.ndarray, off: np.ndarray, boff: np.ndarray, text_hash: np.ndarray,
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
    ok = (rowlen == textlen) & (_segment_sums(h * pw[start], off) == text_hash)  # placed at the row's text offset
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
        # tokens that end at the same q: one with bytes, then zero-byte ones (special, unknown). Mapped left (q
        # ends an equal block), the boundary is after the first of them; mapped only right (q starts an equal
        # block after text the tokens do not spell), after the last, so that an unknown token stays with the
        # text it stands for instead of jumping over it into the next chunk
        new_end = np.ones(ends.shape[0] + 1, dtype=bool)
        new_end[1:-1] = ends[1:] != ends[:-1]
        first_of_run, last_of_run = new_end[:-1], new_end[1:]
        mapped = np.where(left_ok & first_of_run, left, np.where(right_ok & ~left_ok & last_of_run, right, -1))
        mapped[left_ok & right_ok & (left != right)] = -1
    mapped[-1] = n
    carried = np.maximum.accumulate(np.concatenate([[0], mapped[:-1]]))
    start = carried + base
    end = np.where(mapped >= 0, mapped + base, -1)
    return L, start, end, stripped, cut
