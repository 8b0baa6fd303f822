"""Arithmetic task: ``add`` / ``sub`` / ``mul`` of two operands with a fixed number of digits.

Prompt text ``"{op}:{a}{sym}{b}="`` (e.g. ``"add:12+7="`` ... with ``digits=2`` both operands have two
digits: ``"add:12+47="``), answer ``str(result)`` (e.g. ``"59"``). ``sub`` orders the operands so the
result is non-negative. Difficulty = ``digits`` in 1..4 (answers are at most 8 characters).
"""
from __future__ import annotations

import numpy as np

from .base import ID_BLOCK, Prompt, Task, _check_id_base, task_rng

__all__ = ["ArithmeticTask", "ARITH_OPS"]

ARITH_OPS = ("add", "sub", "mul")
_SYMBOL = {"add": "+", "sub": "-", "mul": "*"}
_ENUMERATE_LIMIT = 200_000


class ArithmeticTask(Task):
    """Two-operand integer arithmetic with exact verification.

    Args:
      op: "add", "sub" or "mul".
      digits: number of digits of each operand, 1..4 (``digits=1`` draws from 0..9).
      n_train, n_eval: numbers of distinct train and held-out operand pairs. Defaults:
        ``n_eval = min(200, U // 5)``, ``n_train = min(2000, U - n_eval)`` with U the number of distinct pairs.
      seed: the split and sampling are a pure function of ``(seed, name)``.
      name: task name (default ``f"{op}{digits}"``).
      id_base: first prompt id (default: a fixed block per ``(op, digits)``).
    """

    def __init__(
        self,
        op: str = "add",
        digits: int = 2,
        *,
        n_train: int | None = None,
        n_eval: int | None = None,
        seed: int = 0,
        name: str | None = None,
        id_base: int | None = None,
    ):
        if op not in ARITH_OPS:
            raise ValueError(f"ArithmeticTask: op must be one of {ARITH_OPS}, got {op!r}")
        if not 1 <= int(digits) <= 4:
            raise ValueError(f"ArithmeticTask: digits must be in 1..4, got {digits}")
        self.op, self.digits, self.seed = op, int(digits), int(seed)
        self.name = name or f"{op}{self.digits}"
        self.lo = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        self.hi = 10**self.digits  # exclusive
        m = self.hi - self.lo
        universe = m * (m + 1) // 2 if op == "sub" else m * m
        self.n_eval = min(200, universe // 5) if n_eval is None else int(n_eval)
        self.n_train = min(2000, universe - self.n_eval) if n_train is None else int(n_train)
        if self.n_train < 1 or self.n_eval < 0 or self.n_train + self.n_eval > universe:
            raise ValueError(
                f"ArithmeticTask {self.name!r}: n_train={self.n_train} + n_eval={self.n_eval} must be positive "
                f"and at most the {universe} distinct operand pairs"
            )
        if self.n_train + self.n_eval > ID_BLOCK:
            raise ValueError(f"ArithmeticTask {self.name!r}: at most {ID_BLOCK} prompts")
        self.id_base = (1 + ARITH_OPS.index(op) * 4 + self.digits - 1) * ID_BLOCK if id_base is None else int(id_base)
        _check_id_base(self.id_base, self.n_train + self.n_eval, self.name)

    def _pairs(self, n: int) -> list[tuple[int, int]]:
        rng = task_rng(self.seed, self.name)
        m = self.hi - self.lo
        if m * m <= _ENUMERATE_LIMIT:
            a, b = np.meshgrid(np.arange(self.lo, self.hi), np.arange(self.lo, self.hi), indexing="ij")
            a, b = a.ravel(), b.ravel()
            if self.op == "sub":
                keep = a >= b
                a, b = a[keep], b[keep]
            order = rng.permutation(len(a))[:n]
            return [(int(a[i]), int(b[i])) for i in order]
        seen: set[tuple[int, int]] = set()
        out: list[tuple[int, int]] = []
        while len(out) < n:
            ab = rng.integers(self.lo, self.hi, size=(2 * (n - len(out)) + 16, 2))
            for x, y in ab.tolist():
                if self.op == "sub" and x < y:
                    x, y = y, x
                if (x, y) not in seen:
                    seen.add((x, y))
                    out.append((x, y))
                    if len(out) == n:
                        break
        return out

    def _make(self, idx: int, a: int, b: int, split: str) -> Prompt:
        result = a + b if self.op == "add" else a - b if self.op == "sub" else a * b
        return Prompt(
            id=self.id_base + idx,
            text=f"{self.op}:{a}{_SYMBOL[self.op]}{b}=",
            answer=str(result),
            task=self.name,
            meta={"op": self.op, "digits": self.digits, "a": a, "b": b, "split": split},
        )

    def _build(self):
        pairs = self._pairs(self.n_train + self.n_eval)
        train = [self._make(i, a, b, "train") for i, (a, b) in enumerate(pairs[: self.n_train])]
        ev = [self._make(self.n_train + i, a, b, "eval") for i, (a, b) in enumerate(pairs[self.n_train :])]
        return train, ev
