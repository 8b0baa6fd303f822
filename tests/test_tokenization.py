"""mrl_jax.tokenization: loading real tokenizer.json files, special ids, byte tables, trained tokenizers."""

from __future__ import annotations

import json

import pytest

from mrl_jax import tokenization
from mrl_jax.tokenization import TRAINABLE_KINDS, load_tokenizer, train_tokenizer

CORPUS = [f"line {i}: the quick brown fox {i * 37 % 1000} jumps over the lazy dog\n\tdef f(x): return x + {i}"
          for i in range(300)] + ["日本語のテキスト 中文 🙂 café naïve Привет"] * 20

SAMPLES = ["Hello world", "  two  spaces\tand\ttabs\r\n", "12345 + 678 = 13023", "日本語 🙂 👍🏽 👨\u200d👩\u200d👧",
           "café naïve ﬁ ①", "", " leading space", "x<eos>y", "\x00\x7f"]

# family -> (bos, eos, pad) as given by the shipped config files
REAL_IDS = {
    "gpt2": (50256, 50256, None),
    "gpt-neox-20b": (0, 0, 1),
    "mistral-7b-v0.1": (1, 2, None),
    "phi-3-mini": (1, 32000, 32000),
    "smollm2-135m": (1, 2, 2),
    "t5-small": (None, 1, 0),
    "bert-base-uncased": (101, 102, 0),
}
ROUNDTRIP_REAL = ("gpt2", "gpt-neox-20b", "mistral-7b-v0.1", "phi-3-mini", "smollm2-135m")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    return {k: train_tokenizer(k, CORPUS, 500, cache_dir=d) for k in TRAINABLE_KINDS}


@pytest.fixture(scope="module")
def real(shared_tokenizers_dir):
    return {name: load_tokenizer(shared_tokenizers_dir / name) for name in REAL_IDS
            if (shared_tokenizers_dir / name / "tokenizer.json").is_file()}


# ------------------------------------------------------------------------------------------------------------
# loading


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        load_tokenizer(bad.parent)
    bad.write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(ValueError, match="not a valid"):
        load_tokenizer(bad)


def test_real_special_ids_and_encoding(real, shared_tokenizers_dir):
    expected = json.loads((shared_tokenizers_dir / "expected_hello.json").read_text())
    text = expected["text"]
    for name, tok in real.items():
        assert (tok.bos_id, tok.eos_id, tok.pad_id) == REAL_IDS[name], name
        fam = expected["families"][name]
        assert tok.encode(text) == fam["no_specials"]["ids"], name  # no special tokens added
        assert tok.encode(text, add_special_tokens=True) == fam["with_specials"]["ids"], name
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == fam["decode"], name
        assert tok.vocab_size == fam["vocab_size_with_added"], name
        assert tok.encode_batch([text, "", "a"]) == [tok.encode(text), tok.encode(""), tok.encode("a")]
        assert tok.name == name
    assert real["bert-base-uncased"].normalizes and real["t5-small"].normalizes and real["gpt-neox-20b"].normalizes
    assert not real["gpt2"].normalizes and not real["mistral-7b-v0.1"].normalizes
    assert real["t5-small"].algorithm == "Unigram" and real["bert-base-uncased"].algorithm == "WordPiece"


def test_real_byte_tables_match_decoder(real):
    """The vocabulary byte table spells what the tokenizer's own decoder produces."""
    for name in ROUNDTRIP_REAL:
        if name not in real:
            continue
        tok = real[name]
        for s in SAMPLES:
            if name == "gpt-neox-20b":  # NFC normalizer
                import unicodedata
                s = unicodedata.normalize("NFC", s)
            ids = tok.encode(s)
            got = tok.decode_bytes(ids)
            plain = tok.hf.decode(ids, skip_special_tokens=False).encode()
            assert got in (plain, b" " + plain), (name, s)  # Metaspace: the decoder strips the dummy prefix
            assert got in (s.encode(), b" " + s.encode()), (name, s)
            # continuation encoding spells the text exactly (no dummy prefix)
            assert tok.decode(tok.encode(s, continuation=True, parse_special=False), continuation=True) == s, name


def test_real_byte_table_details(real):
    if "phi-3-mini" in real:
        t = real["phi-3-mini"]
        assert t.token_bytes([t.token_to_id("<0xF0>"), t.token_to_id("▁Hello")]) == [b"\xf0", b" Hello"]
        assert t.byte_table.prefix_space and t.byte_table.special[t.bos_id]
    if "gpt2" in real:
        t = real["gpt2"]
        assert t.token_bytes([t.token_to_id("Ġworld"), t.eos_id]) == [b" world", b""]
        assert not t.byte_table.prefix_space
    if "gpt-neox-20b" in real:  # added tokens that are runs of spaces contribute their text
        t = real["gpt-neox-20b"]
        assert t.token_bytes([50254]) == [b" " * 24] and not t.byte_table.special[50254]
    if "bert-base-uncased" in real:
        t = real["bert-base-uncased"]
        assert t.token_bytes([t.token_to_id("hello"), t.token_to_id("##s"), t.token_to_id(",")]) == [
            b" hello", b"s", b","]
        assert t.byte_table.space_optional and t.byte_table.unknown[t.token_to_id("[UNK]")]


def test_continuation_and_literal_specials(real):
    if "mistral-7b-v0.1" not in real:
        pytest.skip("mistral tokenizer missing")
    t = real["mistral-7b-v0.1"]
    assert [t.id_to_token(i) for i in t.encode("42")] == ["▁", "4", "2"]
    assert [t.id_to_token(i) for i in t.encode("42", continuation=True)] == ["4", "2"]
    assert [t.id_to_token(i) for i in t.encode(" x", continuation=True)] == ["▁x"]
    assert t.eos_id in t.encode("a</s>")
    assert t.eos_id not in t.encode("a</s>", parse_special=False)


# ------------------------------------------------------------------------------------------------------------
# training


def test_train_kinds(trained):
    for kind, tok in trained.items():
        assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2), kind
        assert [tok.id_to_token(i) for i in (0, 1, 2)] == ["<pad>", "<bos>", "<eos>"]
        assert tok.vocab_size <= 500, kind
        for s in SAMPLES:
            ids = tok.encode(s, parse_special=False)
            assert tok.eos_id not in ids and tok.bos_id not in ids
            if kind != "wordpiece":
                # a Metaspace decoder strips one leading space: the dummy prefix, or a real one
                assert tok.decode(ids) in (s, s[1:]), (kind, s)
                assert tok.decode(tok.encode(s, continuation=True, parse_special=False), continuation=True) == s
        assert tok.eos_id in tok.encode("x<eos>y")  # specials parsed by default
        assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    assert trained["wordpiece"].algorithm == "WordPiece" and trained["unigram"].algorithm == "Unigram"
    # digits one by one in byte_bpe (and metaspace_bpe), as Llama / Qwen
    bb = trained["byte_bpe"]
    assert [bb.id_to_token(i) for i in bb.encode("12345")] == list("12345")
    ms = trained["metaspace_bpe"]
    assert [ms.id_to_token(i) for i in ms.encode("x 12", continuation=True)][-2:] == ["1", "2"]
    # metaspace_bpe: unseen characters fall back to bytes
    ids = ms.encode("ꙮ", continuation=True)
    assert [ms.id_to_token(i) for i in ids] == ["<0xEA>", "<0x99>", "<0xAE>"]
    assert ms.decode(ids) == "ꙮ"


def test_train_deterministic_and_cached(tmp_path, monkeypatch):
    a = {k: train_tokenizer(k, CORPUS, 400, cache_dir=tmp_path / "a") for k in TRAINABLE_KINDS}
    b = {k: train_tokenizer(k, CORPUS, 400, cache_dir=tmp_path / "b") for k in TRAINABLE_KINDS}
    for k in TRAINABLE_KINDS:
        assert a[k].hf.to_str() == b[k].hf.to_str(), k
    assert len(list((tmp_path / "a").glob("*.json"))) == len(TRAINABLE_KINDS)

    def boom(*args, **kwargs):
        raise AssertionError("retrained instead of loading the cache")

    monkeypatch.setattr(tokenization._training, "_train", boom)
    c = train_tokenizer("byte_bpe", CORPUS, 400, cache_dir=tmp_path / "a")
    assert c.encode("hello 123") == a["byte_bpe"].encode("hello 123")
    with pytest.raises(AssertionError):  # another corpus is another key
        train_tokenizer("byte_bpe", CORPUS[:10], 400, cache_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tokenizer("bpe", CORPUS, 400, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer("metaspace_bpe", CORPUS, 200, cache_dir=tmp_path)


def test_vocab_size_is_an_upper_bound(tmp_path):
    for kind in TRAINABLE_KINDS:
        for size in (270, 300):
            tok = train_tokenizer(kind, CORPUS, size, cache_dir=tmp_path)
            assert tok.vocab_size <= size, (kind, size)
            s = "日本語 🙂 x"
            if kind != "wordpiece":
                assert tok.decode(tok.encode(s, continuation=True), continuation=True) == s


def test_save_and_load_roundtrip(trained, tmp_path):
    for kind in ("byte_bpe", "metaspace_bpe"):
        tok = trained[kind]
        tok.save(tmp_path / kind)
        back = load_tokenizer(tmp_path / kind)
        assert (back.bos_id, back.eos_id, back.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
        assert back.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)
