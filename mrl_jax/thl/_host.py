"""Host side of the THL: a batch's chunks (``_chunks``) padded and truncated into ``BatchAlignment`` (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from mrl_jax.thl._chunks import _core
from mrl_jax.thl._spans import _flatten
from mrl_jax.tokenization import Tokenizer

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

    ns, nd = np.diff(s_off), np.diff(d_off)
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
