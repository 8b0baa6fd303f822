"""Answer verifiers of the dataset task: ``math_verify`` (default), ``gsm8k`` and ``exact``.

A verifier scores a completion against a reference answer: ``score(completion, gold) -> 0.0 | 1.0``, and
names the completion's answer for majority voting: ``answer_key(completion) -> str | None``. The gold
answer is parsed once per distinct answer text (an LRU cache in each process).

* ``math_verify`` -- Hugging Face's ``math-verify`` (as TRL's ``accuracy_reward``): the gold is parsed as
  LaTeX (``\\frac12``, ``\\sqrt{8}``, ``(1, 2]``, ``\\{1,2\\}``; a ``####`` line is read first, GSM8K style),
  the completion's ``\\boxed{}`` answer (several boxed answers are read as their set) or final-answer
  expression is parsed and compared symbolically.
* ``gsm8k`` -- the text after the last ``####`` (else the last number) compared numerically.
* ``exact`` -- the stripped completion equals the stripped gold.

Time limits. math-verify bounds its own parsing and comparison with ``signal.alarm``, which works only in a
process's main thread. Here its own limit is on exactly when the call runs in a main thread (a direct call
such as held-out evaluation, or a reward worker *process*) and off in any other thread. In training the
dataset task's accuracy reward runs with ``isolation="process"`` under ``reward_timeout_s`` (in the worker's
main thread math-verify's own 5 s limit applies too; whichever ends first decides): a pathological answer
(``\\boxed{9^{9^{9^{9^9}}}}``, on which sympy's comparison never ends) gets its worker process killed,
scores 0 and is counted as a timeout; a thread could not be stopped and would keep a core busy (and its
memory growing) for the rest of the run.
"""
from __future__ import annotations

import functools
import logging
import math
import threading
from typing import Any, Callable, NamedTuple

from .jsonl import extract_hash, extract_last_number, parse_number

__all__ = ["VERIFIERS", "Verifier", "get_verifier"]

#: seconds math-verify may spend on one parse / comparison when it runs in a main thread.
MATH_VERIFY_TIMEOUT_S = 5


class Verifier(NamedTuple):
    """``score(completion, gold) -> float`` in [0, 1]; ``answer_key(completion) -> str | None`` (for maj@K)."""

    name: str
    score: Callable[[str, str], float]
    answer_key: Callable[[str], "str | None"]


def _own_timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv():
    import math_verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)   # "timeout is disabled" notes off threads
    return math_verify


def _gold_text(gold: str) -> str:
    h = extract_hash(gold)
    text = (h if h is not None else gold).strip()
    if "\\boxed" in text or "$" in text:
        return text
    return f"${text}$"


@functools.lru_cache(maxsize=65536)
def _parse_gold(gold: str) -> tuple:
    mv = _mv()
    return tuple(mv.parse(_gold_text(gold), parsing_timeout=_own_timeout()))


def _parse_pred(completion: str) -> list:
    return _mv().parse(completion, parsing_timeout=_own_timeout())


def _math_verify_score(completion: str, gold: str) -> float:
    g = _parse_gold(gold)
    if not g:   # the gold is no expression math-verify reads: compare the texts
        return 1.0 if completion.strip() == gold.strip() else 0.0
    pred = _parse_pred(completion)
    return 1.0 if pred and _mv().verify(list(g), pred, timeout_seconds=_own_timeout()) else 0.0


def _math_verify_key(completion: str) -> str | None:
    pred = _parse_pred(completion)
    return str(pred[0]) if pred else None


def _gsm8k_answer(text: str) -> str | None:
    out = extract_hash(text)
    return out if out is not None else extract_last_number(text)


def _gsm8k_number(text: str | None) -> float | None:
    if text is None:
        return None
    v = parse_number(text)
    if v is None:
        first = extract_last_number(text)
        v = parse_number(first) if first is not None else None
    return v


def _gsm8k_score(completion: str, gold: str) -> float:
    a, b = _gsm8k_number(_gsm8k_answer(completion)), _gsm8k_number(_gsm8k_answer(gold))
    return 1.0 if a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) else 0.0


def _gsm8k_key(completion: str) -> str | None:
    v = _gsm8k_number(_gsm8k_answer(completion))
    return None if v is None else repr(float(v))


def _exact_score(completion: str, gold: str) -> float:
    return 1.0 if completion.strip() == gold.strip() else 0.0


def _exact_key(completion: str) -> str | None:
    return completion.strip() or None


VERIFIERS: dict[str, Verifier] = {
    "math_verify": Verifier("math_verify", _math_verify_score, _math_verify_key),
    "gsm8k": Verifier("gsm8k", _gsm8k_score, _gsm8k_key),
    "exact": Verifier("exact", _exact_score, _exact_key),
}


def get_verifier(name: str) -> Verifier:
    """The verifier called ``name`` (ValueError listing the choices otherwise)."""
    try:
        return VERIFIERS[name]
    except KeyError:
        raise ValueError(f"unknown verifier {name!r}; choose from {sorted(VERIFIERS)}") from None


class VerifierReward:
    """A picklable ``(prompt, completion) -> float`` reward: verifier ``name`` against ``prompt.answer``
    (what a reward worker process imports by reference)."""

    def __init__(self, name: str):
        self.name = get_verifier(name).name
        if self.name == "math_verify":
            _mv()   # imported when a worker process loads the reward, not inside the first timed call

    def __call__(self, prompt: Any, completion: str) -> float:
        return VERIFIERS[self.name].score(str(completion), prompt.answer)

    def __reduce__(self):
        return (VerifierReward, (self.name,))
