"""pass@k, maj@K and the population metrics (mrl_jax.trainer.evaluation_metrics)."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mrl_jax.trainer.evaluation_metrics import (k_values, maj_at_k, pass_at_k, pass_at_k_per_prompt, population_metrics,
                                sample_metrics, transfer_matrix)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_pass_at_k_equals_brute_force_over_k_subsets(samples, data):
    n = len(samples)
    k = data.draw(st.integers(1, n))
    subsets = list(itertools.combinations(range(n), k))
    brute = np.mean([any(samples[i] for i in s) for s in subsets])
    got = pass_at_k_per_prompt(n, np.array([sum(samples)]), k)[0]
    assert got == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_table_and_bounds():
    correct = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    assert pass_at_k(correct, 1) == pytest.approx((0.25 + 0 + 1) / 3)
    assert pass_at_k(correct, 2) == pytest.approx((0.5 + 0 + 1) / 3)     # 1 - C(3,2)/C(4,2) = 0.5
    assert pass_at_k(correct, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        pass_at_k(correct, 5)
    assert k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    m = sample_metrics(correct, [["a", "b", "b", "c"]] * 3)
    assert set(m) == {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4"} and m["avg@4"] == pytest.approx(5 / 12)


def test_maj_at_k_votes_and_ties():
    correct = np.array([[0, 1, 1, 0],      # "x" twice (wrong), "y" twice (right): tie -> "x" came first
                        [0, 1, 1, 0],      # tie again, "y" first -> sample 0 -> wrong
                        [0, 0, 1, 1],      # "a" once, None, "b" twice -> "b" (right)
                        [1, 0, 0, 0]], bool)   # no answer at all -> wrong
    answers = [["x", "y", "y", "x"], ["y", "x", "x", "y"], ["a", None, "b", "b"], [None] * 4]
    # row 1: tie between "y" (first at 0, sample 0 wrong) and "x" (first at 1) -> "y" wins, sample 0 is wrong
    assert maj_at_k(correct, answers) == pytest.approx(1 / 4)
    answers[1] = ["x", "y", "y", "x"]
    correct[1] = [1, 0, 0, 1]
    assert maj_at_k(correct, answers) == pytest.approx(2 / 4)


def test_population_pass_at_k_two_policies():
    a = np.array([[1, 0], [0, 0], [0, 0], [1, 1]], bool)
    b = np.array([[0, 0], [1, 1], [0, 0], [1, 0]], bool)
    pop = population_metrics({"a": a, "b": b})
    # pass@1 per prompt: a = [.5, 0, 0, 1], b = [0, 1, 0, .5]; any = 1 - (1-a)(1-b) = [.5, 1, 0, 1]
    assert pop["pass@1"] == pytest.approx(2.5 / 4)
    assert pop["pass@2"] == pytest.approx(3 / 4)
    # solved: a = [1, 0, 0, 1], b = [0, 1, 0, 1]; (i, j): j solves and i does not
    np.testing.assert_allclose(pop["transfer"], [[0, 0.25], [0.25, 0]])
    np.testing.assert_allclose(transfer_matrix([a, a]), np.zeros((2, 2)))
    assert pop["policies"] == ["a", "b"]
