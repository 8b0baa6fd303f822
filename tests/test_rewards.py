"""Reward API: isolation, time limits, validation, weights, failure threshold (mrl_jax.tasks.rewards)."""
import math
import os
import time

import numpy as np
import pytest

from mrl_jax.tasks import (
    Prompt,
    RewardFailure,
    RewardScorer,
    RewardSpec,
    default_mixture,
    score_batch,
    task_reward,
)

B = 12
PROMPTS = [Prompt(id=100 + i, text=f"copy:{'ab'[i % 2] * (i % 4 + 1)}=", answer="ab"[i % 2] * (i % 4 + 1),
                  task="copy") for i in range(B)]
# even items right, odd items wrong; item 3 triggers the misbehaviour of the bad functions
COMPLETIONS = [p.answer if i % 2 == 0 else "zz" for i, p in enumerate(PROMPTS)]
TRIGGER = 3
EXPECTED = np.array([1.0 if i % 2 == 0 else 0.0 for i in range(B)], np.float32)


# Module level so that isolation="process" can pickle them by reference.
def exact(prompt, completion):
    return float(completion.strip() == prompt.answer)


def raises_on_trigger(prompt, completion):
    if prompt.id == 100 + TRIGGER:
        raise ZeroDivisionError("boom")
    return exact(prompt, completion)


def hangs_on_trigger(prompt, completion):
    if prompt.id == 100 + TRIGGER:
        time.sleep(5.0)
    return exact(prompt, completion)


def hangs_long_on_trigger(prompt, completion):
    if prompt.id == 100 + TRIGGER:
        time.sleep(60.0)
    return exact(prompt, completion)


def nan_on_trigger(prompt, completion):
    return math.nan if prompt.id == 100 + TRIGGER else exact(prompt, completion)


def string_on_trigger(prompt, completion):
    return "1.0" if prompt.id == 100 + TRIGGER else exact(prompt, completion)


def crashes_on_trigger(prompt, completion):
    if prompt.id == 100 + TRIGGER:
        os._exit(3)
    return exact(prompt, completion)


def always_raises(prompt, completion):
    raise ValueError("reward server unreachable")


def _expected_with_trigger_zero():
    e = EXPECTED.copy()
    e[TRIGGER] = 0.0
    return e


def test_isolation_threads_every_failure_kind_counted():
    specs = [
        RewardSpec(exact, name="exact"),
        RewardSpec(raises_on_trigger, name="raises"),
        RewardSpec(hangs_on_trigger, name="hangs", timeout_s=0.5),
        RewardSpec(nan_on_trigger, name="nan"),
        RewardSpec(string_on_trigger, name="string"),
    ]
    completions = list(COMPLETIONS)
    completions[TRIGGER] = PROMPTS[TRIGGER].answer  # the triggered item would be right: failures zero it
    expected = EXPECTED.copy()
    expected[TRIGGER] = 1.0
    with RewardScorer(specs) as scorer:
        t0 = time.perf_counter()
        res = scorer.score(PROMPTS, completions)
        elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"a hung reward blocked the batch for {elapsed:.1f} s"
    np.testing.assert_array_equal(res.per_function[:, 0], expected)
    for k in range(1, 5):  # every other item of the misbehaving functions is scored right
        want = expected.copy()
        want[TRIGGER] = 0.0
        np.testing.assert_array_equal(res.per_function[:, k], want, err_msg=specs[k].name)
    np.testing.assert_allclose(res.rewards, res.per_function.sum(1))
    s = res.stats
    assert s["reward/exact/failures"] == 0
    assert s["reward/raises/errors"] == 1 and s["reward/raises/failures"] == 1
    assert s["reward/hangs/timeouts"] == 1 and s["reward/hangs/failures"] == 1
    assert s["reward/nan/nonfinite"] == 1 and s["reward/nan/failures"] == 1
    assert s["reward/string/bad_type"] == 1 and s["reward/string/failures"] == 1
    assert "ZeroDivisionError: boom" in s["reward/raises/failure_samples"][0]
    assert f"prompt id {100 + TRIGGER}" in s["reward/raises/failure_samples"][0]
    assert "0.5 s limit" in s["reward/hangs/failure_samples"][0]
    assert "str" in s["reward/string/failure_samples"][0]


def test_value_validation_types_and_range():
    def various(prompt, completion):
        return {0: np.float32(0.25), 1: True, 2: 1.5, 3: -0.1, 4: None, 5: np.array([0.5]),
                6: np.array([1.0, 0.0]), 7: math.inf, 8: 1}.get(prompt.id - 100, 0.0)

    rewards, stats = score_batch([RewardSpec(various)], PROMPTS[:9], COMPLETIONS[:9])
    np.testing.assert_allclose(rewards, [0.25, 1.0, 0, 0, 0, 0.5, 0, 0, 1.0])
    assert stats["reward/various/out_of_range"] == 2
    assert stats["reward/various/bad_type"] == 2
    assert stats["reward/various/nonfinite"] == 1
    # a custom range admits negative values
    rewards, stats = score_batch([RewardSpec(various, low=-1.0, high=2.0)], PROMPTS[:4], COMPLETIONS[:4])
    np.testing.assert_allclose(rewards, [0.25, 1.0, 1.5, -0.1], rtol=1e-6)


def test_weights_combine_as_weighted_sum():
    def half(prompt, completion):
        return 0.5

    specs = [RewardSpec(exact, weight=2.0), RewardSpec(half, weight=-0.5, name="penalty")]
    rewards, stats = score_batch(specs, PROMPTS, COMPLETIONS)
    assert rewards.dtype == np.float32 and rewards.shape == (B,)
    np.testing.assert_allclose(rewards, 2.0 * EXPECTED - 0.25)
    assert stats["reward/exact/mean"] == pytest.approx(EXPECTED.mean())
    assert stats["reward/penalty/mean"] == pytest.approx(0.5)
    assert stats["reward/mean"] == pytest.approx(float(np.mean(2.0 * EXPECTED - 0.25)))


def test_always_failing_raises_reward_failure_after_threshold():
    with RewardScorer([RewardSpec(exact), RewardSpec(always_raises)], max_consecutive_failures=5) as scorer:
        res = scorer.score(PROMPTS[:4], COMPLETIONS[:4])  # 4 consecutive failures: still allowed
        assert res.stats["reward/always_raises/errors"] == 4
        with pytest.raises(RewardFailure) as ei:
            scorer.score(PROMPTS[:4], COMPLETIONS[:4])  # the 6th consecutive failure crosses the threshold
    msg = str(ei.value)
    assert "always_raises" in msg and "6 consecutive" in msg and "reward server unreachable" in msg
    assert scorer.totals["always_raises"]["errors"] == 6
    # one-shot score_batch: counting within the batch
    with pytest.raises(RewardFailure):
        score_batch([RewardSpec(always_raises)], PROMPTS, COMPLETIONS, max_consecutive_failures=3)

    # a success resets the count
    def fails_but_item0(prompt, completion):
        if prompt.id == 100:
            return 1.0
        raise RuntimeError("x")

    with RewardScorer([RewardSpec(fails_but_item0)], max_consecutive_failures=B - 1) as scorer:
        for _ in range(3):
            scorer.score(PROMPTS, COMPLETIONS)


def test_builtin_verifier_fast_path_512_under_50ms():
    task = default_mixture(seed=0)
    prompts = task.sample_train(512, np.random.default_rng(0))
    completions = [p.answer if i % 3 else " wrong" for i, p in enumerate(prompts)]
    with RewardScorer([task_reward(task)]) as scorer:
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            res = scorer.score(prompts, completions)
            best = min(best, time.perf_counter() - t0)
    assert best < 0.05, f"scoring 512 completions took {best * 1e3:.1f} ms"
    np.testing.assert_array_equal(res.rewards, [1.0 if i % 3 else 0.0 for i in range(512)])
    assert res.stats["reward/default/failures"] == 0


def test_process_isolation_kills_hangs_and_survives_crashes():
    specs = [
        RewardSpec(hangs_long_on_trigger, name="hangs", timeout_s=0.5, isolation="process"),
        RewardSpec(crashes_on_trigger, name="crashes", isolation="process"),
        RewardSpec(raises_on_trigger, name="raises", isolation="process", num_workers=2),
    ]
    with RewardScorer(specs, startup_timeout_s=60) as scorer:
        res = scorer.score(PROMPTS, COMPLETIONS)
        want = _expected_with_trigger_zero()
        for k in range(3):
            np.testing.assert_array_equal(res.per_function[:, k], want, err_msg=specs[k].name)
        s = res.stats
        assert s["reward/hangs/timeouts"] == 1 and s["reward/crashes/errors"] == 1 and s["reward/raises/errors"] == 1
        assert s["reward/hangs/time_s"] < 30  # the hung process was killed, not waited for (60 s sleep)
        assert "worker process died" in s["reward/crashes/failure_samples"][0]
        assert "ZeroDivisionError" in s["reward/raises/failure_samples"][0]
        # the replaced workers keep serving
        res2 = scorer.score(PROMPTS[:2], COMPLETIONS[:2])
        np.testing.assert_array_equal(res2.rewards, 3 * EXPECTED[:2])
    with pytest.raises(ValueError, match="pickled"):
        RewardScorer([RewardSpec(lambda p, c: 1.0, name="lam", isolation="process")])


def test_spec_and_scorer_validation():
    with pytest.raises(ValueError, match="unique"):
        RewardScorer([RewardSpec(exact), RewardSpec(exact)])
    with pytest.raises(ValueError, match="isolation"):
        RewardSpec(exact, isolation="fork")
    with pytest.raises(ValueError, match="completions"):
        score_batch([RewardSpec(exact)], PROMPTS, COMPLETIONS[:3])
    assert task_reward(default_mixture()).name == "default"
