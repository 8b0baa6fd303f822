"""THL between real Hugging Face tokenizers (../shared/tokenizers): the cases that trip an aligner."""

from __future__ import annotations

import importlib.util
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrl_jax import thl
from mrl_jax.tokenization import bytes_to_unicode, load_tokenizer


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_thl_checks_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_checks = _sibling("test_thl")
check_alignment, TEXTS = _checks.check_alignment, _checks.TEXTS

NAMES = ("gpt2", "gpt-neox-20b", "mistral-7b-v0.1", "phi-3-mini", "smollm2-135m", "t5-small", "bert-base-uncased")
ROUNDTRIP = ("gpt2", "mistral-7b-v0.1", "phi-3-mini", "smollm2-135m", "gpt-neox-20b")


def expect_roundtrip(tok, text: str) -> bool:
    """Whether ``tok`` spells ``text`` exactly: byte fallback always; NeoX needs NFC text; a ByteLevel vocabulary
    must hold every byte of the text (SmolLM2's lacks 0x04 0x06 0x13 0x14 0x16 0x1D and the lead bytes F1 F2:
    those characters are silently dropped by the tokenizer)."""
    if tok.name not in ROUNDTRIP or (tok.normalizes and not unicodedata.is_normalized("NFC", text)):
        return False
    if any(a in text for a in _stripping_added(tok)):  # phi-3's "</s>" (rstrip) eats the spaces after it
        return False
    if tok.byte_table.prefix_space:  # Metaspace with byte fallback: a literal "▁" in the text reads as a space
        return "\u2581" not in text
    if tok.name not in _MISSING:
        vocab = tok.hf.get_vocab()
        _MISSING[tok.name] = {b for b, c in bytes_to_unicode().items() if c not in vocab}
    return not (_MISSING[tok.name] & set(text.encode()))


_MISSING: dict[str, set] = {}


def _stripping_added(tok) -> list[str]:
    if tok.name not in _STRIPPING:
        import json
        _STRIPPING[tok.name] = [a["content"] for a in json.loads(tok.hf.to_str())["added_tokens"]
                                if not a["special"] and (a.get("lstrip") or a.get("rstrip"))]
    return _STRIPPING[tok.name]


_STRIPPING: dict[str, list] = {}


@pytest.fixture(scope="module")
def tk(shared_tokenizers_dir):
    found = {n: load_tokenizer(shared_tokenizers_dir / n) for n in NAMES
             if (shared_tokenizers_dir / n / "tokenizer.json").is_file()}
    missing = set(NAMES) - set(found)
    if missing:
        pytest.skip(f"missing real tokenizers: {sorted(missing)}")
    return found


def toks(tok, ids):
    return [tok.id_to_token(int(i)) for i in ids]


def chunks_text(a, text):
    tb = text.encode()
    return [tb[s: s + n] for s, n in zip(a.chunk_start, a.chunk_bytes)]


def test_cjk_byte_pieces_vs_whole_characters(tk):
    g, m = tk["gpt2"], tk["mistral-7b-v0.1"]
    text = "日本語のテキスト"
    a = thl.align(text, g, m)
    check_alignment(a, text, g, m)
    assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all()
    # GPT-2 splits characters into byte pieces: no chunk boundary falls inside a character, and a chunk holds
    # whole characters (one or more)
    assert len(a.src_ids) > len(text) and all(c.decode("utf-8") for c in chunks_text(a, text))
    assert "".join(c.decode() for c in chunks_text(a, text)) == text
    # SmolLM merges differently inside the same characters
    s = tk["smollm2-135m"]
    a2 = thl.align("Hello world 🙂 日本語", g, s)
    assert a2.num_chunks == 9 and a2.src_chunk.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8]
    assert a2.dst_chunk.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 8]
    # chunks are byte spans: both split 語 after its second byte, so a chunk boundary falls inside it
    assert chunks_text(a2, "Hello world 🙂 日本語")[6:] == ["本".encode(), "語".encode()[:2], "語".encode()[2:]]


def test_emoji_skin_tone_and_zwj(tk):
    text = "ok 👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇯🇵!"
    for s_name, d_name in (("gpt2", "phi-3-mini"), ("phi-3-mini", "mistral-7b-v0.1"), ("smollm2-135m", "gpt2"),
                           ("mistral-7b-v0.1", "gpt-neox-20b")):
        s, d = tk[s_name], tk[d_name]
        a = thl.align(text, s, d)
        check_alignment(a, text, s, d)
        assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all(), (s_name, d_name)
    # phi-3 spells the emoji with byte-fallback tokens, mistral has whole-emoji pieces
    p = tk["phi-3-mini"]
    assert "<0xF0>" in toks(p, p.encode("👍🏽", continuation=True))


def test_metaspace_dummy_prefix_and_lone_underscore(tk):
    m, g = tk["mistral-7b-v0.1"], tk["gpt2"]
    text = "123 abc"
    ids = m.encode(text)  # standalone encoding: dummy prefix
    assert toks(m, ids)[:2] == ["▁", "1"]
    a = thl.align(text, m, g, src_ids=ids)
    check_alignment(a, text, m, g)
    assert a.residual["src_dummy_prefix"] and a.src_roundtrip and a.chunk_valid.all()
    assert a.src_chunk[0] == a.src_chunk[1] == 0  # the zero-byte "▁" joins the first chunk
    # continuation encoding (the default for the consumer): no dummy prefix at all
    a = thl.align(text, g, m)
    assert toks(m, a.dst_ids)[0] == "1" and not a.residual["dst_dummy_prefix"]
    # a lone "▁" that is a real space ("world 🙂": "▁" then "🙂")
    text = "Hello world 🙂"
    a = thl.align(text, m, g, src_ids=m.encode(text))
    check_alignment(a, text, m, g)
    assert "▁" in toks(m, a.src_ids) and a.chunk_valid.all()
    lone = toks(m, a.src_ids).index("▁")
    k = a.src_chunk[lone]
    assert chunks_text(a, text)[k] == " 🙂".encode()  # gpt2 has "Ġ" + emoji as one token
    # the source text as the Metaspace decoder gives it (leading space dropped) still aligns
    ids = m.encode(" leading", continuation=True)
    assert toks(m, ids)[0] == "▁leading"
    a = thl.align(m.decode(ids), m, g, src_ids=ids)
    assert a.src_roundtrip and a.residual["src_dummy_prefix"]
    a = thl.align(m.decode(ids, continuation=True), m, g, src_ids=ids)
    assert a.src_roundtrip and not a.residual["src_dummy_prefix"]


def test_whitespace_runs_tabs_crlf_and_code(tk):
    text = "def f(x):\r\n\tif x:\n        return  x   +  1\n\n\n    # done  \t \n"
    pairs = [("gpt2", "gpt-neox-20b"), ("gpt-neox-20b", "mistral-7b-v0.1"), ("smollm2-135m", "phi-3-mini"),
             ("mistral-7b-v0.1", "smollm2-135m")]
    for s_name, d_name in pairs:
        s, d = tk[s_name], tk[d_name]
        a = thl.align(text, s, d)
        check_alignment(a, text, s, d)
        assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all(), (s_name, d_name)
    neox = tk["gpt-neox-20b"]
    assert any(i >= 50254 for i in neox.encode(text))  # its added "runs of spaces" tokens are text


def test_digit_runs(tk):
    s, g = tk["smollm2-135m"], tk["gpt2"]
    text = "x = 1234567890 + 42"
    a = thl.align(text, s, g)
    check_alignment(a, text, s, g)
    digits = [t for t in toks(s, a.src_ids) if t.isdigit()]
    assert len(digits) == 12  # SmolLM: one token per digit
    gd = [t for t in toks(g, a.dst_ids) if t.strip("Ġ").isdigit()]
    assert len(gd) < 12  # GPT-2 groups digits
    # where GPT-2 groups digits, one chunk holds several SmolLM digits and one GPT-2 token
    assert a.residual["src_tokens_per_chunk"] > 1.0 and a.chunk_valid.all()
    many = [c for c in range(a.num_chunks) if (a.src_chunk == c).sum() > 1]
    assert many and all((a.dst_chunk == c).sum() == 1 for c in many)


def test_bos_on_one_side_eos_on_both(tk):
    m, g = tk["mistral-7b-v0.1"], tk["gpt2"]
    text = "Hi there"
    src_ids = [m.bos_id] + m.encode(text, continuation=True) + [m.eos_id]
    a = thl.align(text, m, g, src_ids=src_ids)  # BOS and EOS on the source only
    check_alignment(a, text, m, g)
    assert a.src_chunk[0] == a.src_chunk[1] == 0 and a.src_chunk[-1] == a.src_chunk[-2]
    assert a.residual["src_special"] == 2 and a.residual["dst_special"] == 0 and a.chunk_valid.all()
    # EOS on both sides: a chunk of its own, 1:1
    a = thl.align(text, m, g, src_ids=src_ids, dst_ids=g.encode(text) + [g.eos_id])
    check_alignment(a, text, m, g)
    assert a.src_chunk[-1] == a.dst_chunk[-1] == a.num_chunks - 1 and a.chunk_one_to_one[-1]
    assert a.chunk_bytes[-1] == 0
    # BOS on both sides too: a leading chunk of its own
    a = thl.align(text, m, tk["gpt-neox-20b"], src_ids=src_ids,
                  dst_ids=[0] + tk["gpt-neox-20b"].encode(text) + [0])
    assert a.src_chunk[0] == 0 and a.src_chunk[1] == 1 and a.dst_chunk[:2].tolist() == [0, 1]


def test_generation_cut_mid_character(tk):
    g, m = tk["gpt2"], tk["mistral-7b-v0.1"]
    full = g.encode("ok 日本")
    ids = full[:-1]  # the last character is split over two byte tokens: the generation stops inside it
    assert g.decode_bytes(ids)[-1:] >= b"\x80"
    for text in (g.decode(ids), g.decode(ids).rstrip("\ufffd")):  # U+FFFD, or the partial character dropped
        a = thl.align(text, g, m, src_ids=ids)
        check_alignment(a, text, g, m)
        assert a.residual["cut_mid_char"] and not a.src_roundtrip
        assert not a.chunk_valid[-1] and a.chunk_valid[:-1].all()
    ba = thl.align_batch([g.decode(ids), "fine"], g, m, [ids, g.encode("fine")])
    assert ba.metrics["cut_mid_char_texts"] == 1 and ba.residual["cut_mid_char"].tolist() == [True, False]


def test_empty_and_eos_only_completions(tk):
    g, m = tk["gpt2"], tk["mistral-7b-v0.1"]
    a = thl.align("", g, m)
    assert a.num_chunks == 0 and a.src_ids.size == a.dst_ids.size == 0 and a.chunk_valid.size == 0
    a = thl.align("", g, m, src_ids=[g.eos_id])
    assert a.num_chunks == 1 and a.src_chunk.tolist() == [0] and a.dst_ids.size == 0
    a = thl.align("", g, m, src_ids=[g.eos_id], dst_ids=[m.eos_id])
    assert a.num_chunks == 1 and a.dst_chunk.tolist() == [0] and a.chunk_one_to_one.all()
    ba = thl.align_batch(["", "", "a b"], g, m, [[], [g.eos_id], g.encode("a b") + [g.eos_id]])
    assert ba.num_chunks.tolist() == [0, 1, 2] and (ba.src_chunk[0] == -1).all()
    assert ba.src_chunk[1, 0] == 0 and ba.src_chunk[2, :3].tolist() == [0, 1, 1]  # EOS joins the last chunk
    for i, t in enumerate(["", "", "a b"]):
        check_alignment(ba.row(i), t, g, m)


def test_normalizing_tokenizers_are_flagged(tk):
    g, bert, t5, neox = tk["gpt2"], tk["bert-base-uncased"], tk["t5-small"], tk["gpt-neox-20b"]
    text = "Hello World, naïve café 🙂 done"
    a = thl.align(text, g, bert)
    check_alignment(a, text, g, bert)
    assert a.residual["normalized"] and not a.dst_roundtrip and not a.chunk_valid.all()
    valid = [c for c, v in zip(chunks_text(a, text), a.chunk_valid) if v]
    assert b"done" in b"".join(valid) and not any(b"H" in c or "ï".encode() in c for c in valid)
    assert a.residual["dst_unknown"] == 1  # the emoji is [UNK]
    a = thl.align(text, bert, g)  # a normalizing *source* is flagged the same way
    assert a.residual["normalized"] and not a.src_roundtrip
    a = thl.align("Hello   world\t🙂 日本", g, t5)  # whitespace collapsed, <unk>
    check_alignment(a, "Hello   world\t🙂 日本", g, t5)
    assert a.residual["normalized"] and a.residual["dst_unknown"] >= 1 and a.chunk_valid[0]
    nfd = unicodedata.normalize("NFD", "café")
    a = thl.align(nfd, g, neox)
    assert a.residual["normalized"] and not a.dst_roundtrip and not a.chunk_valid[-1]
    a = thl.align(unicodedata.normalize("NFC", "café"), g, neox)
    assert not a.residual["normalized"] and a.dst_roundtrip and a.chunk_valid.all()
    ba = thl.align_batch([text, "plain"], g, bert)
    assert ba.metrics["normalized_texts"] == 2 or ba.metrics["normalized_texts"] == 1
    assert ba.metrics["frac_bytes_invalid"] > 0


def test_non_canonical_source_spelling(tk):
    g, m = tk["gpt2"], tk["mistral-7b-v0.1"]
    text = "Hello world"
    ids = [g.token_to_id(t) for t in ("H", "ell", "o", "Ġw", "or", "ld")]
    assert None not in ids and ids != g.encode(text)
    a = thl.align(text, g, m, src_ids=ids)
    check_alignment(a, text, g, m)
    assert a.src_roundtrip and a.chunk_valid.all()
    assert a.src_chunk.tolist() == [0, 0, 0, 1, 1, 1] and a.dst_chunk.tolist() == [0, 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, pair=st.sampled_from([(s, d) for s in NAMES for d in NAMES if s != d]))
def test_real_invariants(tk, text, pair):
    s, d = tk[pair[0]], tk[pair[1]]
    a = thl.align(text, s, d)
    check_alignment(a, text, s, d)
    es, ed = expect_roundtrip(s, text), expect_roundtrip(d, text)
    assert a.src_roundtrip or not es
    assert a.dst_roundtrip or not ed
    if es and ed:
        assert a.chunk_valid.all()
    elif not (a.src_roundtrip and a.dst_roundtrip) and text and not (s.byte_table.space_optional or
                                                                     d.byte_table.space_optional):
        assert not a.chunk_valid.all() or a.num_chunks == 0  # a changed text is never entirely valid


def test_added_token_eating_spaces_is_flagged(tk):
    g, p = tk["gpt2"], tk["phi-3-mini"]
    text = "a</s>  b"
    a = thl.align(text, g, p)
    assert toks(p, a.dst_ids) == ["a", "</s>", "b"] and not a.dst_roundtrip and not a.chunk_valid.all()
    check_alignment(a, text, g, p)


def test_smollm2_missing_bytes_are_flagged(tk):
    g, s = tk["gpt2"], tk["smollm2-135m"]
    text = "a\x16b"
    a = thl.align(text, g, s)
    assert toks(s, a.dst_ids) == ["a", "b"] and not a.dst_roundtrip and not a.chunk_valid.all()
    check_alignment(a, text, g, s)


def test_batch_of_mixed_rows_matches_single(tk):
    g, m = tk["smollm2-135m"], tk["phi-3-mini"]
    texts = ["plain text", "", "日本語 🙂", "x" * 300, "\t\r\n  ", "<|endoftext|> literal"]
    lists = [g.encode(t, continuation=True, parse_special=False) + [g.eos_id] for t in texts]
    ba = thl.align_batch(texts, g, m, lists)
    for i, t in enumerate(texts):
        a = thl.align(t, g, m, src_ids=lists[i])
        r = ba.row(i)
        assert np.array_equal(a.src_chunk, r.src_chunk) and np.array_equal(a.dst_chunk, r.dst_chunk)
        assert np.array_equal(a.chunk_valid, r.chunk_valid) and a.residual == r.residual
        check_alignment(r, t, g, m)
    assert ba.metrics["src_special_tokens"] == len(texts) and ba.metrics["dst_non_roundtrip_texts"] == 0
