"""Token id -> bytes: the ``ByteTable`` of a tokenizer, GPT-2's byte <-> unicode map, polynomial byte hashes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

# Polynomial hash of token bytes, modulo 2**64 (numpy uint64 arithmetic wraps): h(b) = sum_k b[k] * P**k.
HASH_BASE = np.uint64(0x100000001B3)  # odd: its powers never vanish modulo 2**64
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map byte -> printable unicode character used by ByteLevel tokenizers."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_LEVEL_CHARS = frozenset(_UNICODE_TO_BYTE)
_BYTE_LEVEL_TRANS = {ord(c): b for c, b in _UNICODE_TO_BYTE.items()}


# ----------------------------------------------------------------------------------------------------------
# token id -> bytes table


@dataclass(frozen=True)
class ByteTable:
    """The bytes each token id stands for, from the vocabulary (never from offsets).

    Conversion follows the tokenizer's decoder: ByteLevel tokens invert GPT-2's ``bytes_to_unicode``;
    Metaspace / ``Replace("▁", " ")`` turn ``▁`` into a space; byte-fallback tokens ``<0xNN>`` are the byte
    ``NN``, also where such a piece is an *added* token (special or not); WordPiece ``##x`` is ``x`` and any
    other piece is ``" " + piece`` (except ``.,!?`` which the decoder's cleanup glues to the previous word).
    Special added tokens, BOS/EOS/PAD and the unknown token contribute **zero bytes** and are flagged in
    ``special`` (``unknown`` for the unk token); non-special added tokens (e.g. GPT-NeoX's runs of spaces)
    contribute their literal text.

    ``prefix_space``: the first token of a sequence may carry a space that is not in the text (SentencePiece
    dummy prefix, the WordPiece space convention, a ``Strip`` decoder). :mod:`mrl_jax.thl` strips it when,
    and only when, the tokens' bytes equal ``" " + text``.

    Arrays: ``lengths: int32[V]``, ``offsets: int64[V+1]`` into ``data: uint8[sum(lengths)]``,
    ``hashes: uint64[V]`` (``sum_k byte_k * HASH_BASE**k`` modulo 2**64), ``special: bool[V]``,
    ``unknown: bool[V]``, ``first_byte: int16[V]`` (-1 when empty). ``space_optional``: the space a
    WordPiece piece starts with is a decoding convention (absent before punctuation or CJK in the text).
    """

    lengths: np.ndarray
    offsets: np.ndarray
    data: np.ndarray
    hashes: np.ndarray
    special: np.ndarray
    unknown: np.ndarray
    first_byte: np.ndarray
    prefix_space: bool
    space_optional: bool = False

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])

    def token_bytes(self, token_id: int) -> bytes:
        return self.data[self.offsets[token_id]: self.offsets[token_id + 1]].tobytes()

    def join(self, ids) -> bytes:
        """Concatenated bytes of ``ids`` (vectorised gather; no dummy-prefix strip)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            return b""
        return self.data[_gather_index(self.offsets[ids], self.lengths[ids])].tobytes()

    @staticmethod
    def from_bytes(pieces: Sequence[bytes], special: np.ndarray, unknown: np.ndarray, prefix_space: bool,
                   space_optional: bool = False) -> "ByteTable":
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int32, count=len(pieces))
        offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = np.frombuffer(b"".join(pieces), dtype=np.uint8).copy()
        hashes = _segment_hashes(data, offsets)
        first = np.full(len(pieces), -1, dtype=np.int16)
        nz = lengths > 0
        first[nz] = data[offsets[:-1][nz]]
        return ByteTable(lengths=lengths, offsets=offsets, data=data, hashes=hashes, special=special,
                         unknown=unknown, first_byte=first, prefix_space=prefix_space,
                         space_optional=space_optional)


def _gather_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices ``concat(range(s, s + l) for s, l)`` without a Python loop."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    csum = np.cumsum(lengths)
    shift = np.repeat(starts.astype(np.int64) - (csum - lengths), lengths)
    return shift + np.arange(total, dtype=np.int64)


def powers(n: int) -> np.ndarray:
    """``HASH_BASE ** arange(n)`` modulo 2**64 (uint64)."""
    p = np.full(max(n, 1), HASH_BASE, dtype=np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)[:n]


def _segment_hashes(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    lengths = np.diff(offsets)
    within = np.arange(data.shape[0], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    pw = powers(int(lengths.max()) + 1 if lengths.size else 1)
    contrib = np.zeros(data.shape[0] + 1, dtype=np.uint64)
    np.cumsum(data.astype(np.uint64) * pw[within], out=contrib[1:])
    return contrib[offsets[1:]] - contrib[offsets[:-1]]


def _flat_pre(p) -> list[dict]:
    if not p:
        return []
    return [x for q in p["pretokenizers"] for x in _flat_pre(q)] if p.get("type") == "Sequence" else [p]


def _decoder_steps(cfg: dict) -> list[dict]:
    """The decoder's steps; without a decoder, the conventions implied by the model / pre-tokenizer."""
    dec = cfg.get("decoder") or {}
    model = cfg.get("model") or {}
    steps = dec.get("decoders", []) if dec.get("type") == "Sequence" else ([dec] if dec else [])
    if not steps:
        pre = _flat_pre(cfg.get("pre_tokenizer"))
        steps = [p for p in pre if p.get("type") in ("ByteLevel", "Metaspace")][:1]
        if model.get("type") == "WordPiece" or "max_input_chars_per_word" in model:
            steps = [{"type": "WordPiece", "prefix": model.get("continuing_subword_prefix", "##"), "cleanup": True}]
        if model.get("byte_fallback"):
            steps.append({"type": "ByteFallback"})
    return steps


def _piece_converter(cfg: dict):
    """(token string -> bytes, prefix_space) following the tokenizer's decoder configuration."""
    steps = _decoder_steps(cfg)
    prefix_space = False
    funcs = []
    for st in steps:
        kind = st.get("type")
        if kind == "ByteLevel":
            def _bl(v):
                if isinstance(v, str) and _BYTE_LEVEL_CHARS.issuperset(v):
                    return v.translate(_BYTE_LEVEL_TRANS).encode("latin-1")
                return v  # not byte-level encoded: literal text
            funcs.append(_bl)
        elif kind == "Metaspace":
            rep = st.get("replacement", "\u2581")
            funcs.append(lambda v, rep=rep: v.replace(rep, " ") if isinstance(v, str) else v)
            if st.get("prepend_scheme", "always" if st.get("add_prefix_space", True) else "never") != "never":
                prefix_space = True
        elif kind == "Replace":
            pat = (st.get("pattern") or {}).get("String")
            if pat is not None:
                funcs.append(lambda v, a=pat, b=st.get("content", ""): v.replace(a, b) if isinstance(v, str) else v)
        elif kind == "ByteFallback":
            def _bf(v):
                if isinstance(v, str):
                    m = _BYTE_FALLBACK.match(v)
                    if m:
                        return bytes([int(m.group(1), 16)])
                return v
            funcs.append(_bf)
        elif kind == "Strip":
            if st.get("start", 0) > 0 and st.get("content", " ") == " ":
                prefix_space = True
        elif kind == "WordPiece":
            prefix = st.get("prefix", "##")
            glue = set(".,!?") if st.get("cleanup", True) else set()

            def _wp(v, prefix=prefix, glue=glue):
                if not isinstance(v, str):
                    return v
                if v.startswith(prefix):
                    return v[len(prefix):]
                return v if v in glue else " " + v
            funcs.append(_wp)
            prefix_space = True
        elif kind == "BPEDecoder":
            suffix = st.get("suffix", "</w>")
            funcs.append(lambda v, s=suffix: v.replace(s, " ") if isinstance(v, str) else v)
        # Fuse, CTC: nothing per token

    def convert(piece: str) -> bytes:
        v = piece
        for f in funcs:
            v = f(v)
        return v if isinstance(v, bytes) else v.encode("utf-8")

    return convert, prefix_space


def build_byte_table(hf: HFTokenizer, special_ids: Iterable[int] = (), cfg: dict | None = None) -> ByteTable:
    """The :class:`ByteTable` of ``hf`` (``special_ids``: extra zero-byte control tokens, e.g. BOS/EOS)."""
    cfg = json.loads(hf.to_str()) if cfg is None else cfg
    convert, prefix_space = _piece_converter(cfg)
    vocab = hf.get_vocab(with_added_tokens=True)
    added = {a["id"]: a for a in cfg.get("added_tokens", [])}
    size = max([hf.get_vocab_size(with_added_tokens=True) - 1, *vocab.values(), *added.keys()]) + 1
    pieces: list[bytes] = [b""] * size
    special = np.zeros(size, dtype=bool)
    unknown = np.zeros(size, dtype=bool)
    for tok, i in vocab.items():
        pieces[i] = convert(tok)
    # a byte-fallback piece "<0xNN>" listed as an added token (special or not) still stands for its byte: the
    # model emits it for that byte and the ByteFallback decoder turns it back into it
    byte_fallback = any(st.get("type") == "ByteFallback" for st in _decoder_steps(cfg))
    byte_ids = set()
    for i, a in added.items():
        m = _BYTE_FALLBACK.match(a["content"]) if byte_fallback else None
        if m:
            pieces[i] = bytes([int(m.group(1), 16)])
            byte_ids.add(i)
        elif a.get("special", False):
            pieces[i] = b""
            special[i] = True
        else:
            pieces[i] = a["content"].encode("utf-8")
    model = cfg.get("model") or {}
    unk_ids = []
    if model.get("unk_token") is not None and hf.token_to_id(model["unk_token"]) is not None:
        unk_ids.append(hf.token_to_id(model["unk_token"]))
    if model.get("unk_id") is not None:
        unk_ids.append(int(model["unk_id"]))
    for i in [*unk_ids, *(j for j in special_ids if j not in byte_ids)]:
        if i is not None and 0 <= i < size:
            pieces[i] = b""
            special[i] = True
    for i in unk_ids:
        unknown[i] = True
    space_optional = any(st.get("type") == "WordPiece" for st in _decoder_steps(cfg))
    return ByteTable.from_bytes(pieces, special, unknown, prefix_space, space_optional)
