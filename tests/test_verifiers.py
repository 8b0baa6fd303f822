"""Verifiers of the dataset task: a table of math-verify cases, GSM8K's ####, exact; the time limit."""
import threading

import pytest

pytest.importorskip("math_verify")

from mrl_jax.tasks import Prompt, RewardScorer, RewardSpec  # noqa: E402
from mrl_jax.tasks import verifiers  # noqa: E402
from mrl_jax.tasks.verifiers import VerifierReward, get_verifier  # noqa: E402

B = "\\boxed"
# (completion, gold, expected)
MATH_CASES = [
    (f"so {B}{{\\frac{{1}}{{2}}}}", "0.5", 1.0),
    (f"{B}{{0.5}}", "\\frac12", 1.0),
    (f"{B}{{\\dfrac{{3}}{{4}}}}", "0.75", 1.0),
    (f"{B}{{0.33}}", "\\frac{1}{3}", 0.0),
    (f"{B}{{\\frac{{2}}{{4}}}}", "\\frac{1}{2}", 1.0),
    (f"{B}{{2\\sqrt{{2}}}}", "\\sqrt{8}", 1.0),
    (f"{B}{{\\sqrt{{3}}}}", "\\sqrt{2}", 0.0),
    (f"{B}{{\\frac{{\\sqrt{{3}}}}{{2}}}}", "\\frac{\\sqrt3}{2}", 1.0),
    (f"{B}{{(1, 2]}}", "(1,2]", 1.0),
    (f"{B}{{[1,2]}}", "(1,2]", 0.0),
    (f"{B}{{(-\\infty, 3)}}", "(-\\infty,3)", 1.0),
    (f"{B}{{\\{{1,2,3\\}}}}", "\\{3,2,1\\}", 1.0),
    (f"{B}{{\\{{1,2\\}}}}", "\\{1,2,3\\}", 0.0),
    (f"{B}{{5 \\text{{ cm}}}}", "5", 1.0),
    (f"{B}{{12\\text{{ dollars}}}}", "12", 1.0),
    (f"{B}{{\\boxed{{7}}}}", "7", 1.0),
    (f"first {B}{{3}} then {B}{{4}}", "4", 0.0),   # several boxed answers are read as their set {3, 4}
    (f"first {B}{{3}} then {B}{{4}}", "\\{3,4\\}", 1.0),
    (f"{B}{{{{(2)}}}}", "2", 1.0),
    ("The final answer is 42", "42", 1.0),
    ("The final answer is 41", "42", 0.0),
    (f"{B}{{x=3}}", "3", 1.0),
    (f"{B}{{1,000}}", "1000", 1.0),
    (f"{B}{{50\\%}}", "50", 1.0),
    (f"{B}{{3}}", "4", 0.0),
    (f"{B}{{-7}}", "-7", 1.0),
    (f"{B}{{7}}", "-7", 0.0),
    (f"{B}{{\\pi}}", "\\pi", 1.0),
    (f"{B}{{2\\pi r}}", "2 \\pi r", 1.0),
    (f"{B}{{x^2+2x+1}}", "(x+1)^2", 1.0),
    (f"{B}{{1.5}}", "\\frac{3}{2}", 1.0),
    (f"{B}{{3/2}}", "1.5", 1.0),
    ("I cannot solve it.", "5", 0.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("reasoning...\n#### 71", "He sold 72.\n#### 72", 0.0),
    (f"{B}{{72}}", "She had 48/2 = 24 more.\n#### 72", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", MATH_CASES)
def test_math_verify_table(completion, gold, expected):
    assert get_verifier("math_verify").score(completion, gold) == expected


GSM8K_CASES = [
    ("48/2 = 24\n#### 72", "Natalia ...\n#### 72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### $18.00", "18", 1.0),
    ("the answer is 5 apples", "5", 1.0),
    ("#### 72\nthen 73", "72", 1.0),
    ("#### 7", "72", 0.0),
    ("no number", "3", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", GSM8K_CASES)
def test_gsm8k_table(completion, gold, expected):
    assert get_verifier("gsm8k").score(completion, gold) == expected


def test_exact_and_answer_keys():
    ex = get_verifier("exact")
    assert ex.score("  abc \n", "abc") == 1.0 and ex.score("ab c", "abc") == 0.0
    mv = get_verifier("math_verify")
    assert mv.answer_key(f"{B}{{0.5}}") == mv.answer_key(f"{B}{{\\frac12}}")
    assert mv.answer_key("nothing here") is None
    assert get_verifier("gsm8k").answer_key("#### 1,000") == get_verifier("gsm8k").answer_key("1000.0")
    with pytest.raises(ValueError, match="choose from"):
        get_verifier("sympy")


HANG = f"{B}{{9^{{9^{{9^{{9^{{9}}}}}}}}}}"


def test_pathological_answer_cut_in_main_thread(monkeypatch):
    """In a main thread math-verify's own alarm stops the comparison: 0, promptly."""
    monkeypatch.setattr(verifiers, "MATH_VERIFY_TIMEOUT_S", 1)
    assert threading.current_thread() is threading.main_thread()
    assert get_verifier("math_verify").score(HANG, "3") == 0.0


def test_pathological_answer_killed_and_counted_in_worker_process():
    """Under the scorer (process isolation, as the dataset task's accuracy runs) the call is cut at the
    reward limit (below math-verify's own 5 s), counted as a timeout, and the batch goes on with a fresh worker."""
    prompts = [Prompt(i, f"q{i}", "3", "t") for i in range(3)]
    spec = RewardSpec(VerifierReward("math_verify"), name="acc", timeout_s=2.0, isolation="process")
    with RewardScorer([spec]) as scorer:
        res = scorer.score(prompts, [f"{B}{{3}}", HANG, f"{B}{{\\frac{{6}}{{2}}}}"])
    assert res.per_function[:, 0].tolist() == [1.0, 0.0, 1.0]
    assert res.stats["reward/acc/timeouts"] == 1 and res.stats["reward/acc/failures"] == 1
