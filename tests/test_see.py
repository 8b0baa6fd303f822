"""mrl_jax.see: capacity, eviction, de-duplication, purity, jit, one compile, stats and views."""
import jax
from hypothesis import given, settings
from hypothesis import strategies as st
import numpy as np

from mrl_jax import see as S
from mrl_jax.see._views import _round_robin


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
        sel = S.select_peers(buf, consumer=0, prompt_index=[1], k_rollouts=4)
        assert list(sel.row_kind) == [S.PEER] * 4 and sel.texts == ["42"] * 4


def test_rollout_slots_round_robin_over_peers():
    buf = S.init(64, 16, 8, num_policies=3, num_prompts=4, tau=1.0)
    buf, _ = _add(buf, _exp(["a0", "a1", "a2"], [0] * 3, 1, [0.0] * 3))
    buf, _ = _add(buf, _exp(["b0", "b1", "b2"], [0] * 3, 2, [0.0] * 3))
    sel = S.select_peers(buf, consumer=0, prompt_index=[0], k_rollouts=4)
    assert sel.texts == ["a0", "b0", "a1", "b1"]


def test_cut_text_is_truncated_never_a_success_and_counted():
    buf = S.init(8, 4, 8, num_policies=2, num_prompts=4, tau=1.0)
    exp = S.make_experience(["the answer is 42", "42"], [0, 0], 1, [1.0, 1.0], round=0, max_bytes=4,
                            max_src_tokens=8)
    assert list(np.asarray(exp.truncated)) == [True, False]
    buf, info = _add(buf, exp)
    assert int(info["texts_cut"]) == 1 and int(info["successes_added"]) == 1
    assert _texts(buf.successes) == ["42"]
    sel = S.select_peers(buf, consumer=0, prompt_index=[0], k_rollouts=2)
    toks = [[ord(c) for c in t] for t in sel.texts]
    view = S.make_view(sel, S.ViewAlignment.identity(toks), consumer=0, stats=S.peer_stats(buf, 0, [0]),
                       max_completion_length=8, max_chunks=8, eos_id=99)
    cut_slot = sel.texts.index("the ")
    assert bool(view.truncated[cut_slot]) and 99 not in list(np.asarray(view.completion_ids[cut_slot]))   # no EOS


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
    sel = S.select_peers(buf, consumer=0, prompt_index=[2, 3], k_rollouts=2, k_successes=1)
    kinds = sel.row_kind.reshape(2, 3)
    texts = dict(zip(sel.filled, sel.texts))
    assert sorted(texts[s] for s in (0, 1)) == ["p1a", "p1b"] and texts[2] == "old"   # archived success
    assert list(kinds[0]) == [S.PEER, S.PEER, S.ARCHIVE] and list(kinds[1]) == [S.PEER, S.EMPTY, S.EMPTY]
    toks = [[ord(c) for c in t] for t in sel.texts]
    view = S.make_view(sel, S.ViewAlignment.identity(toks), consumer=0, stats=S.peer_stats(buf, 0, [2, 3]),
                       max_completion_length=4, max_chunks=4, eos_id=99)
    assert view.completion_ids.shape == (6, 4) and view.peer_stats.shape == (2, 3, 4)
    assert float(view.peer_stats[:, 0].sum()) == 0.0                     # consumer column zeroed
    s_old = 2
    assert list(np.asarray(view.completion_ids[s_old])) == [ord("o"), ord("l"), ord("d"), 99]
    assert list(np.asarray(view.dst_chunk[s_old])) == [0, 1, 2, -1]      # EOS has no chunk
    np.testing.assert_allclose(view.src_chunk_logp[s_old, :3], -0.5)
    assert bool(view.chunk_valid[s_old, :3].all()) and not bool(view.chunk_valid[s_old, 3])
    assert int(view.row_kind[4]) == S.EMPTY and float(view.completion_mask[4].sum()) == 0.0


def _select_by_scan(see, consumer, prompt_ids, k_rollouts, k_successes, k_own):
    """Reference: the per-prompt scan of the whole buffer (select_peers before its one-pass grouping)."""
    ro, su = jax.device_get((see.rollouts, see.successes))
    lr = np.asarray(see.stats.latest_round)
    K = k_rollouts + k_successes + k_own
    slots = []
    for pid in prompt_ids:
        m = ro.valid & (ro.prompt_id == pid) & (ro.source != consumer)
        if 0 <= pid < lr.shape[0]:
            m &= ro.round == lr[pid, np.clip(ro.source, 0, lr.shape[1] - 1)]
        chosen = [(0, i) for i in _round_robin(ro, np.nonzero(m)[0])[:k_rollouts]]
        seen = {(int(ro.source[i]), int(ro.text_hash[i]), int(ro.text_len[i])) for _, i in chosen}
        sidx = np.nonzero(su.valid & (su.prompt_id == pid) & (su.source != consumer))[0]
        for i in sidx[np.argsort(-su.stamp[sidx], kind="stable")]:
            key = (int(su.source[i]), int(su.text_hash[i]), int(su.text_len[i]))
            if sum(t == 1 for t, _ in chosen) < k_successes and key not in seen:
                seen.add(key)
                chosen.append((1, int(i)))
        oidx = np.nonzero(su.valid & (su.prompt_id == pid) & (su.source == consumer))[0]
        chosen += [(2, int(i)) for i in oidx[np.argsort(-su.stamp[oidx], kind="stable")][:k_own]]
        slots.append(chosen + [(-1, -1)] * (K - len(chosen)))
    return [s for row in slots for s in row]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.sampled_from(["a", "b", "ab", "c"]),
                          st.sampled_from([0.0, 1.0])), min_size=1, max_size=40),
       st.lists(st.integers(-1, 6), min_size=1, max_size=6), st.integers(0, 2), st.integers(0, 3),
       st.integers(0, 2), st.integers(0, 2), st.integers(2, 3))
def test_select_peers_equals_the_per_prompt_scan(entries, prompt_ids, consumer, k_r, k_s, k_o, rounds):
    """The one-pass grouping by prompt picks the same records, in the same slots, as scanning the whole
    buffer for every batch prompt (ring eviction, repeats, successes, out-of-table prompt ids)."""
    buf = S.init(16, 16, 8, num_policies=3, num_prompts=5, per_prompt_cap=4, success_capacity=8, tau=1.0)
    for rnd in range(rounds):
        part = entries[rnd::rounds]
        if part:
            buf, _ = _add(buf, _exp([t for _, _, t, _ in part], [p for p, _, _, _ in part],
                                    [s for _, s, _, _ in part], [r for *_, r in part], rnd=rnd))
    sel = S.select_peers(buf, consumer, prompt_ids, k_r, k_s, k_o)
    want = _select_by_scan(buf, consumer, prompt_ids, k_r, k_s, k_o)
    assert list(sel.row_kind) == [(S.EMPTY, S.PEER, S.ARCHIVE, S.OWN_ARCHIVE)[t + 1] for t, _ in want]
    assert [int(i) for i in sel.record] == [i for _, i in want]


def _view_by_rows(sel, aligned, Tc, C, pad_id, eos_id):
    """Reference: make_view's token fields built slot by slot (before the vectorised build)."""
    S_ = len(sel.row_kind)
    ids, mask = np.full((S_, Tc), pad_id, np.int32), np.zeros((S_, Tc), np.float32)
    dchunk, sclp = np.full((S_, Tc), -1, np.int32), np.zeros((S_, C), np.float32)
    trunc, kind = np.asarray(sel.truncated, bool).copy(), np.asarray(sel.row_kind, np.int32).copy()
    for m, s in enumerate(sel.filled):
        n = int(aligned.dst_lengths[m])
        d_ids, d_ch = aligned.dst_ids[m, :n], aligned.dst_chunk[m, :n]
        if eos_id is not None and not trunc[s]:
            d_ids, d_ch = np.append(d_ids, eos_id), np.append(d_ch, -1)
        if len(d_ids) > Tc:
            trunc[s], d_ids, d_ch = True, d_ids[:Tc], d_ch[:Tc]
        ids[s, :len(d_ids)], mask[s, :len(d_ids)] = d_ids, 1.0
        dchunk[s, :len(d_ids)] = np.where((d_ch >= 0) & (d_ch < C), d_ch, -1)
        lp = np.asarray(sel.src_logp[m], np.float32)
        sc = aligned.src_chunk[m, :len(lp)]
        keep = (sc >= 0) & (sc < C)
        np.add.at(sclp[s], sc[keep], lp[: len(sc)][keep])
        if len(d_ids) == 0:
            kind[s] = S.EMPTY
    return dict(completion_ids=ids, completion_mask=mask, dst_chunk=dchunk, src_chunk_logp=sclp, truncated=trunc,
                row_kind=kind)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 6), st.booleans()), min_size=0, max_size=6),
       st.integers(1, 6), st.integers(1, 5), st.sampled_from([None, 9]), st.integers(0, 2**31 - 1))
def test_make_view_equals_the_slot_by_slot_build(rows, Tc, C, eos_id, seed):
    """Vectorised make_view: the same tokens, masks, chunks, chunk log-prob sums, truncation and kinds as
    building every filled slot on its own (EOS appended or not, cut at Tc, chunks >= C dropped, empty rows)."""
    rng = np.random.default_rng(seed)
    M, S_ = len(rows), 2 * len(rows) + 1
    filled = sorted(rng.choice(S_, M, replace=False).tolist())
    Td, Ts = max([n for n, _, _ in rows] + [1]), max([k for _, k, _ in rows] + [1])
    dst_ids = rng.integers(1, 50, (M, Td)).astype(np.int32)
    dst_chunk = rng.integers(-1, 7, (M, Td)).astype(np.int32)
    src_chunk = rng.integers(-1, 7, (M, Ts)).astype(np.int32)
    for m, (n, k, _) in enumerate(rows):
        dst_ids[m, n:], dst_chunk[m, n:], src_chunk[m, k:] = 0, -1, -1
    aligned = S.ViewAlignment(dst_ids=dst_ids, dst_chunk=dst_chunk, src_chunk=src_chunk,
                              chunk_valid=rng.random((M, 7)) < 0.5, dst_lengths=np.array([n for n, _, _ in rows], np.int32))
    trunc = np.zeros(S_, bool)
    trunc[filled] = [t for _, _, t in rows]
    sel = S.PeerSelection(row_kind=np.where(np.isin(np.arange(S_), filled), S.PEER, S.EMPTY).astype(np.int32),
                          record=np.zeros(S_, np.int32), prompt_slot=np.zeros(S_, np.int32),
                          source=np.zeros(S_, np.int32), rewards=np.zeros(S_, np.float32), truncated=trunc,
                          filled=filled, texts=[""] * M, src_ids=[np.zeros(0, np.int32)] * M,
                          src_logp=[rng.normal(-1, 0.5, k + int(rng.integers(0, 3))).astype(np.float32)
                                    for _, k, _ in rows])
    view = S.make_view(sel, aligned, consumer=0, stats=np.zeros((1, 2, 4)), max_completion_length=Tc, max_chunks=C,
                       pad_id=3, eos_id=eos_id)
    for k, v in _view_by_rows(sel, aligned, Tc, C, 3, eos_id).items():
        np.testing.assert_array_equal(np.asarray(getattr(view, k)), v, err_msg=k)


def _ref_insert(rec: dict, entries, keep, dedup: bool, cap: int, per_prompt_cap: int):
    """Sequential insertion written out in Python (the spec of ``_insert``): each kept entry in order goes to the
    ring pointer, or over its prompt's oldest record when the prompt already holds ``per_prompt_cap``; with
    ``dedup`` an entry equal to a stored one (source, prompt, text) is skipped. Returns (added, dup, evicted)."""
    added = dup = ev = 0
    for (pid, src, text, r), k in zip(entries, keep):
        if not k:
            continue
        same = [i for i in range(cap) if rec["valid"][i] and rec["prompt_id"][i] == pid]
        if dedup and any(rec["source"][i] == src and rec["text"][i] == text for i in same):
            dup += 1
            continue
        full = len(same) >= per_prompt_cap
        slot = min(same, key=lambda i: rec["stamp"][i]) if full else rec["ptr"]
        ev += bool(rec["valid"][slot])
        for f, v in (("prompt_id", pid), ("source", src), ("text", text), ("reward", r)):
            rec[f][slot] = v
        rec["stamp"][slot], rec["valid"][slot] = rec["counter"], True
        rec["counter"] += 1
        if not full:
            rec["ptr"] = (rec["ptr"] + 1) % cap
        added += 1
    return added, dup, ev


@settings(max_examples=25, deadline=None)
@given(rounds=st.lists(st.lists(st.tuples(st.integers(-1, 3), st.integers(0, 1), st.sampled_from(["a", "b", "cc"]),
                                          st.sampled_from([0.0, 1.0])), min_size=1, max_size=10),
                       min_size=1, max_size=4))
def test_add_equals_the_sequential_insertion(rounds):
    cap, ppc, scap, sppc = 6, 3, 4, 2
    buf = S.init(cap, 16, 8, num_policies=2, num_prompts=4, success_capacity=scap, per_prompt_cap=ppc,
                 success_per_prompt_cap=sppc, tau=1.0)
    fresh = lambda n: {"prompt_id": [-1] * n, "source": [-1] * n, "text": [None] * n, "reward": [0.0] * n,
                       "stamp": [0] * n, "valid": [False] * n, "ptr": 0, "counter": 0}
    ro, su = fresh(cap), fresh(scap)
    for rnd, entries in enumerate(rounds):
        pids, srcs, texts, rewards = (list(x) for x in zip(*entries))
        buf, info = _add(buf, _exp(texts, pids, srcs, rewards, rnd=rnd, rows=16))
        valid = [p >= 0 for p in pids]
        a, _, e = _ref_insert(ro, entries, valid, False, cap, ppc)
        sa, sd, se = _ref_insert(su, entries, [v and r >= 1.0 for v, r in zip(valid, rewards)], True, scap, sppc)
        assert (int(info["added"]), int(info["evicted"])) == (a, e)
        assert (int(info["successes_added"]), int(info["success_duplicates"]), int(info["successes_evicted"])) \
            == (sa, sd, se)
        for rec, ref in ((buf.rollouts, ro), (buf.successes, su)):
            valid_now = np.asarray(rec.valid)
            assert valid_now.tolist() == ref["valid"] and int(rec.ptr) == ref["ptr"]
            assert np.asarray(rec.prompt_id)[valid_now].tolist() == [p for p, v in zip(ref["prompt_id"], valid_now)
                                                                     if v]
            assert np.asarray(rec.stamp)[valid_now].tolist() == [s for s, v in zip(ref["stamp"], valid_now) if v]
            assert [S.decode_text(rec, i) for i in np.nonzero(valid_now)[0]] == \
                [t for t, v in zip(ref["text"], ref["valid"]) if v]
