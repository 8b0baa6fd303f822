"""Tokenizers: load a Hugging Face ``tokenizer.json``, or train a small one, behind one ``Tokenizer`` class.

``load_tokenizer(path)`` wraps a local ``tokenizer.json`` (the Rust ``tokenizers`` library, no network) and
infers the BOS / EOS / PAD ids from the files next to it (``tokenizer_config.json``,
``special_tokens_map.json``, ``generation_config.json``, ``config.json``) or, failing those, from the usual
added-token spellings (``<|endoftext|>``, ``</s>``, ``<s>``, ``[SEP]``, ``<pad>`` ...).

``train_tokenizer(kind, corpus, vocab_size)`` builds the small tokenizers the embedded default needs, one per
algorithm family, deterministically and cached on disk:

========================  ===========================================================================
``"byte_bpe"``            GPT-2 / Qwen style: ByteLevel pre-tokenizer and decoder, digits split one by one
``"metaspace_bpe"``       Llama-2 / SentencePiece style: ``▁`` for spaces, dummy prefix, byte fallback
                          (``<0x00>`` .. ``<0xFF>``), digits split one by one
``"unigram"``             T5 style Unigram LM over Metaspace pieces, with byte fallback
``"wordpiece"``           BERT style WordPiece (``##`` continuations); whitespace is *not* preserved
``"char"``                one token per character (most frequent characters), byte fallback for the rest
========================  ===========================================================================

Special tokens of trained tokenizers: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2) (and ``<unk>`` (3) for the
kinds that need one).

Conventions of :class:`Tokenizer` (used by :mod:`mrl_jax.thl`):

* ``encode(text)`` never adds special tokens (no BOS/EOS); ``add_special_tokens=True`` runs the post-processor.
* ``encode(text, continuation=True)`` encodes ``text`` as the *continuation* of an earlier sequence: no
  SentencePiece dummy prefix (``"42"`` -> ``4 2``, not ``▁ 4 2``), so the ids spell exactly the bytes of
  ``text``. ``parse_special=False`` treats special-token spellings in ``text`` as plain text (a peer's text
  must never inject a control token).
* ``decode(ids)`` skips special tokens (as TRL/HF do for completions); ``decode(ids, continuation=True)``
  returns the exact bytes of the tokens (from the vocabulary table, no dummy-prefix strip, no cleanup).
* :attr:`Tokenizer.byte_table` maps every token id to the UTF-8 bytes it stands for (see :class:`ByteTable`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

__all__ = [
    "ByteTable",
    "Tokenizer",
    "TRAINABLE_KINDS",
    "bytes_to_unicode",
    "load_tokenizer",
    "train_tokenizer",
]

TRAINABLE_KINDS = ("byte_bpe", "metaspace_bpe", "unigram", "wordpiece", "char")
_MIN_VOCAB = {"byte_bpe": 260, "metaspace_bpe": 261, "unigram": 264, "wordpiece": 8, "char": 260}
_TRAIN_SPECIALS = ("<pad>", "<bos>", "<eos>")
_UNK = "<unk>"
_CACHE_VERSION = "mrl-tok-v6"

# Polynomial hash of token bytes, modulo 2**64 (numpy uint64 arithmetic wraps): h(b) = sum_k b[k] * P**k.
HASH_BASE = np.uint64(0x100000001B3)  # odd: its powers never vanish modulo 2**64

_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|padding|>", "<|pad|>", "<|finetune_right_pad_id|>")
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Normalizers that change the text itself (Prepend / Replace(" " -> "▁") are the Metaspace convention only).
_TEXT_CHANGING_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "Precompiled",
                              "Strip", "StripAccents", "ByteLevel"}


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


# ----------------------------------------------------------------------------------------------------------
# configuration surgery


def _continuation_config(cfg: dict) -> dict:
    """The same tokenizer without a dummy prefix (SentencePiece ``▁`` / ByteLevel ``add_prefix_space``)."""
    cfg = copy.deepcopy(cfg)

    def fix_norm(n):
        if not n:
            return n
        if n.get("type") == "Prepend":
            return None
        if n.get("type") == "Sequence":
            n["normalizers"] = [m for m in (fix_norm(x) for x in n["normalizers"]) if m]
        return n

    def fix_pre(p):
        if not p:
            return p
        if p.get("type") == "Metaspace":
            p["prepend_scheme"] = "never"
            p.pop("add_prefix_space", None)
        elif p.get("type") == "ByteLevel":
            p["add_prefix_space"] = False
        elif p.get("type") == "Sequence":
            subs = p["pretokenizers"]
            # after a whitespace-removing split (T5's WhitespaceSplit) the Metaspace prefix *is* the space
            # between words: keep it there (the THL strips the dummy one)
            drop = next((i for i, x in enumerate(subs) if x.get("type") in _SPACE_REMOVING), None)
            p["pretokenizers"] = [fix_pre(x) if drop is None or i < drop or x.get("type") != "Metaspace" else x
                                  for i, x in enumerate(subs)]
        return p

    cfg["normalizer"] = fix_norm(cfg.get("normalizer"))
    cfg["pre_tokenizer"] = fix_pre(cfg.get("pre_tokenizer"))
    return cfg


_SPACE_REMOVING = {"WhitespaceSplit", "Whitespace", "BertPreTokenizer"}


def _normalizer_types(n) -> list[str]:
    if not n:
        return []
    if n.get("type") == "Sequence":
        return [t for m in n["normalizers"] for t in _normalizer_types(m)]
    if n.get("type") == "Replace":
        pat = (n.get("pattern") or {}).get("String")
        return [] if (pat == " " and n.get("content") == "\u2581") else ["Replace"]
    return [n.get("type")]


# ----------------------------------------------------------------------------------------------------------
# Tokenizer


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the ids and byte tables RL code needs.

    Attributes: ``hf`` (the wrapped ``tokenizers.Tokenizer``), ``name``, ``vocab_size`` (including added
    tokens), ``bos_id`` / ``eos_id`` / ``pad_id`` / ``unk_id`` (``int | None``), ``normalizes`` (the tokenizer
    changes the text: lowercasing, NFC/NFKC, accent stripping, whitespace collapsing ...).
    """

    def __init__(self, hf: HFTokenizer, *, name: str = "tokenizer", bos_id: int | None = None,
                 eos_id: int | None = None, pad_id: int | None = None, source: str | None = None):
        if hf.padding is not None or hf.truncation is not None:
            hf = HFTokenizer.from_str(hf.to_str())
            hf.no_padding()
            hf.no_truncation()
        self._hf = hf
        self.name = name
        self.source = source
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._cfg = json.loads(hf.to_str())
        model = self._cfg.get("model") or {}
        unk = model.get("unk_token")
        self.unk_id = hf.token_to_id(unk) if unk is not None else model.get("unk_id")
        self.normalizes = bool(set(_normalizer_types(self._cfg.get("normalizer"))) & _TEXT_CHANGING_NORMALIZERS
                               or "Replace" in _normalizer_types(self._cfg.get("normalizer")))
        self._vocab_size = max(hf.get_vocab_size(with_added_tokens=True),
                               max([a["id"] for a in self._cfg.get("added_tokens", [])], default=-1) + 1)
        self._variants: dict[tuple[bool, bool], HFTokenizer] = {(False, True): hf}
        self._cont_cfg: dict | bool | None = None
        self._lock = threading.Lock()
        self._table: ByteTable | None = None
        self._fingerprint: str | None = None

    # -- basic properties
    @property
    def hf(self) -> HFTokenizer:
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's embedding rows)."""
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        ids = {a["id"] for a in self._cfg.get("added_tokens", []) if a.get("special")}
        ids |= {i for i in (self.bos_id, self.eos_id, self.pad_id, self.unk_id) if i is not None}
        return frozenset(ids)

    @property
    def algorithm(self) -> str:
        """``"BPE" | "Unigram" | "WordPiece" | "WordLevel"`` (the model type)."""
        model = self._cfg.get("model") or {}
        if model.get("type"):
            return model["type"]
        if "merges" in model:
            return "BPE"
        if "continuing_subword_prefix" in model and "max_input_chars_per_word" in model:
            return "WordPiece"
        if "unk_id" in model:
            return "Unigram"
        return "WordLevel"

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the serialized tokenizer and its BOS/EOS/PAD ids: equal fingerprints mean the same ids
        spell the same bytes, so token ids pass between the two unchanged (no THL)."""
        if self._fingerprint is None:
            ids = f"|{self.bos_id}|{self.eos_id}|{self.pad_id}"
            self._fingerprint = hashlib.sha256((self._hf.to_str() + ids).encode()).hexdigest()
        return self._fingerprint

    @property
    def byte_table(self) -> ByteTable:
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = build_byte_table(self._hf, self.special_ids, self._cfg)
        return self._table

    def __repr__(self) -> str:
        return (f"Tokenizer(name={self.name!r}, algorithm={self.algorithm}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")

    # -- encoding
    def _variant(self, continuation: bool, parse_special: bool) -> HFTokenizer:
        """The tokenizers.Tokenizer for these options (clones made once, on first use)."""
        if continuation and self._cont_cfg is None:
            cc = _continuation_config(self._cfg)
            self._cont_cfg = cc if cc != self._cfg else False  # False: no dummy prefix to remove
        if continuation and self._cont_cfg is False:
            continuation = False
        key = (bool(continuation), bool(parse_special))
        hf = self._variants.get(key)
        if hf is None:
            with self._lock:
                hf = self._variants.get(key)
                if hf is None:
                    cfg = self._cont_cfg if continuation else self._cfg
                    hf = HFTokenizer.from_str(json.dumps(cfg))
                    hf.encode_special_tokens = not parse_special
                    self._variants[key] = hf
        return hf

    def encode(self, text: str, *, add_special_tokens: bool = False, continuation: bool = False,
               parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; no special tokens added unless ``add_special_tokens``.

        ``continuation=True``: no dummy prefix (the ids spell exactly ``text``, for text that continues a
        prompt). ``parse_special=False``: special-token spellings inside ``text`` stay plain text.
        """
        return self._variant(continuation, parse_special).encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = False, continuation: bool = False,
                     parse_special: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, in parallel in Rust (no offsets computed)."""
        encs = self._variant(continuation, parse_special).encode_batch_fast(list(texts),
                                                                           add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    # -- decoding
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True, continuation: bool = False) -> str:
        """Text of ``ids``. ``continuation=True``: the exact bytes of the tokens (no dummy-prefix strip,
        no cleanup), invalid UTF-8 replaced by U+FFFD; special tokens then contribute nothing."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if continuation:
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Exact bytes of ``ids`` from the vocabulary table (special tokens: nothing)."""
        return self.byte_table.join(ids)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each id stands for (see :class:`ByteTable`)."""
        t = self.byte_table
        return [t.token_bytes(int(i)) for i in np.asarray(ids).reshape(-1)]

    def id_to_token(self, i: int) -> str | None:
        return self._hf.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    # -- saving
    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json`` and a ``tokenizer_config.json`` (bos/eos/pad) into directory ``path``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(path / "tokenizer.json"))
        conf = {k: (self._hf.id_to_token(v) if v is not None else None)
                for k, v in (("bos_token", self.bos_id), ("eos_token", self.eos_id), ("pad_token", self.pad_id))}
        conf["tokenizer_class"] = "PreTrainedTokenizerFast"
        (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False))
        return path


# ----------------------------------------------------------------------------------------------------------
# loading


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _token_id(hf: HFTokenizer, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return _token_id(hf, value[0]) if value else None
    if isinstance(value, str):
        return hf.token_to_id(value)
    return None


def _infer_special_ids(hf: HFTokenizer, folder: Path | None) -> tuple[int | None, int | None, int | None]:
    found: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
    if folder is not None:
        for fname in ("tokenizer_config.json", "special_tokens_map.json"):
            conf = _read_json(folder / fname)
            for k in found:
                if found[k] is None:
                    found[k] = _token_id(hf, conf.get(f"{k}_token"))
        for fname in ("generation_config.json", "config.json"):
            conf = _read_json(folder / fname)
            for k in found:
                if found[k] is None:
                    found[k] = _token_id(hf, conf.get(f"{k}_token_id"))
    for k, names in (("bos", _BOS_NAMES), ("eos", _EOS_NAMES), ("pad", _PAD_NAMES)):
        if found[k] is None:
            found[k] = next((hf.token_to_id(n) for n in names if hf.token_to_id(n) is not None), None)
    size = hf.get_vocab_size(with_added_tokens=True)
    for k, v in found.items():  # ids past the tokenizer (padded embedding rows) are not token ids
        if v is not None and not (0 <= v < max(size, v + 1)):
            found[k] = None
    return found["bos"], found["eos"], found["pad"]


_LOADED: dict[tuple, Tokenizer] = {}
_LOADED_MAX = 16


def load_tokenizer(path: str | os.PathLike, *, cache: bool = True) -> Tokenizer:
    """Load a local Hugging Face tokenizer: a directory holding ``tokenizer.json``, or the file itself.

    BOS/EOS/PAD ids come from ``tokenizer_config.json`` / ``special_tokens_map.json`` /
    ``generation_config.json`` / ``config.json`` next to it, else from usual added-token spellings.
    Raises ``FileNotFoundError`` / ``ValueError`` naming ``path`` when it is missing or not a tokenizer.
    ``cache``: return the same (read-only by convention) object for an unchanged file, so that its byte
    table and encoding variants are built once per process.
    """
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        what = "has no tokenizer.json" if p.is_dir() else "does not exist"
        raise FileNotFoundError(f"cannot load tokenizer: {p} {what} (expected a directory with tokenizer.json "
                                f"or the tokenizer.json file itself)")
    key = None
    if cache:
        st = file.stat()
        side = tuple((f, (file.parent / f).stat().st_mtime_ns) for f in _CONFIG_FILES if (file.parent / f).is_file())
        key = (str(file.resolve()), st.st_mtime_ns, st.st_size, side)
        if key in _LOADED:
            return _LOADED[key]
    tok = _load(file)
    if key is not None:
        if len(_LOADED) >= _LOADED_MAX:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = tok
    return tok


_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "config.json")


def _load(file: Path) -> Tokenizer:
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"cannot load tokenizer from {file}: not a valid Hugging Face tokenizer.json ({e})") from e
    folder = file.parent
    bos, eos, pad = _infer_special_ids(hf, folder)
    name = folder.name if file.name == "tokenizer.json" else file.stem
    return Tokenizer(hf, name=name, bos_id=bos, eos_id=eos, pad_id=pad, source=str(file))


# ----------------------------------------------------------------------------------------------------------
# training


def _default_cache_dir() -> Path:
    env = os.environ.get("MRL_JAX_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mrl_jax"
    return base / "tokenizers"


def _corpus_key(kind: str, corpus: list[str], vocab_size: int) -> str:
    h = hashlib.sha256()
    h.update(f"{_CACHE_VERSION}\0{kind}\0{vocab_size}\0{len(corpus)}\0".encode())
    for t in corpus:
        b = t.encode("utf-8", errors="surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()[:20]


def _byte_tokens() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def _with_byte_fallback_bpe(hf: HFTokenizer) -> HFTokenizer:
    """Insert ``<0x00>``..``<0xFF>`` right after the special tokens of a trained BPE; enable byte fallback."""
    cfg = json.loads(hf.to_str())
    vocab: dict[str, int] = cfg["model"]["vocab"]
    nspec = len([t for t in vocab if t in (*_TRAIN_SPECIALS, _UNK)])
    order = sorted(vocab, key=vocab.get)
    specials, rest = order[:nspec], [t for t in order[nspec:] if not _BYTE_FALLBACK.match(t)]
    new = specials + _byte_tokens() + rest
    cfg["model"]["vocab"] = {t: i for i, t in enumerate(new)}
    cfg["model"]["byte_fallback"] = True
    cfg["model"]["fuse_unk"] = True
    cfg["model"]["unk_token"] = None
    id_of = cfg["model"]["vocab"]
    for a in cfg.get("added_tokens", []):
        a["id"] = id_of[a["content"]]
    return HFTokenizer.from_str(json.dumps(cfg))


def _train_bpe(corpus, vocab_size, *, pre, decoder, byte_fallback) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre
    tok.decoder = decoder
    extra = 256 if byte_fallback else 0
    alphabet = pre_tokenizers.ByteLevel.alphabet() if not byte_fallback else []
    # byte fallback: keep at most half the room for single characters, rarer ones fall back to bytes
    room = vocab_size - 256 - len(_TRAIN_SPECIALS)
    kw = {"limit_alphabet": max(1, min(1000, room // 2))} if byte_fallback else {}
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size - extra, len(_TRAIN_SPECIALS) + 1),
                                  special_tokens=list(_TRAIN_SPECIALS), initial_alphabet=alphabet,
                                  show_progress=False, **kw)
    tok.train_from_iterator(corpus, trainer=trainer)
    return _with_byte_fallback_bpe(tok) if byte_fallback else tok


def _train(kind: str, corpus: list[str], vocab_size: int) -> HFTokenizer:
    if kind == "byte_bpe":
        return _train_bpe(corpus, vocab_size,
                          pre=pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)]),
                          decoder=decoders.ByteLevel(), byte_fallback=False)
    if kind == "metaspace_bpe":
        return _train_bpe(corpus, vocab_size,
                          pre=pre_tokenizers.Sequence([pre_tokenizers.Metaspace(prepend_scheme="first", split=True),
                                                       pre_tokenizers.Digits(individual_digits=True)]),
                          decoder=decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
                          byte_fallback=True)
    if kind == "unigram":
        tok = HFTokenizer(models.Unigram())
        # "<" and ">" are isolated so that the special pieces ("<eos>", ...) and the byte pieces ("<0x41>"), which
        # are Unigram pieces as in T5's tokenizer.json, can never be matched from the text itself
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(prepend_scheme="first", split=True),
                                                     pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.Split(Regex("[<>]"), behavior="isolated")])
        tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(),
                                         decoders.Fuse()])
        specials = [*_TRAIN_SPECIALS, _UNK]
        n_chars = len({c for t in corpus for c in t})  # the trainer keeps every character: cut afterwards
        trainer = trainers.UnigramTrainer(vocab_size=max(vocab_size - 256, n_chars + len(specials) + 8),
                                          special_tokens=specials, unk_token=_UNK, show_progress=False,
                                          max_piece_length=16)
        tok.train_from_iterator(corpus, trainer=trainer)
        cfg = json.loads(tok.to_str())
        pieces = cfg["model"]["vocab"]
        low = round(min((s for _, s in pieces), default=0.0) - 10.0, 6)
        head = [[p, 0.0] for p, _ in pieces[:len(specials)]]
        # EM sums in a thread-dependent order: round the scores and sort, so training is deterministic
        rest = [[p, round(sc, 6)] for p, sc in pieces[len(specials):] if not _BYTE_FALLBACK.match(p)]
        # the trainer gives the required single characters made-up scores min + k * 1e-4 in hash-set order:
        # give them all the minimum score
        floor = min((sc for _, sc in rest), default=0.0)
        singles = [ps for ps in rest if len(ps[0]) == 1]
        for ps in singles:
            if ps[1] <= floor + 1e-4 * len(singles) + 1e-6:
                ps[1] = floor
        rest.sort(key=lambda ps: (-ps[1], ps[0]))
        rest = rest[: max(vocab_size - len(head) - 256, 0)]  # the rarest characters fall back to bytes
        cfg["model"]["vocab"] = head + [[b, low] for b in _byte_tokens()] + rest
        cfg["model"]["unk_id"] = specials.index(_UNK)
        cfg["model"]["byte_fallback"] = True
        for a in cfg.get("added_tokens", []):
            a["id"] = specials.index(a["content"])
        return HFTokenizer.from_str(json.dumps(cfg))
    if kind == "wordpiece":
        # tokenizers' WordPieceTrainer numbers the "##" symbols in hash-map order (ties then break differently
        # from run to run); learn the pieces with the (deterministic) BPE trainer and use each piece both
        # word-initially and as a "##" continuation.
        specials = [*_TRAIN_SPECIALS, _UNK]
        bpe = HFTokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.BpeTrainer(vocab_size=max((vocab_size - len(specials)) // 2, 8), show_progress=False,
                                      limit_alphabet=1000)
        bpe.train_from_iterator(corpus, trainer=trainer)
        learned = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
        words = [p for p, _ in learned]
        vocab_list = list(dict.fromkeys(specials + words + ["##" + p for p in words]))[:vocab_size]
        tok = HFTokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(vocab_list)}, unk_token=_UNK,
                                           max_input_chars_per_word=100))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        tok.add_special_tokens(specials)
        return tok
    if kind == "char":
        counts = Counter(c for t in corpus for c in t)
        specials = list(_TRAIN_SPECIALS)
        keep = max(vocab_size - len(specials) - 256, 0)
        chars = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
                 if not _BYTE_FALLBACK.match(c)][:keep]
        vocab = {t: i for i, t in enumerate(specials + _byte_tokens() + chars)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        tok.add_special_tokens(specials)
        return tok
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {TRAINABLE_KINDS}")


def train_tokenizer(kind: str, corpus: Iterable[str], vocab_size: int, *,
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """Train a small tokenizer of family ``kind`` (see the module docstring) on ``corpus``.

    Deterministic for a given (kind, corpus, vocab_size) and cached on disk under ``cache_dir`` (default
    ``$MRL_JAX_CACHE/tokenizers`` or ``~/.cache/mrl_jax/tokenizers``): a second call loads the cached file.
    ``vocab_size`` is an upper bound that includes the special tokens and the 256 byte tokens (ByteLevel
    alphabet or byte fallback) of every kind but "wordpiece"; too small a size raises ``ValueError``.
    """
    if kind not in TRAINABLE_KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {TRAINABLE_KINDS}")
    corpus = [str(t) for t in corpus]
    if not corpus:
        raise ValueError("train_tokenizer: empty corpus")
    need = _MIN_VOCAB[kind]
    if vocab_size < need:
        raise ValueError(f"train_tokenizer: vocab_size={vocab_size} is too small for {kind!r}: it needs at least "
                         f"{need} (256 byte tokens + special tokens + a few pieces)" if need > 8 else
                         f"train_tokenizer: vocab_size={vocab_size} is too small (at least {need})")
    folder = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    key = _corpus_key(kind, corpus, vocab_size)
    file = folder / f"{kind}-{vocab_size}-{key}.json"
    hf = None
    if file.is_file():
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception:
            hf = None  # corrupt cache entry: retrain and overwrite
    if hf is None:
        hf = _train(kind, corpus, vocab_size)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(hf.to_str(), encoding="utf-8")
            os.replace(tmp, file)
        except OSError:
            pass  # read-only cache: still usable, just not cached
    ids = [hf.token_to_id(t) for t in _TRAIN_SPECIALS]
    return Tokenizer(hf, name=f"{kind}-{vocab_size}", pad_id=ids[0], bos_id=ids[1], eos_id=ids[2],
                     source=str(file))
