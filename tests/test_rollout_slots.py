"""generate_slots (S decode slots, rows admitted as slots free) against the static sampler: same key, same tokens,
for every S; one decode program whatever the lengths."""
import jax
import numpy as np
import pytest
from flax import nnx

from mrl_jax import models
from mrl_jax.trainer.compile_stats import CompileCounter
from mrl_jax.sampler import (SHORT, Ladder, SamplingConfig, drive, generate, generate_slots, graph_token,
                             ladder_row_steps, launch, left_pad, min_row_steps, paged_layout, ragged, rungs, slot_count)
from mrl_jax.sampler.slots import trace_count

VOCAB = 61
PROMPTS = [[1, 5, 9, 14], [1, 22], [1, 3, 4, 5, 6, 7]]


def _tiny(family="llama", **kw):
    m = models.tiny_model(family, VOCAB, seed=3, hidden_size=32, intermediate_size=64, **kw)
    g, p = nnx.split(m)
    return g, jax.tree_util.tree_map(lambda x: x * 3.0, p)   # sharper logits: varied lengths


@pytest.fixture(scope="module")
def llama():
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    return (*_tiny(), ids, mask)


def _assert_same(out, ref):
    for f in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(out, f), np.asarray(getattr(ref, f)), err_msg=f)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
    np.testing.assert_allclose(out.sampling_logprobs, ref.sampling_logprobs, atol=1e-5)


def test_slot_count():
    assert [slot_count(12, s) for s in (None, 1, 5, 12, 40)] == [12, 1, 5, 12, 12]
    assert [slot_count(12, s, 4) for s in (None, 1, 5)] == [12, 4, 8]
    with pytest.raises(ValueError, match="sampling.slots"):
        slot_count(12, 0)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.9, top_k=12, min_p=0.05)],
                         ids=["plain", "filtered"])
def test_every_slot_count_equals_the_static_sampler(llama, kw):
    """3 prompts x G 4 (prefix layout), three EOS ids: long-tailed lengths. S = 12 (every row), 1, 5 and 7 (divide
    nothing; 2 and 1 rows admitted per step, so freed slots wait their turn): tokens, masks, lengths, truncation equal, log-probs within 1e-5; S = 1 computes
    exactly the kept tokens, S = 12 the static sampler's B * max(lengths)."""
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16, **kw)
    key = jax.random.key(21)
    ref = jax.device_get(generate(g, p, ids, mask, key, cfg, num_samples=4))
    lengths = np.asarray(ref.lengths)
    assert lengths.min() < 10 and lengths.max() >= 20, lengths
    for s, admit in ((12, None), (1, None), (5, 2), (7, 1)):   # admit: rows entering per step at most (a queue)
        out, stats = generate_slots(g, p, ids, mask, key, cfg, num_samples=4, slots=s, admit=admit)
        _assert_same(out, ref)
        assert stats["slots"] == s and stats["row_steps"] >= min_row_steps(lengths, s) >= lengths.sum(), (s, stats)
        assert stats["shared_prompts"] == (s == 12), stats   # a slot per row reads each prompt once for its G
        if s in (1, 12):   # the bound is reached: one row at a time, or every row at once
            assert stats["row_steps"] == (lengths.sum() if s == 1 else 12 * lengths.max()) == min_row_steps(lengths, s)


def test_the_tail_moves_to_fewer_slots(llama):
    """36 rows (3 prompts x G 12) in S = 36 slots: once 24 rows or fewer are left (the queue is empty from the
    start) they move to 24 slots, then to 12. Tokens equal the static sampler's with and without the moves; with
    them the row-steps are exactly those of moves at the first step the rows fit (each rung's loop stops there),
    below what 36 fixed slots take at least (the bound, which they reach
    without it); later keys (other lengths) compile nothing."""
    # 3/4 steps above 32 slots (to 2^k or 3 * 2^k), halves below, floor 8; multiples of the devices
    ladder = Ladder().rungs   # the default ladder
    assert ladder(36) == (36, 24, 12) and ladder(128) == (128, 96, 64, 48, 32, 16, 8) and ladder(12) == (12,)
    assert ladder(36, 4) == (36, 24, 12, 8) and ladder(128, shrink=False) == (128,) and ladder(1) == (1,)
    assert ladder(100) == (100, 64, 48, 32, 16, 8) and ladder(48, 6) == (48, 36, 24, 12) and ladder(18) == (18, 8)
    assert ladder(512) == (512, 384, 256, 192, 128, 96, 64, 48, 32, 16)   # ten decode programs at most
    g, p, ids, mask = llama
    # a round of at most SHORT new tokens keeps S (too short a tail to repay the rungs' compiles)
    assert rungs(g, p, 36, SHORT) == (36,) and rungs(g, p, 36, SHORT + 1) == ladder(36)
    assert rungs(g, p, 36, SHORT + 1, shrink=False) == (36,) == rungs(g, p, 36, SHORT + 1, ragged=False)
    assert not ragged(None, 36, 36) and ragged((7,), 36, 36) and ragged(None, 24, 36)
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16)
    key = jax.random.key(21)
    ref = jax.device_get(generate(g, p, ids, mask, key, cfg, num_samples=12))
    lengths = np.asarray(ref.lengths)
    out, stats = generate_slots(g, p, ids, mask, key, cfg, num_samples=12)
    _assert_same(out, ref)
    fixed, fixed_stats = generate_slots(g, p, ids, mask, key, cfg, num_samples=12, shrink=False)
    _assert_same(fixed, ref)
    assert stats["rungs"] == (36, 24, 12) and fixed_stats["rungs"] == (36,), (stats, fixed_stats)
    assert stats["shared_prompts"] and fixed_stats["shared_prompts"]   # the first move copies the prompts in
    assert stats["row_steps"] == ladder_row_steps(lengths, (36, 24, 12)), stats
    assert ladder_row_steps(lengths, (36,)) == min_row_steps(lengths, 36)
    assert fixed_stats["row_steps"] == min_row_steps(lengths, 36) > stats["row_steps"] >= lengths.sum()
    with CompileCounter() as cc:
        for r in range(1, 4):
            out, stats = generate_slots(g, p, ids, mask, jax.random.key(21 + r), cfg, num_samples=12)
            assert stats["rungs"][0] == 36
    assert cc.programs == 0


def test_a_ladder_with_a_ratio_trades_rungs_for_row_steps(llama):
    """``Ladder(ratio, floor)``: each rung at most ratio x the one above (at least one multiple fewer), down to the
    floor; a round on it keeps the static sampler's tokens and takes exactly its ladder's row-steps, fewer than on
    the default rungs; a ratio outside (0, 1) or a floor below 1 is refused naming the config key."""
    assert Ladder(0.5, 1).rungs(36) == (36, 18, 9, 4, 2, 1)
    assert Ladder(0.9, 4).rungs(36, 4) == (36, 32, 28, 24, 20, 16, 12, 8, 4)   # at least 4 fewer each rung
    assert Ladder(0.999, 1).rungs(128) == tuple(range(128, 64, -1))   # 64 rungs at most
    assert Ladder(floor=12).rungs(12) == (12,) and Ladder(floor=20).rungs(36) == (36, 24)
    for bad, key in (({"ratio": 1.0}, "ladder_ratio"), ({"ratio": 0.0}, "ladder_ratio"), ({"floor": 0}, "ladder_floor")):
        with pytest.raises(ValueError, match=f"sampling.{key} must be"):
            Ladder(**bad)
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16)
    key = jax.random.key(21)
    ref = jax.device_get(generate(g, p, ids, mask, key, cfg, num_samples=12))
    lengths = np.asarray(ref.lengths)
    fine = Ladder(0.8, 2).rungs(36)
    assert fine == (36, 28, 22, 17, 13, 10, 8, 6, 4, 3, 2)
    out, stats = generate_slots(g, p, ids, mask, key, cfg, num_samples=12, ladder=Ladder(0.8, 2))
    _assert_same(out, ref)
    assert stats["row_steps"] == ladder_row_steps(lengths, fine) < ladder_row_steps(lengths, Ladder().rungs(36)), stats
    assert stats["rungs"] == fine[:len(stats["rungs"])] and len(stats["rungs"]) > 3, stats


def test_a_round_is_one_program_holding_every_rung(llama):
    """36 rows with stop ids (a tail that could move: rungs 36, 24, 12): the round is one program, traced and
    compiled once (under the round's transfer guard too), holding a decode loop per rung, so a later round whose
    rows move further compiles nothing. Rows that can only end together (no stop id, a slot per row) keep one rung:
    nothing could move; with fewer slots than rows they enter, and so end, at different steps: the ladder again.
    N = 39 / 37: shapes no other test compiles."""
    from mrl_jax.sampler import rounds

    g, p, ids, mask = llama

    def program(cfg, slots=36):   # the memoised round program of this config at S = slots, and its rungs
        (k,) = [k for k in rounds._PROGRAMS
                if k[0] == graph_token(g) and k[1] == cfg and k[3][0] == slots]
        return rounds._PROGRAMS[k], k[3]

    for n, guard in ((39, "allow"), (37, "disallow")):
        cfg = SamplingConfig(max_new_tokens=n, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16, temperature=0.9)
        key = jax.random.key(3)
        ref = jax.device_get(generate(g, p, ids, mask, key, cfg, num_samples=12))
        before = trace_count()
        with CompileCounter() as cc, jax.transfer_guard(guard):
            out, stats = generate_slots(g, p, ids, mask, key, cfg, num_samples=12)
        assert trace_count() - before == 1 and cc.programs == 1, (guard, cc.programs)
        _assert_same(out, ref)
        whole, sizes = program(cfg)
        loops = str(jax.make_jaxpr(whole)(p, ids, mask, key)).count(" while[")
        free = SamplingConfig(max_new_tokens=n, pad_id=0, eos_id=None, cache_bucket=16, temperature=0.9)
        out, stats = generate_slots(g, p, ids, mask, key, free, num_samples=12)
        assert sizes == (36, 24, 12) and stats["rungs"] == program(free)[1] == (36,), (sizes, stats)
        assert loops - str(jax.make_jaxpr(program(free)[0])(p, ids, mask, key)).count(" while[") == 2   # a loop a rung
        generate_slots(g, p, ids, mask, key, free, num_samples=12, slots=24)
        assert program(free, 24)[1] == Ladder().rungs(24) == (24, 12)


def _stop_set(tokens: np.ndarray) -> tuple:
    """(EOS ids, first, never) read off an EOS-free sample: the first token of row ``first`` (a row that ends at
    step 0) and a few later tokens of other rows, none of which occurs in row ``never`` (a row that never ends)."""
    never = min(range(len(tokens)), key=lambda r: len(set(tokens[r])))
    avoid = set(tokens[never].tolist())
    first = next(r for r in range(len(tokens)) if int(tokens[r, 0]) not in avoid)
    stops = {int(tokens[first, 0])} | {int(t) for t in tokens[:, 4::6].ravel()}
    return tuple(sorted(stops - avoid)), first, never


@pytest.mark.parametrize("g,slots", [(3, 4), (1, 2), (3, 9)], ids=["prefix_G3_S4", "joint_G1_S2", "prefix_G3_every_row"])
def test_rows_ending_at_step_0_or_never(llama, g, slots):
    """A row ending at step 0 (never admitted), a row never ending (N tokens, truncated), left-padded prompts of
    2..6 tokens, min-p: equal to the static sampler; two samplers driven together (and a finished Rollout passed
    through) give what each gives alone."""
    gd, p, ids, mask = llama
    base = dict(max_new_tokens=23, pad_id=0, cache_bucket=8, temperature=0.8, min_p=0.02)
    key = jax.random.key(5)
    free = jax.device_get(generate(gd, p, ids, mask, key, SamplingConfig(**base), num_samples=g)).tokens
    stops, first, never = _stop_set(np.asarray(free))
    cfg = SamplingConfig(eos_id=stops, **base)
    ref = jax.device_get(generate(gd, p, ids, mask, key, cfg, num_samples=g))
    assert ref.lengths[first] == 1 and ref.truncated[never] and not ref.truncated.all(), ref.lengths
    out, stats = generate_slots(gd, p, ids, mask, key, cfg, num_samples=g, slots=slots)
    _assert_same(out, ref)
    assert stats["shared_prompts"] == (slots == 9), stats   # G 3 every row: row ``first``'s slot free from step 0
    other = launch(gd, p, ids[:2], mask[:2], jax.random.key(6), cfg, num_samples=g, slots=slots)
    st: list = []
    both = drive([launch(gd, p, ids, mask, key, cfg, num_samples=g, slots=slots), other, ref], st)
    alone, _ = generate_slots(gd, p, ids[:2], mask[:2], jax.random.key(6), cfg, num_samples=g, slots=slots)
    np.testing.assert_array_equal(both[0].tokens, out.tokens)
    np.testing.assert_array_equal(both[1].tokens, alone.tokens)
    assert both[2] is ref and st[2] is None and st[0] == stats


@pytest.mark.parametrize("family,attention", [("gemma3_text", "auto"), ("gpt2", "auto"), ("gemma3_text", "splash")],
                         ids=["gemma3", "gpt2", "gemma3_pages"])
def test_sliding_window_and_learned_positions(family, attention):
    """Gemma 3 (a sliding window of 5 on alternate layers, shorter than the rows: each slot's window ends at its own
    position) and GPT-2 (learned positions), greedy and sampled, S = 2 of 6 rows. ``splash`` (the TPU choice, its
    kernels interpreted here): the cache in the TPU kernel's pages layout, rows entering slots whose pages an
    earlier row wrote."""
    extra = dict(sliding_window=5) if family == "gemma3_text" else {}
    gd, p = _tiny(family, attention=attention, **extra)
    ids, mask = left_pad(PROMPTS, pad_id=0, length=8)
    for kw in (dict(greedy=True), dict(temperature=1.0)):
        cfg = SamplingConfig(max_new_tokens=17, pad_id=0, eos_id=(7, 19), cache_bucket=8, **kw)
        ref = jax.device_get(generate(gd, p, ids, mask, jax.random.key(2), cfg, num_samples=2))
        out, _ = generate_slots(gd, p, ids, mask, jax.random.key(2), cfg, num_samples=2, slots=2)
        _assert_same(out, ref)
        out, stats = generate_slots(gd, p, ids, mask, jax.random.key(2), cfg, num_samples=2)
        _assert_same(out, ref)   # every row: the heads layout shares each prompt's entries between its 2 slots
        assert stats["shared_prompts"] == (attention != "splash"), stats
    if attention == "splash":   # a free slot reads one page: 18 slots keep S (one rung in the round's program)
        assert paged_layout(gd, p)
        ref = jax.device_get(generate(gd, p, ids, mask, jax.random.key(5), cfg, num_samples=6))
        before = trace_count()
        out, stats = generate_slots(gd, p, ids, mask, jax.random.key(5), cfg, num_samples=6)
        assert stats["rungs"] == (18,) and trace_count() - before == 1 and Ladder().rungs(18) == (18, 8)
        _assert_same(out, ref)


def test_one_decode_program_whatever_the_lengths(llama):
    """After the first call, new keys (other lengths, other admission orders) and a fixed slot width compile
    nothing: one round program, traced once. A wider prompt bucket with the same ``width`` compiles nothing either
    (the prompts are left-padded to the width)."""
    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=30, pad_id=0, eos_id=(7, 19, 33), cache_bucket=8)
    generate_slots(g, p, ids, mask, jax.random.key(0), cfg, num_samples=2, slots=3, width=12)
    before, lengths = trace_count(), set()
    with CompileCounter() as cc:
        for r in range(1, 4):
            out, _ = generate_slots(g, p, ids, mask, jax.random.key(r), cfg, num_samples=2, slots=3,
                                    width=12)
            lengths.add(tuple(out.lengths.tolist()))
    assert len(lengths) == 3 and trace_count() == before and cc.programs == 0, (cc.programs, lengths)
    wide_ids, wide_mask = left_pad(PROMPTS, pad_id=0, length=12)
    ref = jax.device_get(generate(g, p, wide_ids, wide_mask, jax.random.key(9), cfg, num_samples=2))
    before = trace_count()
    out, _ = generate_slots(g, p, wide_ids, wide_mask, jax.random.key(9), cfg, num_samples=2, slots=3,
                            width=12)
    assert trace_count() == before   # padded to the width: the same program
    _assert_same(out, ref)
    with pytest.raises(ValueError, match="width"):
        generate_slots(g, p, wide_ids, wide_mask, jax.random.key(9), cfg, slots=3, width=8)


@pytest.mark.parametrize("n,shrink,g,slots", [(9, True, 4, None), (40, False, 4, None), (40, True, 12, None),
                                              (40, True, 4, 5)], ids=["short", "no_ladder", "moves", "queue"])
def test_a_round_is_one_program_call(llama, n, shrink, g, slots):
    """A round is one program call whatever it does -- one rung (a round of <= SHORT new tokens; a longer one
    without the ladder), moves down the ladder, a queue refilling fewer slots than rows --, read once at its end,
    and its tokens equal the static sampler's, rows ending at step 0 included; with a slot per row and one rung its
    decode steps and row-steps are the static sampler's."""
    from mrl_jax.sampler import rounds

    gd, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=n, pad_id=0, eos_id=(7, 19, 33), cache_bucket=8)
    key = jax.random.key(4)
    kw = dict(num_samples=g, slots=slots, shrink=shrink)
    generate_slots(gd, p, ids, mask, key, cfg, **kw)   # its program, memoised
    (name,) = [k for k in rounds._PROGRAMS if k[0] == graph_token(gd) and k[1] == cfg and k[2] == g and
               k[3][0] == (slots or 3 * g) and len(k[3]) == (3 if shrink and g == 12 else 1)]
    program, calls = rounds._PROGRAMS[name], []

    def counted(*a):
        calls.append(a)
        return program(*a)
    rounds._PROGRAMS[name] = counted
    try:
        out, stats = generate_slots(gd, p, ids, mask, key, cfg, **kw)
    finally:
        rounds._PROGRAMS[name] = program
    ref = jax.device_get(generate(gd, p, ids, mask, key, cfg, num_samples=g))
    _assert_same(out, ref)
    assert (ref.lengths == 1).any() and not ref.truncated.all()   # rows ending at step 0 and before N
    assert len(calls) == 1 and stats["rungs"] == ((36, 24, 12) if g == 12 else (slots or 12,)), (len(calls), stats)
    if slots is None and g == 4:
        assert stats["decode_steps"] == ref.lengths.max() - 1 and stats["row_steps"] == 12 * ref.lengths.max()


def test_a_round_hashes_no_graphdef_once_compiled(llama, monkeypatch):
    """Hashing a GraphDef walks the model's graph (~150 us at 2 layers, ~2 ms at 28): a round of a GraphDef seen
    before finds its program and layout by identity and hashes none (the static sampler's jit hashes it once per
    call); an equal GraphDef from a new split is hashed once, then found by identity too, with the same token."""
    from flax.nnx import graphlib

    gd, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33))
    key = jax.random.key(4)
    ref, _ = generate_slots(gd, p, ids, mask, key, cfg, num_samples=4)   # compiled, memoised
    again = nnx.split(nnx.merge(gd, p))[0]   # an equal GraphDef, another object
    assert again is not gd and again == gd
    hashes = []
    real = graphlib.GraphDef.__hash__

    def counted(self):
        hashes.append(1)
        return real(self)
    monkeypatch.setattr(graphlib.GraphDef, "__hash__", counted)
    out, _ = generate_slots(gd, p, ids, mask, key, cfg, num_samples=4)
    assert hashes == [] and np.array_equal(out.tokens, ref.tokens)
    assert graph_token(again) == graph_token(gd) and len(hashes) == 1
    generate_slots(again, p, ids, mask, key, cfg, num_samples=4)
    assert len(hashes) == 1


def test_a_free_slot_attends_over_one_entry(llama):
    """Once the queue is empty, a slot left free runs its step at position 0 (length 1: the TPU kernel reads one
    page of it, not the length of the row that left it); a live slot at its row's position. One step per call; the
    positions a step runs at are those the state carries into it (set by the step before, or the admit)."""
    from mrl_jax.sampler.slots import _advance, _busy, _start

    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=40, pad_id=0, eos_id=(7, 19, 33), temperature=1.0)
    prompts, st = _start(g, p, ids, mask, jax.random.key(21), cfg, num_samples=4, slots=5, width=8)
    step = jax.jit(lambda params, pr, s: _advance(nnx.merge(g, params), pr, s, cfg, 4, 2, None))
    plen, idle = np.asarray(mask).sum(-1), 0
    while bool(jax.jit(_busy)(prompts, st)):
        row, step_at, drained = np.asarray(st.row), np.asarray(st.step), int(st.taken) == int(prompts.queued)
        qpos = np.asarray(st.cache.qpos)
        st = step(p, prompts, st)
        if drained:   # nothing admitted at this step: the slots free before it stayed free through it
            idle += int((row < 0).sum())
            np.testing.assert_array_equal(qpos[row < 0], 0)
            live = row >= 0
            np.testing.assert_array_equal(qpos[live], plen[row[live] // 4] + step_at[live] - 1)
    assert idle > 0


def test_no_refill_where_no_row_can_queue(llama):
    """The decode loop refills free slots (a conditional admit before each step) only at the first rung with fewer
    slots than rows: with a slot per row, and at every rung below the first (reached with the queue empty), the
    step has no admit conditional to evaluate (the attention's switch over cache parts stays, the same at every
    rung). The sampler's round programs say which they run."""
    from mrl_jax.sampler import rounds

    g, p, ids, mask = llama
    cfg = SamplingConfig(max_new_tokens=41, pad_id=0, eos_id=(7, 19, 33), cache_bucket=16)   # N: this test's own
    key = jax.random.key(1)

    def conds(slots):   # conditionals in the round's program
        generate_slots(g, p, ids, mask, key, cfg, num_samples=12, slots=slots)
        (prog,) = [v for k, v in rounds._PROGRAMS.items()
                   if k[0] == graph_token(g) and k[1] == cfg and k[3] == Ladder().rungs(slots)]
        return str(jax.make_jaxpr(prog)(p, ids, mask, key)).count(" cond[")
    every_row, queued = conds(36), conds(24)   # rungs (36, 24, 12) and (24, 12)
    per_rung = every_row // 3
    assert every_row == 3 * per_rung and queued == 2 * per_rung + 1, (every_row, queued)


def test_on_a_mesh_equals_the_static_sampler_on_one_device(tmp_path):
    """On 4 forced CPU devices (3 prompts padded to 4, 12 rows in S = 5 -> 8 slots; FSDP-sharded params) and on 3
    (9 rows, 9 slots), under ``transfer_guard("disallow")``: the real rows' tokens equal the 1-device static
    sampler's, the slots are split over the devices, and a decode step's cache write moves no keys between them.
    On 2 devices 48 rows move down the ladder to 8 slots with the same tokens, no cache crossing devices."""
    import subprocess
    import sys
    from pathlib import Path

    import support
    import worker_result

    result = tmp_path / "slots.result.json"
    env = worker_result.env_for(dict(support.forced_devices_env(4), **support.compile_cache_env()), result)
    worker = Path(__file__).with_name("slots_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(worker.parents[1]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = worker_result.read(result, proc.stdout)
    assert r["devices"] == 4 and min(r["lengths"]) < 21 and max(r["lengths"]) > 8, r["lengths"]
    for d, c in r["cases"].items():
        assert c["tokens_equal"] and c["mask_equal"] and c["truncated_equal"], (d, c)
        assert c["logprob_diff"] <= 1e-5 and c["sampling_logprob_diff"] <= 1e-5, (d, c)
        assert c["slots"] % int(d) == 0 and c["slot_devices"] == int(d), (d, c)
        assert c["gathered_keys"] == 0, (d, c)   # each slot's cache write stays on its device
    assert r["cases"]["4"]["slots"] == 8 and r["cases"]["4"]["sharded_params"] > 0
    lad = r["ladder"]   # 48 rows on 2 devices: the tail moved to 8 slots, each device's rows within its own slots
    assert lad["rungs"] == [48, 32, 16, 8] and lad["tokens_equal"] and lad["mask_equal"], lad
    assert lad["logprob_diff"] <= 1e-5, lad
    assert lad["move_collectives"] == 0, lad


def test_sampling_slots_config_key():
    """``sampling.slots`` below 1, ``ladder_ratio`` outside (0, 1) and ``ladder_floor`` below 1 are one ConfigError
    naming the key; valid values reach the policy's sampler."""
    import support
    from mrl_jax.configs import ConfigError

    with pytest.raises(ConfigError, match=r"policies\[0\]\.sampling\.slots': must be >= 1"):
        support.to_run_config(support.tiny_config(**{"policies.0.sampling.slots": 0}))
    assert support.to_run_config(support.tiny_config(**{"policies.0.sampling.slots": 3})).policies[0].sampling.slots == 3
    for key, value, why in (("ladder_ratio", 1.0, r"must be in \(0, 1\)"), ("ladder_ratio", -0.5, r"must be in \(0, 1\)"),
                            ("ladder_floor", 0, "must be >= 1")):
        with pytest.raises(ConfigError, match=rf"policies\[0\]\.sampling\.{key}': {why}"):
            support.to_run_config(support.tiny_config(**{f"policies.0.sampling.{key}": value}))
    spec = support.to_run_config(support.tiny_config(**{"policies.0.sampling.ladder_ratio": 0.8,
                                                        "policies.0.sampling.ladder_floor": 2})).policies[0].sampling
    assert spec.ladder_shape == Ladder(0.8, 2)
