"""mrl_jax.see: capacity, eviction, de-duplication, purity, jit, one compile, stats and views."""
import jax
import numpy as np

from mrl_jax import see as S


_add = jax.jit(S.add)


def _exp(texts, pids, src, rewards, rnd=0, rows=None):
    ids = [[ord(c) % 50 for c in t] for t in texts]
    lps = [[-0.5] * len(t) for t in texts]
    return S.make_experience(texts, pids, src, rewards, src_ids=ids, src_logp=lps, round=rnd, max_bytes=16,
                             max_src_tokens=8, num_rows=rows)


def _texts(rec):
    return sorted(S.decode_text(rec, i) for i in range(rec.capacity) if bool(rec.valid[i]))


def test_add_is_pure_keeps_multiplicity_and_archive_dedups():
    buf = S.init(8, 16, 8, num_policies=2, num_prompts=4, tau=1.0)
    before = jax.tree.map(np.asarray, buf)
    new, info = _add(buf, _exp(["ab", "ab", "cd", "ab"], [0, 0, 0, 1], [0, 0, 0, 0], [1.0, 1.0, 0.0, 0.0]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), buf, before)  # old unchanged
    assert int(info["added"]) == 4                                       # every sample kept, repeats too
    assert _texts(new.rollouts) == ["ab", "ab", "ab", "cd"]
    assert int(info["successes_added"]) == 1 and int(info["success_duplicates"]) == 1   # archive dedups
    new2, info2 = _add(new, _exp(["ab", "ab"], [0, 0], [1, 0], [1.0, 1.0]))
    assert int(info2["added"]) == 2
    assert int(info2["successes_added"]) == 1 and int(info2["success_duplicates"]) == 1  # other source is new
    np.testing.assert_allclose(new.stats.total[0, 0], [3.0, 2.0, 2.0, 2.0])
    np.testing.assert_allclose(new.stats.total[1, 0], [1.0, 0.0, 0.0, 0.0])


def test_repeated_peer_samples_fill_every_rollout_slot_every_round():
    """A greedy peer answers the same text G times, in round 0 and again in round 1: the consumer's view
    holds k_rollouts PEER rows of it in both rounds (before: 1 row in round 0, none in round 1)."""
    buf = S.init(64, 16, 8, num_policies=2, num_prompts=4, tau=1.0)
    for rnd in range(2):
        buf, _ = _add(buf, _exp(["42"] * 4, [1] * 4, 1, [1.0] * 4, rnd=rnd))
        sel = S.select_peers(buf, consumer=0, prompt_ids=[1], k_rollouts=4)
        assert list(sel["kind"]) == [S.PEER] * 4 and sel["texts"] == ["42"] * 4


def test_rollout_slots_round_robin_over_peers():
    buf = S.init(64, 16, 8, num_policies=3, num_prompts=4, tau=1.0)
    buf, _ = _add(buf, _exp(["a0", "a1", "a2"], [0] * 3, 1, [0.0] * 3))
    buf, _ = _add(buf, _exp(["b0", "b1", "b2"], [0] * 3, 2, [0.0] * 3))
    sel = S.select_peers(buf, consumer=0, prompt_ids=[0], k_rollouts=4)
    assert sel["texts"] == ["a0", "b0", "a1", "b1"]


def test_cut_text_is_truncated_never_a_success_and_counted():
    buf = S.init(8, 4, 8, num_policies=2, num_prompts=4, tau=1.0)
    exp = S.make_experience(["the answer is 42", "42"], [0, 0], 1, [1.0, 1.0], round=0, max_bytes=4,
                            max_src_tokens=8)
    assert list(np.asarray(exp.truncated)) == [True, False]
    buf, info = _add(buf, exp)
    assert int(info["texts_cut"]) == 1 and int(info["successes_added"]) == 1
    assert _texts(buf.successes) == ["42"]
    sel = S.select_peers(buf, consumer=0, prompt_ids=[0], k_rollouts=2)
    toks = [[ord(c) for c in t] for t in sel["texts"]]
    view = S.make_view(sel, S.ViewAlignment.identity(toks), consumer=0, stats=S.peer_stats(buf, 0, [0]),
                       max_completion_len=8, max_chunks=8, eos_id=99)
    cut_slot = sel["texts"].index("the ")
    assert bool(view.truncated[cut_slot]) and 99 not in list(np.asarray(view.ids[cut_slot]))   # no EOS


def test_ring_eviction_and_per_prompt_cap():
    buf = S.init(4, 16, 8, num_policies=1, num_prompts=8, per_prompt_cap=2)
    buf, info = _add(buf, _exp([f"t{i}" for i in range(6)], [0, 1, 2, 3, 4, 5], 0, [0.0] * 6))
    assert int(info["evicted"]) == 2
    assert _texts(buf.rollouts) == ["t2", "t3", "t4", "t5"]              # ring: oldest two overwritten
    buf, info = _add(buf, _exp(["a1", "a2", "a3"], [7, 7, 7], 0, [0.0] * 3))
    pids = np.asarray(buf.rollouts.prompt_id)[np.asarray(buf.rollouts.valid)]
    assert int(np.sum(pids == 7)) == 2                                   # per-prompt cap holds
    assert "a1" not in _texts(buf.rollouts) and {"a2", "a3"} <= set(_texts(buf.rollouts))


def test_add_under_jit_compiles_once():
    traces = []

    def add(b, e):
        traces.append(1)
        return S.add(b, e)

    jadd = jax.jit(add)
    buf = S.init(16, 16, 8, num_policies=2, num_prompts=4)
    for r in range(3):
        buf, info = jadd(buf, _exp([f"r{r}a", f"r{r}b"], [0, 1], r % 2, [1.0, 0.0], rnd=r, rows=4))
    assert len(traces) == 1
    assert int(buf.rollouts.counter) == 6
    assert _texts(buf.rollouts) == sorted(f"r{r}{c}" for r in range(3) for c in "ab")
    assert sorted(np.asarray(buf.rollouts.prompt_id)[np.asarray(buf.rollouts.valid)]) == [0, 0, 0, 1, 1, 1]


def test_latest_round_stats_and_view():
    buf = S.init(32, 16, 8, num_policies=3, num_prompts=4, tau=1.0)
    buf, _ = _add(buf, _exp(["old"], [2], 1, [1.0], rnd=0))
    buf, _ = _add(buf, _exp(["p1a", "p1b", "own", "p2"], [2, 2, 2, 3], [1, 1, 0, 2], [0.0, 1.0, 1.0, 0.5], rnd=1))
    np.testing.assert_allclose(buf.stats.latest[2, 1], [2.0, 1.0, 1.0, 1.0])    # round 0 entry reset
    np.testing.assert_allclose(buf.stats.total[2, 1], [3.0, 2.0, 2.0, 2.0])
    sel = S.select_peers(buf, consumer=0, prompt_ids=[2, 3], k_rollouts=2, k_successes=1)
    kinds = sel["kind"].reshape(2, 3)
    texts = dict(zip(sel["filled"], sel["texts"]))
    assert sorted(texts[s] for s in (0, 1)) == ["p1a", "p1b"] and texts[2] == "old"   # archived success
    assert list(kinds[0]) == [S.PEER, S.PEER, S.ARCHIVE] and list(kinds[1]) == [S.PEER, S.EMPTY, S.EMPTY]
    toks = [[ord(c) for c in t] for t in sel["texts"]]
    view = S.make_view(sel, S.ViewAlignment.identity(toks), consumer=0, stats=S.peer_stats(buf, 0, [2, 3]),
                       max_completion_len=4, max_chunks=4, eos_id=99)
    assert view.ids.shape == (6, 4) and view.peer_stats.shape == (2, 3, 4)
    assert float(view.peer_stats[:, 0].sum()) == 0.0                     # consumer column zeroed
    s_old = 2
    assert list(np.asarray(view.ids[s_old])) == [ord("o"), ord("l"), ord("d"), 99]
    assert list(np.asarray(view.dst_chunk[s_old])) == [0, 1, 2, -1]      # EOS has no chunk
    np.testing.assert_allclose(view.src_chunk_logp[s_old, :3], -0.5)
    assert bool(view.chunk_valid[s_old, :3].all()) and not bool(view.chunk_valid[s_old, 3])
    assert int(view.kind[4]) == S.EMPTY and float(view.mask[4].sum()) == 0.0
