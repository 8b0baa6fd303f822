"""The ``Tokenizer`` class (its conventions: :mod:`mrl_jax.tokenization`) and ``load_tokenizer``."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from mrl_jax.tokenization._bytes import ByteTable, build_byte_table

_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|padding|>", "<|pad|>", "<|finetune_right_pad_id|>")
# Normalizers that change the text itself (Prepend / Replace(" " -> "▁") are the Metaspace convention only).
_TEXT_CHANGING_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt", "Precompiled",
                              "Strip", "StripAccents", "ByteLevel"}


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
