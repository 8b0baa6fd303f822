"""What a reward function is, as the scorer and the config builders share it (a leaf: imports only
`mrl_jax.tasks.base`): ``RewardSpec`` (a function and how to call it), ``Completion`` (text with its token ids)
and ``RewardFailure``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .base import Prompt, Task

RewardFn = Callable[[Prompt, str], Any]
#: a batched reward: ``fn(prompts: list[Prompt], completions: list[Completion]) -> list`` (one value per item)
BatchRewardFn = Callable[[list, list], Sequence]
ISOLATIONS = ("thread", "process")


class RewardFailure(RuntimeError):
    """A reward function failed systematically (or its worker could not start); training must stop."""


class Completion(str):
    """A completion text that also carries its token ids (``.ids``), as the scorer hands it to rewards."""

    def __new__(cls, text: str, ids: Sequence[int] | None = None):
        out = super().__new__(cls, text)
        out.ids = None if ids is None else [int(t) for t in ids]
        return out

    def __reduce__(self):
        return (Completion, (str(self), self.ids))


@dataclass(frozen=True)
class RewardSpec:
    """One reward function and how to call it.

    Attributes:
      fn: ``fn(prompt, completion) -> float``, or with ``batched`` ``fn(prompts, completions) -> list`` (one
        value per item, as TRL calls a reward function).
      weight: multiplier in the weighted sum of rewards (may be negative, e.g. a penalty).
      name: stats name (default: the function's ``__name__``); unique within a scorer.
      timeout_s: per-call time limit in seconds (None: no limit -- not recommended).
      isolation: "thread" or "process" (see the module docstring).
      low, high: valid range of the returned value; outside it the call scores 0 (``out_of_range``).
      num_workers: worker processes for ``isolation="process"`` (a batch is split between them).
      allow_none: a None return means "not applicable" (TRL): the value is NaN, left out of the weighted sum
        and of this function's mean/std, and not a failure.
      batched: ``fn`` takes lists of ``batch_size`` items; a call that raises, returns no list of one value per
        item, or runs past ``timeout_s`` times its item count is retried item by item (lists of one), so one bad
        completion scores as it would alone and its failure is counted once.
      batch_size: items per batched call (None: every item of the batch, or of a worker process's share).
      success: this function is the task's verifier: its value (not the weighted sum) decides a verified
        success (``ScoreResult.accuracy``; at most one per scorer).
    """

    fn: RewardFn | BatchRewardFn
    weight: float = 1.0
    name: str | None = None
    timeout_s: float | None = 5.0
    isolation: str = "thread"
    low: float = 0.0
    high: float = 1.0
    num_workers: int = 1
    allow_none: bool = False
    batched: bool = False
    batch_size: int | None = None
    success: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"RewardSpec.fn must be callable, got {type(self.fn).__name__}")
        if self.name is None:
            fn = self.fn
            name = getattr(fn, "__name__", None) or type(fn).__name__
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, Task):
                name = owner.name
            object.__setattr__(self, "name", name)
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"RewardSpec.name must be a non-empty string without '/', got {self.name!r}")
        if not math.isfinite(float(self.weight)):
            raise ValueError(f"RewardSpec {self.name!r}: weight must be finite, got {self.weight}")
        if self.timeout_s is not None and not float(self.timeout_s) > 0:
            raise ValueError(f"RewardSpec {self.name!r}: timeout_s must be > 0 or None, got {self.timeout_s}")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"RewardSpec {self.name!r}: isolation must be one of {ISOLATIONS}, got {self.isolation!r}")
        if not self.low <= self.high:
            raise ValueError(f"RewardSpec {self.name!r}: need low <= high, got [{self.low}, {self.high}]")
        if int(self.num_workers) < 1:
            raise ValueError(f"RewardSpec {self.name!r}: num_workers must be >= 1")
        if self.batch_size is not None and not (type(self.batch_size) is int and self.batch_size >= 1):
            raise ValueError(f"RewardSpec {self.name!r}: batch_size must be an int >= 1 or None, got {self.batch_size!r}")


__all__ = ["BatchRewardFn", "Completion", "ISOLATIONS", "RewardFailure", "RewardFn", "RewardSpec"]
