"""``train_tokenizer``: one small tokenizer per algorithm family, trained deterministically and cached."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from mrl_jax.tokenization._bytes import _BYTE_FALLBACK
from mrl_jax.tokenization._tokenizer import Tokenizer

TRAINABLE_KINDS = ("byte_bpe", "metaspace_bpe", "unigram", "wordpiece", "char")
_MIN_VOCAB = {"byte_bpe": 260, "metaspace_bpe": 261, "unigram": 264, "wordpiece": 8, "char": 260}
_TRAIN_SPECIALS = ("<pad>", "<bos>", "<eos>")
_UNK = "<unk>"
_CACHE_VERSION = "mrl-tok-v6"


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
