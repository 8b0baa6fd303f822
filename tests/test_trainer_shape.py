"""The trainer's shape (issue 13 item 6): the round loop is a generator with hooks at their cadence, a stop hook
ends it after saving, the constructor builds no state (no warm start) and a resume never calls
``initial_state``, the state template matches the initial state, and ``see.build_view`` takes a typed
alignment.

Updates are stubbed where only the loop is under test (no update compile); the tiny config and the module's
compile cache as in tests/test_trainer.py.
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import support  # noqa: E402
from mrl_jax import see as S  # noqa: E402
from mrl_jax.tasks import RewardScorer  # noqa: E402
from mrl_jax.trainer import Run, RoundInfo, Trainer, TrainingStopped, train  # noqa: E402
from mrl_jax.trainer import run as run_mod  # noqa: E402
from mrl_jax.trainer.checkpoint import RunCheckpointer  # noqa: E402
from mrl_jax.trainer.hooks import CheckpointHook, SkippedUpdatesStop  # noqa: E402

pytestmark = pytest.mark.usefixtures("jax_compile_cache")
SIGNAL = {"faulty": {"seed": 0, "p": {}}}


def _cfg(**overrides):
    return support.to_run_config(support.tiny_config(**{"policies.0.probes": "none", "policies.1.probes": "none",
                                                  **overrides}))


def _stub(pol, skipped: float = 0.0):
    """``pol`` with an update that leaves params as they are and reports ``skipped``, counting the skips in its
    optimizer state as the real update does (nothing compiled)."""
    def update(p, o, r, b, v, k, s):
        o = o._replace(notfinite_count=(o.notfinite_count + 1) * int(skipped > 0))
        return p, o, r, {"loss": jnp.zeros(()), "skipped": jnp.full((), skipped),
                         "skipped_in_a_row": o.notfinite_count.astype(jnp.float32)}

    return dataclasses.replace(pol, update=update)


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(support.reward_specs(SIGNAL)) as s:
        yield s


def test_hooks_fire_at_their_cadence_and_rounds_yield_each_round(scorer):
    run = Run(_cfg(rounds=5))
    trainer = Trainer(run, scorer, policies=[_stub(p) for p in run.policies])
    calls = {"every1": [], "every2": [], "every3_end": []}
    trainer.add_hook(lambda i: calls["every1"].append(i.round))
    trainer.add_hook(lambda i: calls["every2"].append(i.round), every=2)
    trainer.add_hook(lambda i: calls["every3_end"].append(i.round), every=3, at_end=True)
    infos = list(trainer.rounds(run.initial_state(), start=1))
    assert [i.round for i in infos] == [1, 2, 3, 4] and [i.last for i in infos] == [False] * 3 + [True]
    assert all(isinstance(i, RoundInfo) and set(i.metrics) == {p.name for p in run.policies} for i in infos)
    assert calls == {"every1": [1, 2, 3, 4], "every2": [1, 3], "every3_end": [2, 4]}
    assert infos[0].inputs.prompts == run.round_inputs(1).prompts
    with pytest.raises(ValueError, match="every >= 1"):
        trainer.add_hook(print, every=0)


def test_stop_hook_saves_then_ends_the_generator(scorer, tmp_path):
    run = Run(_cfg(rounds=6))
    ckpt = RunCheckpointer(tmp_path)
    save = CheckpointHook(ckpt)
    stop = SkippedUpdatesStop(2, save, tmp_path)
    pols = [_stub(p, skipped=float(p.index == 0)) for p in run.policies]
    trainer = Trainer(run, scorer, policies=pols, on_update=stop.recorder.record)
    trainer.add_hook(save, every=4, at_end=True)
    trainer.add_hook(stop)
    seen = []
    with pytest.raises(TrainingStopped, match=r"policies \['llama_bpe'\] skipped 2 updates.*round 1"):
        for info in trainer.rounds(run.initial_state()):
            seen.append(info.round)
    assert seen == [0]                                   # round 1's hooks stopped it before it was yielded
    assert ckpt.all_rounds() == [1]                      # saved first (off the every=4 cadence)
    assert (tmp_path / "failed_batch_llama_bpe_round1.npz").is_file()
    ckpt.close()


def test_constructor_warm_starts_nothing_and_resume_skips_initial_state(tmp_path, monkeypatch):
    calls = []
    real = run_mod.warm_start

    def spy(*args, **kw):
        calls.append(kw["learning_rate"])
        return real(*args, **kw)

    monkeypatch.setattr(run_mod, "warm_start", spy)
    cfg = _cfg(rounds=1, **{"policies.0.warm_start": {"steps": 2, "part": None, "learning_rate": 0.002}})
    run = Run(cfg)
    assert calls == []                                   # no SFT step in the constructor
    template = run.state_template()
    state = run.initial_state()
    assert calls == [0.002]                              # the config's warm start, policy 0 only
    for t, x in zip(jax.tree.leaves(template), jax.tree.leaves(state)):
        assert (t.shape, t.dtype) == (x.shape, x.dtype)
        if isinstance(t.sharding, jax.sharding.NamedSharding):
            assert t.sharding == x.sharding

    counted = []
    orig = Run.initial_state
    monkeypatch.setattr(Run, "initial_state", lambda self, *a: counted.append(1) or orig(self, *a))
    out = tmp_path / "r"
    train(cfg, out, reward_specs=support.reward_specs(SIGNAL), progress=False)
    assert counted == [1] and calls == [0.002, 0.002]
    train(dataclasses.replace(cfg, rounds=2), out, resume=True, reward_specs=support.reward_specs(SIGNAL),
          progress=False)
    assert counted == [1] and calls == [0.002, 0.002]   # the resume restored onto the template: no warm start


def test_a_run_composes_its_built_parts_and_a_policy_is_born_sized():
    """`build_parts` is a frozen value of the built pieces; `Run` composes it with the memory plan (none on a CPU
    without memory_gb): each policy born with its slot width (the drawn prompts' `prompt_width`) and the config's
    slots, its update the pinned one the parts built (never wrapped after)."""
    from mrl_jax.trainer.parts import build_parts, prompt_width

    cfg = _cfg(**{"policies.1.sampling": {"max_new_tokens": 6, "slots": 4}})
    parts = build_parts(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.widths = ()
    drawn = parts.prompts.drawn_texts()
    assert parts.widths == tuple(prompt_width(drawn, b.tokenizer, b.prompt_format, b.prompt_limit)
                                 for b in parts.policies)
    run = Run(cfg)
    assert run.memory is None and [p.slots for p in run.policies] == [None, 4]
    assert [p.slot_width for p in run.policies] == list(parts.widths)
    assert all(p.update is b.update for p, b in zip(run.policies, run.parts.policies))
    assert jax.tree.structure(run.state_template()) == jax.tree.structure(parts.state_template())


def _view_buffer():
    buf = S.init(16, 16, 8, num_policies=2, num_prompts=2, tau=1.0)
    exp = S.make_experience(["ab", "cde"], [0, 0], 1, [1.0, 0.0], src_ids=[[1, 2], [3, 4, 5]],
                            src_logp=[[-0.5, -0.25], [-1.0, -1.0, -1.0]], round=0, max_bytes=16, max_src_tokens=8)
    return jax.jit(S.add)(buf, exp)[0]


def test_build_view_takes_a_typed_alignment_and_rejects_a_dict():
    buf = _view_buffer()
    kw = dict(k_rollouts=2, max_completion_length=6, max_chunks=6)
    with pytest.raises(TypeError, match="see.ViewAlignment"):
        S.build_view(buf, 0, [0], lambda texts, srcs, ids: {"dst_ids": [list(i) for i in ids]}, **kw)
    with pytest.raises(ValueError, match="1 rows for 2 filled slots"):
        S.build_view(buf, 0, [0], lambda texts, srcs, ids: S.ViewAlignment.identity([ids[0]]), **kw)
    view = S.build_view(buf, 0, [0], lambda texts, srcs, ids: S.ViewAlignment.identity([list(i) for i in ids]), **kw)
    assert np.asarray(view.completion_ids)[:2].tolist() == [[1, 2, 0, 0, 0, 0], [3, 4, 5, 0, 0, 0]]
    np.testing.assert_allclose(np.asarray(view.src_chunk_logp)[0, :2], [-0.5, -0.25])


def test_view_alignment_from_batches_puts_each_source_s_rows_in_place():
    """Rows of two THL batches (different widths) land at their view rows, padded: -1 chunks, False validity."""
    from mrl_jax import thl
    from mrl_jax.tokenization import train_tokenizer

    corpus = ["the cat sat", "a dog ran far", "cats and dogs"] * 20
    bpe, uni = train_tokenizer("byte_bpe", corpus, 300), train_tokenizer("unigram", corpus, 300)
    texts = ["the cat", "a dog ran far", "cats"]
    a = thl.align_batch([texts[0], texts[2]], bpe, uni)
    b = thl.align_batch([texts[1]], uni, uni)
    va = S.ViewAlignment.from_batches(3, [(np.array([0, 2]), a), (np.array([1]), b)])
    assert va.num_rows == 3 and va.dst_lengths.tolist() == [a.dst_lengths[0], b.dst_lengths[0], a.dst_lengths[1]]
    for row, (src, k) in enumerate([(a, 0), (b, 0), (a, 1)]):
        n = int(src.dst_lengths[k])
        assert va.dst_ids[row, :n].tolist() == src.dst_ids[k, :n].tolist()
        w = src.src_chunk.shape[1]
        assert va.src_chunk[row, :w].tolist() == src.src_chunk[k].tolist() and (va.src_chunk[row, w:] == -1).all()
        c = src.chunk_valid.shape[1]
        assert va.chunk_valid[row, :c].tolist() == src.chunk_valid[k].tolist() and not va.chunk_valid[row, c:].any()


def test_rows_of_the_consumer_s_tokenization_keep_their_sampled_ids_and_the_others_go_through_thl(monkeypatch):
    """The round's aligner: a source with the consumer's tokenization (the consumer itself; a second load of
    the same tokenizer) shares its ids as sampled, even when they are not what encoding the text gives, and
    costs no THL call; a source with another tokenizer gets exactly ``thl.align_batch``'s rows."""
    import types

    from mrl_jax import thl
    from mrl_jax.tokenization import Tokenizer, train_tokenizer
    from mrl_jax.trainer.round import PhaseTimer, _aligner

    corpus = ["the cat sat", "a dog ran far", "cats and dogs"] * 20
    bpe, uni = train_tokenizer("byte_bpe", corpus, 300), train_tokenizer("unigram", corpus, 300)
    bpe_again = Tokenizer(type(bpe.hf).from_str(bpe.hf.to_str()), name="other", bos_id=bpe.bos_id,
                          eos_id=bpe.eos_id, pad_id=bpe.pad_id)
    assert bpe_again is not bpe and bpe_again.fingerprint == bpe.fingerprint != uni.fingerprint
    # "the cat" sampled one byte-token at a time: not the encoding of its text
    spelled = [t for ch in "the cat" for t in bpe.encode(ch, continuation=True)]
    assert spelled != bpe.encode("the cat", continuation=True)
    texts = ["the cat", "a dog ran far", "cats", "the cat"]
    src_ids = [spelled, uni.encode(texts[1], continuation=True), bpe.encode("cats", continuation=True), spelled]
    pols = [types.SimpleNamespace(tokenizer=t) for t in (bpe, uni, bpe_again)]
    calls, metrics, real = [], [], thl.align_batch
    monkeypatch.setattr(thl, "align_batch", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    va = _aligner(pols[0], pols, 16, metrics, PhaseTimer())(texts, [0, 1, 0, 2], src_ids)
    assert calls == [(uni, bpe)] and len(metrics) == 1            # one THL call: the unigram peer
    for row in (0, 2, 3):                                           # own rows and the same-tokenization peer
        n = len(src_ids[row])
        assert va.dst_lengths[row] == n and va.dst_ids[row, :n].tolist() == list(src_ids[row])
        assert va.dst_chunk[row, :n].tolist() == list(range(n)) == va.src_chunk[row, :n].tolist()
        assert va.chunk_valid[row, :n].all() and not va.chunk_valid[row, n:].any()
    ba = real([texts[1]], uni, bpe, [src_ids[1]], max_chunks=16)
    n = int(ba.dst_lengths[0])
    assert va.dst_ids[1, :n].tolist() == ba.dst_ids[0, :n].tolist() and va.dst_lengths[1] == n
    assert va.chunk_valid[1, :16].tolist() == ba.chunk_valid[0].tolist()


def test_phase_timer_counts_an_inner_phase_once(monkeypatch):
    """views 0..10 s holds two thl alignments of 2 s and 3 s: views 5 s, thl 5 s, the phases add up to the
    10 s of wall time; a phase that did not run is reported as 0."""
    from mrl_jax.trainer import round as round_mod

    clock = iter([0.0, 1.0, 3.0, 4.0, 7.0, 10.0])
    monkeypatch.setattr(round_mod.time, "perf_counter", lambda: next(clock))
    timer = round_mod.PhaseTimer(("views", "thl", "update"))
    with timer("views"):
        with timer("thl"):
            pass
        with timer("thl"):
            pass
    assert timer.times == {"views": 5.0, "thl": 5.0, "update": 0.0}


def test_round_metrics_split_views_from_thl(tmp_path):
    """Every round reports every phase (round-level wall times, the same in each policy's row); a consumer
    with peers spends part of the views phase in THL, counted under ``thl`` only."""
    cfg = support.to_run_config(support.tiny_config(rounds=2, **{"policies.0.probes": "prp", "policies.1.probes": "none"}))
    from mrl_jax.trainer.round import ROUND_PHASES

    train(cfg, tmp_path / "run", progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert {r["round"] for r in rows} == {0, 1} and len(rows) == 4
    for r in rows:
        assert all(r[f"time/{p}"] >= 0.0 for p in ROUND_PHASES)
        assert r["time/thl"] > 0.0 and r["time/views"] > 0.0   # round-level phases: the prp consumer aligns
