"""trainer.encoding.decode_completions (vectorised over the batch) equals decoding each row on its own."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrl_jax.tokenization import train_tokenizer
from mrl_jax.trainer.encoding import decode_completions


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    corpus = ["héllo wörld 12+34=46", "日本語のテキスト 🙂", "abc abc abc"] * 8
    return train_tokenizer("byte_bpe", corpus, 320, cache_dir=tmp_path_factory.mktemp("tok"))


def _per_row(tokenizer, tokens, mask, stop_ids):
    """The reference: each row's masked ids, a final stop token dropped, its exact bytes decoded."""
    stops = {tokenizer.eos_id} if stop_ids is None else {int(i) for i in stop_ids}
    texts, content = [], []
    for row, m in zip(tokens, mask):
        ids = [int(t) for t in row[m]]
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        content.append(ids)
        texts.append(tokenizer.decode(ids, continuation=True))
    return texts, content


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), B=st.integers(1, 6), N=st.integers(1, 12), prefix=st.booleans())
def test_batch_decode_equals_row_by_row(tok, data, B, N, prefix):
    special = [i for i in (tok.eos_id, tok.bos_id, tok.pad_id) if i is not None]
    ids = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(special))
    tokens = np.array(data.draw(st.lists(st.lists(ids, min_size=N, max_size=N), min_size=B, max_size=B)), np.int32)
    if prefix:   # the sampler's layout: True up to and including the stop token
        lengths = np.array(data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B)))
        mask = np.arange(N)[None, :] < lengths[:, None]
    else:        # any mask
        mask = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=N, max_size=N), min_size=B,
                                           max_size=B)), bool)
    stop_ids = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(special + [5, 17]), max_size=3)))
    assert decode_completions(tok, tokens, mask, stop_ids) == _per_row(tok, tokens, mask, stop_ids)


def test_stop_token_in_the_middle_stays_and_empty_rows(tok):
    a = tok.encode("héllo", continuation=True)
    e = tok.eos_id
    tokens = np.array([a + [e, a[0]], [e] + [0] * len(a) + [0], [0] * (len(a) + 2)], np.int32)
    mask = np.zeros(tokens.shape, bool)
    mask[0], mask[1, 0] = True, True
    texts, content = decode_completions(tok, tokens, mask)
    assert content == [a + [e, a[0]], [], []]
    assert texts[0].startswith("héllo") and texts[1:] == ["", ""]
