"""THL: alignment invariants (hypothesis, trained tokenizers of five algorithms) and the device functions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrl_jax import thl
from mrl_jax.tokenization import bytes_to_unicode, train_tokenizer

KINDS = ("byte_bpe", "metaspace_bpe", "unigram", "wordpiece", "char")
ROUNDTRIP_KINDS = ("byte_bpe", "metaspace_bpe", "unigram", "char")  # WordPiece drops whitespace

FRAGMENTS = [
    "日本語", "中文测试", "한국어", "🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "e\u0301", "n\u0303", "a\u0308\u0301",
    "مرحبا", "שלום", "\u200f", "  ", "   ", "\t", "\t\t", "\n", "\r\n", "\n\n", "    def f(x):\n        return x",
    "12345", "007", "3.14", " ", "Hello", " world", "x", "<eos>", "<s>", "</s>", "<|endoftext|>", "ﬁ", "①",
    "\u00a0", "\u3000", "don't", "a.b", "(1, 2)", "café", "ÿ", "\x00", "\u2581",
]
_chars = st.characters(codec="utf-8", exclude_categories=("Cs",))
TEXTS = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(_chars, max_size=6)), max_size=10).map("".join)


def corpus() -> list[str]:
    rng = np.random.default_rng(0)
    words = ("the quick brown fox jumps over the lazy dog def return import numpy as np for in range print "
             "hello world Hello World café naïve 日本語 中文 测试 Привет мир مرحبا שלום 🙂 👍🏽").split()
    out = []
    for i in range(1500):
        s = " ".join(rng.choice(words, size=rng.integers(3, 15)))
        if i % 3 == 0:
            s += f" {rng.integers(0, 10**6)} + {rng.integers(0, 999)} = {rng.integers(0, 10**6)}"
        if i % 5 == 0:
            s = "    " + s.replace(" ", "\n\t", 1)
        out.append(s)
    return out


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok_cache")
    c = corpus()
    return {k: train_tokenizer(k, c, 700, cache_dir=d) for k in KINDS}


# ------------------------------------------------------------------------------------------------------------
# an independent reference: chunk bytes from the vocabulary table, boundaries by set intersection


def side_bytes(tok, ids, stripped: bool) -> list[bytes]:
    pieces = tok.token_bytes(ids)
    if stripped:
        i = next(i for i, p in enumerate(pieces) if p)
        assert pieces[i][:1] == b" "
        pieces[i] = pieces[i][1:]
    return pieces


def check_alignment(a: thl.Alignment, text: str, src, dst) -> None:
    """Invariants every alignment must satisfy (raises AssertionError)."""
    tb = text.encode("utf-8")
    C = a.num_chunks
    assert a.src_chunk.shape == a.src_ids.shape and a.dst_chunk.shape == a.dst_ids.shape
    assert a.src_chunk.dtype == np.int32 and a.dst_chunk.dtype == np.int32
    assert a.chunk_valid.shape == a.chunk_one_to_one.shape == a.chunk_bytes.shape == (C,)
    if a.src_ids.size == 0 and a.dst_ids.size == 0:
        assert C == 0
        return
    for ch in (a.src_chunk, a.dst_chunk):  # contiguous, non-decreasing, from 0, within range
        if ch.size:
            assert ch[0] == 0 and ch[-1] == C - 1
            assert set(np.diff(ch).tolist()) <= {0, 1}
    if tb and a.src_ids.size and a.dst_ids.size:  # every chunk holds tokens on both sides
        assert set(a.src_chunk.tolist()) == set(a.dst_chunk.tolist()) == set(range(C))
    # chunks tile the text
    assert a.chunk_bytes.sum() == len(tb)
    if C:
        assert a.chunk_start[0] == 0
        assert np.array_equal(a.chunk_start[1:], (a.chunk_start + a.chunk_bytes)[:-1])
    assert a.chunk_one_to_one.tolist() == [
        int((a.src_chunk == c).sum()) == 1 and int((a.dst_chunk == c).sum()) == 1 for c in range(C)]
    sb = side_bytes(src, a.src_ids, a.residual["src_dummy_prefix"])
    db = side_bytes(dst, a.dst_ids, a.residual["dst_dummy_prefix"])
    assert a.src_roundtrip == (b"".join(sb) == tb)
    assert a.dst_roundtrip == (b"".join(db) == tb)
    def same(got: bytes, want: bytes, tok) -> bool:
        # WordPiece: the space a decoder puts before a piece is a convention, absent before "=" or CJK
        return got == want or (tok.byte_table.space_optional and len(got) >= len(want)
                               and got.replace(b" ", b"") == want.replace(b" ", b""))

    for c in range(C):  # each valid chunk: the same bytes on both sides, those of the text
        if a.chunk_valid[c]:
            want = tb[a.chunk_start[c]: a.chunk_start[c] + a.chunk_bytes[c]]
            assert same(b"".join(p for p, k in zip(sb, a.src_chunk) if k == c), want, src), c
            assert same(b"".join(p for p, k in zip(db, a.dst_chunk) if k == c), want, dst), c
    if a.src_roundtrip and a.dst_roundtrip:
        assert a.chunk_valid.all()
        # maximal: chunk starts are exactly the common token boundaries
        bs = set(np.cumsum([len(p) for p in sb]).tolist()) | {0}
        bd = set(np.cumsum([len(p) for p in db]).tolist()) | {0}
        common = sorted((bs & bd) - {len(tb)})
        starts = sorted(set(a.chunk_start[a.chunk_bytes > 0].tolist()))
        assert starts == common


PAIRS = [(s, d) for s in KINDS for d in KINDS if s != d]


def roundtrips(kind: str, text: str) -> bool:
    """Whether a trained kind spells ``text`` exactly: WordPiece never (whitespace); SentencePiece-style
    (Metaspace) tokenizers read a literal "▁" in the text as a space."""
    if kind in ("metaspace_bpe", "unigram") and "\u2581" in text:
        return False
    return kind in ROUNDTRIP_KINDS


def test_literal_metaspace_character_is_flagged(trained):
    src, dst = trained["byte_bpe"], trained["metaspace_bpe"]
    a = thl.align("a\u2581b", src, dst)
    assert dst.decode_bytes(a.dst_ids) == b"a b" and not a.dst_roundtrip and not a.chunk_valid.all()
    check_alignment(a, "a\u2581b", src, dst)


def test_special_spelling_in_text_stays_text(trained):
    for kind in ROUNDTRIP_KINDS:
        src, dst = trained["wordpiece"], trained[kind]
        a = thl.align("say <eos> <unk> <0x41> now", src, dst)
        assert a.dst_roundtrip and a.residual["dst_special"] == 0, kind
        check_alignment(a, "say <eos> <unk> <0x41> now", src, dst)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, pair=st.sampled_from(PAIRS))
def test_align_invariants(trained, text, pair):
    src, dst = trained[pair[0]], trained[pair[1]]
    a = thl.align(text, src, dst)
    check_alignment(a, text, src, dst)
    if roundtrips(pair[0], text):
        assert a.src_roundtrip
    if roundtrips(pair[1], text):  # dst ids spell the text exactly (continuation: no dummy prefix)
        assert a.dst_roundtrip
        assert dst.decode(a.dst_ids, continuation=True) == text
        assert dst.decode_bytes(a.dst_ids) == text.encode("utf-8")
    if roundtrips(pair[0], text) and roundtrips(pair[1], text):
        assert a.chunk_valid.all()
        assert a.residual["frac_bytes_one_to_one"] == pytest.approx(
            a.chunk_bytes[a.chunk_one_to_one].sum() / max(len(text.encode()), 1) if text else 1.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, pair=st.sampled_from([p for p in PAIRS if p[0] in ROUNDTRIP_KINDS and p[1] in ROUNDTRIP_KINDS]))
def test_standalone_encoding_with_dummy_prefix(trained, text, pair):
    """continuation=False: the SentencePiece dummy prefix is stripped, never mis-aligned."""
    src, dst = trained[pair[0]], trained[pair[1]]
    a = thl.align(text, src, dst, continuation=False)
    check_alignment(a, text, src, dst)
    if roundtrips(pair[0], text) and roundtrips(pair[1], text):
        assert a.src_roundtrip and a.dst_roundtrip and a.chunk_valid.all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(TEXTS, min_size=1, max_size=6), pair=st.sampled_from(PAIRS), eos=st.booleans(),
       data=st.data())
def test_batch_matches_single_and_preserves_sums(trained, texts, pair, eos, data):
    src, dst = trained[pair[0]], trained[pair[1]]
    src_lists = [src.encode(t, continuation=True, parse_special=False) + ([src.eos_id] if eos else [])
                 for t in texts]
    ba = thl.align_batch(texts, src, dst, src_lists)
    B = len(texts)
    assert ba.src_chunk.shape == ba.src_ids.shape == ba.src_mask.shape and ba.src_chunk.shape[0] == B
    assert ba.chunk_valid.shape == (B, ba.max_chunks) and ba.num_chunks.shape == (B,)
    assert (ba.src_chunk[~ba.src_mask] == -1).all() and (ba.dst_chunk[~ba.dst_mask] == -1).all()
    rng = np.random.default_rng(0)
    for i, t in enumerate(texts):
        a = thl.align(t, src, dst, src_ids=src_lists[i])
        r = ba.row(i)
        for f in ("src_ids", "dst_ids", "src_chunk", "dst_chunk", "chunk_valid", "chunk_one_to_one", "chunk_start",
                  "chunk_bytes"):
            assert np.array_equal(getattr(a, f), getattr(r, f)), f
        assert a.num_chunks == r.num_chunks
        check_alignment(r, t, src, dst)
        # a per-token quantity summed per chunk keeps its total, on both sides
        for ch in (r.src_chunk, r.dst_chunk):
            v = rng.normal(size=ch.shape[0])
            sums = np.bincount(ch, weights=v, minlength=r.num_chunks) if ch.size else np.zeros(r.num_chunks)
            assert sums.sum() == pytest.approx(v.sum(), abs=1e-9)
    m = ba.metrics
    assert m["texts"] == B and 0.0 <= m["frac_bytes_one_to_one"] <= 1.0


# ------------------------------------------------------------------------------------------------------------
# non-canonical source tokenizations


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, dst_kind=st.sampled_from([k for k in KINDS if k != "byte_bpe"]), data=st.data())
def test_non_canonical_byte_level_source(trained, text, dst_kind, data):
    """Source tokens as sampled by a policy need not be the tokenizer's own encoding: spell random tokens byte
    by byte (every byte is a ByteLevel token)."""
    src, dst = trained["byte_bpe"], trained[dst_kind]
    canon = src.encode(text, continuation=True, parse_special=False)
    b2u = bytes_to_unicode()
    ids = []
    for i in canon:
        if data.draw(st.booleans()):
            ids += [src.token_to_id(b2u[b]) for b in src.token_bytes([i])[0]]
        else:
            ids.append(i)
    a = thl.align(text, src, dst, src_ids=ids)
    check_alignment(a, text, src, dst)
    assert a.src_roundtrip and np.array_equal(a.src_ids, ids)
    if roundtrips(dst_kind, text):
        assert a.chunk_valid.all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, pair=st.sampled_from(PAIRS), data=st.data())
def test_invariants_hold_for_any_ids(trained, text, pair, data):
    """Specials anywhere, cut generations, unrelated ids: never a malformed alignment, mismatches flagged."""
    src, dst = trained[pair[0]], trained[pair[1]]
    ids = src.encode(text, continuation=True, parse_special=False)
    mode = data.draw(st.sampled_from(["specials", "cut", "random"]))
    if mode == "specials":
        for _ in range(data.draw(st.integers(1, 3))):
            ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from([src.bos_id, src.eos_id, 0])))
    elif mode == "cut":
        ids = ids[: data.draw(st.integers(0, len(ids)))]
    else:
        ids = data.draw(st.lists(st.integers(0, src.vocab_size - 1), max_size=12))
    a = thl.align(text, src, dst, src_ids=ids)
    check_alignment(a, text, src, dst)
    if b"".join(src.token_bytes(ids)) not in (text.encode(), b" " + text.encode()):
        assert not a.src_roundtrip
        assert not a.chunk_valid.all() or not text or (a.num_chunks == 0 and a.residual["invalid_bytes"] > 0)


def test_non_canonical_word_from_small_tokens(trained):
    src, dst = trained["metaspace_bpe"], trained["byte_bpe"]
    text = "hello world"
    # "hello" spelled with byte-fallback tokens and single letters instead of the learned merge
    ids = [src.token_to_id("<0x68>"), src.token_to_id("e"), src.token_to_id("l"), src.token_to_id("l"),
           src.token_to_id("o")] + src.encode(" world", continuation=True)
    assert None not in ids and ids != src.encode(text, continuation=True)
    a = thl.align(text, src, dst, src_ids=ids)
    check_alignment(a, text, src, dst)
    assert a.src_roundtrip and a.chunk_valid.all()
    # the chunk(s) of the five small tokens end exactly after b"hello"
    k = a.src_chunk[4]
    assert a.chunk_start[k] + a.chunk_bytes[k] == 5 and a.src_chunk[5] == k + 1


def test_wrong_text_is_flagged_not_misaligned(trained):
    src, dst = trained["byte_bpe"], trained["metaspace_bpe"]
    ids = src.encode("hello world", continuation=True)
    a = thl.align("hello there world", src, dst, src_ids=ids)
    assert not a.src_roundtrip and not a.chunk_valid.all()
    check_alignment(a, "hello there world", src, dst)


def test_out_of_range_ids_raise(trained):
    with pytest.raises(ValueError, match="out of range"):
        thl.align("a", trained["char"], trained["byte_bpe"], src_ids=[10**6])
    for bad in (2**40, -1):   # beyond int32 (the id lists are read as int32 first), negative
        with pytest.raises(ValueError, match=f"source id {bad} out of range"):
            thl.align_batch(["a", "b"], trained["char"], trained["byte_bpe"], [[1], [bad]])


def test_padded_source_array_and_truncation(trained):
    src, dst = trained["byte_bpe"], trained["char"]
    texts = ["hello world 12345", "", "日本語 🙂", "abc"]
    lists = [src.encode(t, continuation=True) + [src.eos_id] for t in texts]
    T = max(map(len, lists))
    pad = np.zeros((4, T), dtype=np.int32)
    for i, l in enumerate(lists):
        pad[i, :len(l)] = l
    ba = thl.align_batch(texts, src, dst, pad, src_lengths=[len(l) for l in lists])
    bl = thl.align_batch(texts, src, dst, lists)
    assert np.array_equal(ba.src_chunk, bl.src_chunk) and np.array_equal(ba.dst_chunk, bl.dst_chunk)
    assert not ba.truncated.any()
    # cut the destination: chunks not complete on both sides become invalid and the row is flagged
    bt = thl.align_batch(texts, src, dst, lists, max_dst_len=5)
    assert bt.dst_ids.shape[1] == 5 and bt.truncated[0] and not bt.truncated[3]
    r = bt.row(0)  # "hello" is one source token and five kept characters; the rest lost its destination
    assert r.chunk_valid[0] and not r.chunk_valid[1:].any() and r.num_chunks == r.src_chunk[-1] + 1
    assert (bt.dst_chunk[0] >= 0).all() and bt.num_chunks[0] <= bt.max_chunks
    bc = thl.align_batch(texts, src, dst, lists, max_chunks=3)
    assert bc.max_chunks == 3 and bc.truncated[0] and (bc.src_chunk < 3).all()


# ------------------------------------------------------------------------------------------------------------
# device side


def _ref_chunk_sum(v, ids, C):
    out = np.zeros((v.shape[0], C))
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            if 0 <= ids[b, t] < C:
                out[b, ids[b, t]] += v[b, t]
    return out


def _random_chunks(rng, B, T, C):
    ids = np.full((B, T), -1, dtype=np.int32)
    for b in range(B):
        n = rng.integers(0, T + 1)
        if n:
            steps = rng.integers(0, 2, size=n)
            steps[0] = 0
            ids[b, :n] = np.minimum(np.cumsum(steps), C - 1)
    return ids


def test_device_functions_match_numpy_and_compile_once():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    B, Ts, Td, C = 3, 12, 9, 6
    src_chunk, dst_chunk = _random_chunks(rng, B, Ts, C), _random_chunks(rng, B, Td, C)
    lps = rng.normal(size=(B, Ts)).astype(np.float32)
    lpd = rng.normal(size=(B, Td)).astype(np.float32)
    n0 = thl.chunk_sum._cache_size()
    cs = np.asarray(thl.chunk_sum(lps, src_chunk, C))
    np.testing.assert_allclose(cs, _ref_chunk_sum(lps, src_chunk, C), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(thl.chunk_sum(lps * 2, src_chunk, C)), 2 * cs, rtol=1e-6, atol=1e-6)
    assert thl.chunk_sum._cache_size() == n0 + 1  # same shapes: no retrace
    thl.chunk_sum(lps[:, :7], src_chunk[:, :7], C)
    assert thl.chunk_sum._cache_size() == n0 + 2  # a new shape: one more
    cnt = _ref_chunk_sum(np.ones_like(lps), src_chunk, C)
    np.testing.assert_allclose(np.asarray(thl.chunk_mean(lps, src_chunk, C)), cs / np.maximum(cnt, 1), rtol=1e-5,
                               atol=1e-6)
    # back to tokens
    vals = rng.normal(size=(B, C)).astype(np.float32)
    tok = np.asarray(thl.chunk_to_tokens(vals, dst_chunk))
    want = np.where(dst_chunk >= 0, np.take_along_axis(vals, np.maximum(dst_chunk, 0), axis=1), 0.0)
    np.testing.assert_allclose(tok, want)
    n1 = thl.chunk_to_tokens._cache_size()
    thl.chunk_to_tokens(vals + 1, dst_chunk)
    assert thl.chunk_to_tokens._cache_size() == n1
    # log-ratio, from chunk sums or from token log-probs, masked by validity
    valid = rng.random((B, C)) > 0.3
    ref = _ref_chunk_sum(lpd, dst_chunk, C) - _ref_chunk_sum(lps, src_chunk, C)
    r1 = np.asarray(thl.chunk_logprob_ratio(lpd, dst_chunk, cs))
    r2 = np.asarray(thl.chunk_logprob_ratio(lpd, dst_chunk, logp_src=lps, src_chunk=src_chunk, num_chunks=C))
    r3 = np.asarray(thl.chunk_logprob_ratio(lpd, dst_chunk, cs, chunk_valid=valid))
    np.testing.assert_allclose(r1, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r2, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(r3, np.where(valid, ref, 0.0), rtol=1e-5, atol=1e-5)
    n2 = thl.chunk_logprob_ratio._cache_size()
    thl.chunk_logprob_ratio(lpd + 1, dst_chunk, cs)
    assert thl.chunk_logprob_ratio._cache_size() == n2
    with pytest.raises(ValueError):
        thl.chunk_logprob_ratio(lpd, dst_chunk)

    # inside a user's jit, with gradients
    @jax.jit
    def loss(lp):
        return (thl.chunk_logprob_ratio(lp, dst_chunk, jnp.asarray(cs)) ** 2).sum()

    g = np.asarray(jax.grad(loss)(jnp.asarray(lpd)))
    assert np.isfinite(g).all() and (g[dst_chunk < 0] == 0).all()


def test_device_on_real_alignment(trained):
    src, dst = trained["unigram"], trained["char"]
    texts = ["a quick test 123", "", "日本語 🙂\n\tok"]
    ba = thl.align_batch(texts, src, dst)
    rng = np.random.default_rng(1)
    lps = rng.normal(size=ba.src_ids.shape).astype(np.float32)
    cs = np.asarray(thl.chunk_sum(lps, ba.src_chunk, ba.max_chunks))
    np.testing.assert_allclose(cs.sum(1), (lps * ba.src_mask).sum(1), rtol=1e-5, atol=1e-5)
    back = np.asarray(thl.chunk_to_tokens(cs, ba.dst_chunk))
    assert (back[~ba.dst_mask] == 0).all()
