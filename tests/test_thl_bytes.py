"""THL: a chunk marked valid covers the same bytes on both sides (issue 12, item 12).

Vocabularies whose ``<0xNN>`` byte-fallback pieces are *added* tokens (special or not) must align exactly; random
Unicode with multi-code-point emoji, ZWJ sequences and combining marks; the per-chunk byte check
(``residual["byte_mismatch_chunks"]``) that flags a chunk whose two sides' bytes differ.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from mrl_jax import thl
from mrl_jax.thl import _chunks
from mrl_jax.tokenization import Tokenizer, load_tokenizer, train_tokenizer


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_thl_bytes_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_checks = _sibling("test_thl")
check_alignment, corpus, KINDS = _checks.check_alignment, _checks.corpus, _checks.KINDS

BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
EMOJI = ["👍🏽", "👨\u200d👩\u200d👧", "👩🏽\u200d💻", "🏳️\u200d🌈", "🇫🇷", "🇯🇵", "❤️", "1️⃣", "🙂", "\u200d", "\ufe0f",
         "e\u0301", "a\u0308\u0301", "n\u0303", "\u0915\u094d\u0937", "ﬁ", "日本語", "مرحبا", " ", "  ", "\n", "\t",
         "x", "Hello", " world", "0xF0", "<0x41>", "<", ">", "12"]
_chars = st.characters(codec="utf-8", exclude_categories=("Cs",))
UNICODE = st.lists(st.one_of(st.sampled_from(EMOJI), st.text(_chars, max_size=4)), max_size=10).map("".join)


def with_added_byte_tokens(tok: Tokenizer, special: bool) -> Tokenizer:
    """``tok`` with its ``<0x00>`` .. ``<0xFF>`` vocabulary pieces also listed as added tokens (same ids)."""
    cfg = json.loads(tok.hf.to_str())
    vocab = cfg["model"]["vocab"]
    cfg["added_tokens"] += [{"id": vocab[p], "content": p, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": special} for p in BYTE_PIECES]
    return Tokenizer(HFTokenizer.from_str(json.dumps(cfg)), name=f"{tok.name}+added-bytes-{special}",
                     bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """The five trained kinds, plus metaspace_bpe with its byte pieces as special / non-special added tokens
    (``ref``: for each name, the tokenizer whose ordinary vocabulary gives the true bytes of the same ids)."""
    d = tmp_path_factory.mktemp("tok_cache")
    c = corpus()
    out = {k: train_tokenizer(k, c, 700, cache_dir=d) for k in KINDS}
    out["added_special"] = with_added_byte_tokens(out["metaspace_bpe"], special=True)
    out["added_plain"] = with_added_byte_tokens(out["metaspace_bpe"], special=False)
    ref = {k: out[k] for k in KINDS} | {"added_special": out["metaspace_bpe"], "added_plain": out["metaspace_bpe"]}
    return out, ref


def side_bytes(ref: Tokenizer, ids, stripped: bool) -> list[bytes]:
    """True bytes of ``ids`` (from ``ref``'s vocabulary), the dummy prefix stripped when ``stripped``."""
    pieces = ref.token_bytes(ids)
    if stripped:
        i = next(i for i, p in enumerate(pieces) if p)
        pieces[i] = pieces[i][1:]
    return pieces


def assert_valid_chunks_agree(a: thl.Alignment, text: str, src_ref: Tokenizer, dst_ref: Tokenizer) -> None:
    """Every valid chunk: the same true bytes on both sides, those of the text (WordPiece: up to spaces)."""
    tb = text.encode("utf-8")
    sb = side_bytes(src_ref, a.src_ids, a.residual["src_dummy_prefix"])
    db = side_bytes(dst_ref, a.dst_ids, a.residual["dst_dummy_prefix"])
    loose = src_ref.byte_table.space_optional or dst_ref.byte_table.space_optional
    for c in np.nonzero(a.chunk_valid)[0]:
        want = tb[a.chunk_start[c]: a.chunk_start[c] + a.chunk_bytes[c]]
        got_s = b"".join(p for p, k in zip(sb, a.src_chunk) if k == c)
        got_d = b"".join(p for p, k in zip(db, a.dst_chunk) if k == c)
        if loose:
            got_s, got_d, want = (x.replace(b" ", b"") for x in (got_s, got_d, want))
        assert got_s == got_d == want, (c, got_s, got_d, want)
    for tok, ids, ch in ((src_ref, a.src_ids, a.src_chunk), (dst_ref, a.dst_ids, a.dst_chunk)):
        assert not a.chunk_valid[ch[tok.byte_table.unknown[ids]]].any()  # an unknown token's bytes are unknown


@pytest.mark.parametrize("special", [True, False])
def test_added_byte_tokens_stand_for_their_byte(toks, special):
    out, _ = toks
    base, tok = out["metaspace_bpe"], out["added_special" if special else "added_plain"]
    ids = [tok.token_to_id(p) for p in BYTE_PIECES]
    assert tok.token_bytes(ids) == [bytes([b]) for b in range(256)]
    assert not tok.byte_table.special[ids].any()
    for name in ("lengths", "offsets", "data", "hashes", "special", "unknown"):  # the same table as the base's
        assert np.array_equal(getattr(tok.byte_table, name), getattr(base.byte_table, name)), name


PAIRS = ([(v, k) for v in ("added_special", "added_plain") for k in (*KINDS, "added_special", "added_plain")]
         + [(k, v) for v in ("added_special", "added_plain") for k in KINDS])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=UNICODE, pair=st.sampled_from(PAIRS), continuation=st.booleans())
def test_valid_chunks_cover_the_same_bytes(toks, text, pair, continuation):
    out, ref = toks
    s, d = out[pair[0]], out[pair[1]]
    a = thl.align(text, s, d, continuation=continuation)
    check_alignment(a, text, s, d)
    assert_valid_chunks_agree(a, text, ref[pair[0]], ref[pair[1]])
    for name, ids, ok, stripped in ((pair[0], a.src_ids, a.src_roundtrip, a.residual["src_dummy_prefix"]),
                                    (pair[1], a.dst_ids, a.dst_roundtrip, a.residual["dst_dummy_prefix"])):
        assert ok == (b"".join(side_bytes(ref[name], ids, stripped)) == text.encode("utf-8"))  # exact tables


# texts on which main before the fix returned a valid chunk whose two sides' bytes differ (src, dst, text)
REGRESSIONS = [
    # the flag's eight <0xNN> tokens were zero-byte specials: the row failed the text check and the slow path put
    # seven of them into the chunk "x" (source bytes b"\x9f\x87\xab\xf0\x9f\x87\xb7x" against b"x")
    ("added_special", "byte_bpe", "🇫🇷x"),
    ("char", "added_special", "👨\u200d👩\u200d👧 x"),
    # a non-special added "<0x41>" matches the literal text and stands for b"A": with its literal spelling as
    # bytes the row seemed to round-trip and "<0x41>" was aligned 1:1 with the source's "<0x41>"
    ("byte_bpe", "added_plain", "say <0x41>"),
]


@pytest.mark.parametrize("src,dst,text", REGRESSIONS)
def test_regression_added_byte_tokens(toks, src, dst, text):
    out, ref = toks
    a = thl.align(text, out[src], out[dst])
    assert_valid_chunks_agree(a, text, ref[src], ref[dst])
    if "<0x41>" in text:
        assert not a.dst_roundtrip and not a.chunk_valid[-1]  # the consumer reads "A": flagged, not aligned
    else:
        assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all()


def test_unknown_token_stays_with_the_text_it_stands_for(shared_tokenizers_dir):
    """Slow path: an unknown token after a lone dummy prefix used to jump over the bytes it stands for into the
    next (valid) chunk."""
    m = load_tokenizer(shared_tokenizers_dir / "mistral-7b-v0.1")
    t5 = load_tokenizer(shared_tokenizers_dir / "t5-small")
    text = "õI½\x18"
    a = thl.align(text, m, t5, continuation=False)
    assert [t5.id_to_token(i) for i in a.dst_ids] == ["▁", "<unk>", "I", "1", "<unk>", "2"]
    assert a.dst_chunk.tolist()[:3] == [0, 0, 1] and a.chunk_valid.tolist() == [False, True, False]
    assert_valid_chunks_agree(a, text, m, t5)


def test_byte_check_flags_a_chunk_whose_sides_differ(toks, monkeypatch):
    """The per-chunk byte check is a safety net of its own: with the text check switched off, a chunk whose
    two sides spell different bytes ("▁" read as a space) is still flagged and counted."""
    out, _ = toks
    s, d = out["byte_bpe"], out["metaspace_bpe"]
    text = "a\u2581b"
    a = thl.align(text, s, d)
    assert not a.chunk_valid.all() and a.residual["byte_mismatch_chunks"] == 0  # the text check caught it
    monkeypatch.setattr(_chunks, "_text_valid", lambda bad, extra, cs, ce, lay, n: np.ones(lay.K, dtype=bool))
    ba = thl.align_batch([text, "a b"], s, d)
    a = ba.row(0)
    assert a.residual["byte_mismatch_chunks"] >= 1 and not a.chunk_valid.all()
    assert ba.metrics["byte_mismatch_chunks"] == a.residual["byte_mismatch_chunks"]
    assert ba.row(1).chunk_valid.all() and ba.row(1).residual["byte_mismatch_chunks"] == 0
    check_alignment(a, text, s, d)


def test_byte_check_flags_chunks_with_unknown_tokens(toks):
    """WordPiece [UNK]s that the slow path placed in a chunk spelling " world" on both sides: flagged."""
    out, _ = toks
    s, d = out["char"], out["wordpiece"]
    text = "Hello world日本語 world worldMé-\x03¨ world worldÿ"
    a = thl.align(text, s, d)
    assert a.residual["byte_mismatch_chunks"] == 1
    assert_valid_chunks_agree(a, text, s, d)
    check_alignment(a, text, s, d)


def test_real_sentencepiece_with_added_byte_tokens(shared_tokenizers_dir):
    """Mistral's tokenizer.json with its 256 byte pieces also listed as added tokens: exact alignment."""
    m = load_tokenizer(shared_tokenizers_dir / "mistral-7b-v0.1")
    g = load_tokenizer(shared_tokenizers_dir / "gpt2")
    for special in (True, False):
        mv = with_added_byte_tokens(m, special)
        assert np.array_equal(mv.byte_table.data, m.byte_table.data)
        for text in ["👨\u200d👩\u200d👧 and 🇫🇷 🏳️\u200d🌈", "e\u0301\u0301 👩🏽\u200d💻 x", "1️⃣ ❤️ \u0915\u094d\u0937"]:
            for s, d, rs, rd in ((mv, g, m, g), (g, mv, g, m)):
                a = thl.align(text, s, d)
                assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all()
                assert_valid_chunks_agree(a, text, rs, rd)
