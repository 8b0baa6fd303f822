"""Reward API: plain Python callables, weighted, isolated and time-limited per call.

A reward function is any callable ``fn(prompt: Prompt, completion: str) -> float``, or, with
``RewardSpec(batched=True)``, ``fn(prompts, completions) -> list`` called on lists of ``batch_size`` items (the
whole batch by default; how TRL calls a reward function, what config ``rewards:`` functions get). Wrap it in a
:class:`RewardSpec` (weight, name, per-call time limit, isolation, valid range) and score batches with
a :class:`RewardScorer` (or the one-shot :func:`score_batch`). The batch reward is the weighted *sum*
``sum_k weight_k * r_k`` (as TRL's ``reward_weights``).

Batched calls. A call on n items is limited to n x ``timeout_s``; one that raises, runs past that, or returns no
list of n values is retried item by item (lists of one), so one bad completion scores 0 alone and counts as one
failure, as it would called per item; each returned value is validated on its own.

Isolation. Every call runs in a worker and is time-limited; a failure never stops the batch:

* ``isolation="thread"`` (default; also what :func:`task_reward` uses for the built-in verifiers --
  the fast path: no process, no pickling, ~2 us per call). One persistent daemon worker thread per
  reward calls it item after item; the caller watches the start time of the current item, and when it
  exceeds ``timeout_s`` the item scores 0 as a timeout, the worker is *abandoned* (Python cannot kill a
  thread; it exits on its own if the call ever returns) and a fresh worker continues with the next item.
  Good for pure-Python code that may be slow or hang in ``sleep``/I/O. A CPU-bound infinite loop in an
  abandoned thread keeps competing for the GIL: after ``max_abandoned_threads`` live abandoned threads
  the scorer raises :class:`RewardFailure` advising ``isolation="process"``.
* ``isolation="process"``: ``num_workers`` worker processes started with the ``spawn`` (or
  ``forkserver``) method -- safe with JAX's threads, unlike ``fork``. The function is pickled *by
  reference*, so it must be importable (defined at module level, not a lambda/closure); the usual
  multiprocessing rule applies to scripts (guard the entry point with ``if __name__ == "__main__"``).
  Items stream through a pipe; a call that runs past its limit gets its process killed and replaced.
  A crashed process (segfault, ``os._exit``) counts as an error for the item it was running.

Validation. A call that raises (``errors``), runs past its limit (``timeouts``), returns a non-number
(``bad_type``; e.g. a string, None, an array with more than one element), NaN/inf (``nonfinite``), or a
value outside ``[low, high]`` (``out_of_range``) scores 0 and is counted in the stats as
``reward/<name>/<kind>``; the first ``max_failure_samples`` messages of the batch are kept in
``reward/<name>/failure_samples``. When one reward function fails on more than
``max_consecutive_failures`` consecutive calls (counted across batches by a scorer) the scorer raises
:class:`RewardFailure` with a summary, instead of training on garbage.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import numpy as np

from ._reward_runners import _ProcessRunner, _ThreadRunner
from .base import Prompt, Task
from .reward_spec import Completion, RewardFailure, RewardSpec

__all__ = [
    "FAILURE_KINDS",
    "RewardFailure",
    "RewardScorer",
    "RewardSpec",
    "ScoreResult",
    "score_batch",
    "task_reward",
]

#: failure categories, as they appear in the stats keys ``reward/<name>/<kind>``.
FAILURE_KINDS = ("errors", "timeouts", "nonfinite", "bad_type", "out_of_range")


def task_reward(task: Task, *, weight: float = 1.0, timeout_s: float = 1.0, name: str | None = None) -> RewardSpec:
    """The built-in verifier of ``task`` as a reward (time-limited, range [0, 1]): ``task.reward_fn`` in
    ``task.reward_isolation`` where the task sets them (the dataset task: math-verify in worker processes),
    else ``task.verify`` on the thread fast path."""
    return RewardSpec(getattr(task, "reward_fn", task.verify), weight=weight, name=name or task.name,
                      timeout_s=timeout_s, isolation=getattr(task, "reward_isolation", "thread"))


def gate_success(rewards: np.ndarray, accuracy: np.ndarray | None, tau: float) -> np.ndarray:
    """f32[B] rewards whose ``>= tau`` test (SEE's success) agrees with the verifier's ``accuracy >= tau``: a row
    the verifier passes is raised to at least ``tau``, a row it fails is lowered just below ``tau``; rows where
    both agree (all of them when ``accuracy`` is None) are unchanged. So a format bonus never makes a wrong
    answer a shared success or a rescue target."""
    r = np.asarray(rewards, np.float32)
    if accuracy is None:
        return r
    ok = np.asarray(accuracy, np.float32) >= tau
    below = np.nextafter(np.float32(tau), np.float32(-np.inf))
    return np.where(ok, np.maximum(r, np.float32(tau)), np.minimum(r, below)).astype(np.float32)


class ScoreResult(NamedTuple):
    """rewards: f32[B] weighted sum (None values left out); per_function: f32[B, K] raw values (0 on failure,
    NaN for None); stats: dict; accuracy: f32[B] of the ``success`` function, or None when no spec is one."""

    rewards: np.ndarray
    per_function: np.ndarray
    stats: dict
    accuracy: np.ndarray | None = None


# -------------------------------------------------------------------------------------- scorer
class _Tally:
    __slots__ = ("counts", "samples", "consecutive")

    def __init__(self):
        self.counts = dict.fromkeys(FAILURE_KINDS, 0)
        self.samples: list[str] = []
        self.consecutive = 0


class RewardScorer:
    """Scores batches with several weighted reward functions, isolated and time-limited.

    Holds the workers and the consecutive-failure counters across batches; close it (or use it as a
    context manager) to stop the workers.

    Args:
      specs: the reward functions (names must be unique).
      max_consecutive_failures: raise :class:`RewardFailure` when one function fails on more than this many
        consecutive calls (None: never).
      max_failure_samples: failure messages kept per function and batch.
      mp_context: start method for ``isolation="process"`` ("spawn" or "forkserver").
      startup_timeout_s: limit for a worker process to start (imports included).
      max_abandoned_threads: live abandoned (hung) threads per function before :class:`RewardFailure`.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        *,
        max_consecutive_failures: int | None = 64,
        max_failure_samples: int = 5,
        mp_context: str = "spawn",
        startup_timeout_s: float = 120.0,
        max_abandoned_threads: int = 16,
    ):
        specs = list(specs)
        if not specs:
            raise ValueError("RewardScorer needs at least one RewardSpec")
        for s in specs:
            if not isinstance(s, RewardSpec):
                raise TypeError(f"expected RewardSpec, got {type(s).__name__} (wrap functions in RewardSpec(fn))")
        names = [s.name for s in specs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward names must be unique, got duplicates {dup}; pass name= to RewardSpec")
        if sum(s.success for s in specs) > 1:
            raise ValueError("at most one RewardSpec may have success=True (the task's verifier)")
        if mp_context not in ("spawn", "forkserver"):
            raise ValueError("mp_context must be 'spawn' or 'forkserver' ('fork' is unsafe with JAX threads)")
        if max_consecutive_failures is not None and max_consecutive_failures < 0:
            raise ValueError("max_consecutive_failures must be >= 0 or None")
        self.specs = specs
        self.weights = np.asarray([s.weight for s in specs], np.float32)
        self.max_consecutive_failures = max_consecutive_failures
        self.max_failure_samples = int(max_failure_samples)
        self.max_abandoned_threads = int(max_abandoned_threads)
        self._runners = [
            _ProcessRunner(s, mp_context, startup_timeout_s) if s.isolation == "process" else _ThreadRunner(s)
            for s in specs
        ]
        self._consecutive = [0] * len(specs)
        #: cumulative failure counts per function over the scorer's life: {name: {kind: count}}.
        self.totals = {s.name: dict.fromkeys(FAILURE_KINDS, 0) for s in specs}
        self._pending: dict[str, tuple[dict, str]] = {}   # failures since the last take_failures()
        self._closed = False

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str],
              completion_ids: Sequence[Sequence[int]] | None = None) -> ScoreResult:
        """Score ``completions[i]`` for ``prompts[i]`` with every function; see :class:`ScoreResult`.
        ``completion_ids``: the token ids of each completion, handed to the functions as ``completion.ids``."""
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        B = len(prompts)
        if len(completions) != B:
            raise ValueError(f"score: {B} prompts but {len(completions)} completions")
        if completion_ids is not None:
            if len(completion_ids) != B:
                raise ValueError(f"score: {B} completions but {len(completion_ids)} completion_ids")
            completions = [Completion(c, ids) for c, ids in zip(completions, completion_ids)]
        K = len(self.specs)
        per = np.zeros((B, K), np.float32)
        stats: dict[str, Any] = {}
        t_all = time.perf_counter()
        for k, (spec, runner) in enumerate(zip(self.specs, self._runners)):
            values = [0.0] * B
            tally = _Tally()
            tally.consecutive = self._consecutive[k]
            limit = self.max_consecutive_failures
            n_samples = self.max_failure_samples

            def record(pos, kind, val, msg, values=values, tally=tally):
                if kind == "ok":
                    values[pos] = val
                    tally.consecutive = 0
                    return True
                tally.counts[kind] += 1
                tally.consecutive += 1
                if len(tally.samples) < n_samples:
                    pid = getattr(prompts[pos], "id", pos)
                    tally.samples.append(f"[{kind}] item {pos} (prompt id {pid}): {msg}")
                return limit is None or tally.consecutive <= limit

            t0 = time.perf_counter()
            completed = runner.run(prompts, completions, record)
            dt = time.perf_counter() - t0
            self._consecutive[k] = tally.consecutive
            for kind, c in tally.counts.items():
                self.totals[spec.name][kind] += c
            if any(tally.counts.values()):
                kinds, first = self._pending.get(spec.name, (dict.fromkeys(FAILURE_KINDS, 0), tally.samples[0]))
                self._pending[spec.name] = ({k: kinds[k] + tally.counts[k] for k in FAILURE_KINDS}, first)
            per[:, k] = values
            pre = f"reward/{spec.name}/"
            col = per[:, k][~np.isnan(per[:, k])]
            stats[pre + "mean"] = float(col.mean()) if col.size else 0.0
            stats[f"rewards/{spec.name}/mean"] = stats[pre + "mean"]
            stats[f"rewards/{spec.name}/std"] = float(col.std()) if col.size else 0.0
            for kind in FAILURE_KINDS:
                stats[pre + kind] = tally.counts[kind]
            stats[pre + "failures"] = sum(tally.counts.values())
            stats[pre + "time_s"] = dt
            stats[pre + "failure_samples"] = list(tally.samples)
            if not completed:
                raise RewardFailure(self._failure_message(spec, tally))
            hung = runner.live_abandoned()
            stats[pre + "hung_threads"] = hung
            if hung > self.max_abandoned_threads:
                raise RewardFailure(
                    f"reward {spec.name!r} left {hung} hung worker threads (calls that never returned after "
                    f"their {spec.timeout_s} s limit); use RewardSpec(isolation='process') so hung calls can be "
                    f"killed. Failures: {tally.samples[:3]}"
                )
        rewards = np.nansum(per * self.weights, axis=1).astype(np.float32)
        stats["reward/mean"] = float(rewards.mean()) if B else 0.0
        stats["reward/std"] = float(rewards.std()) if B else 0.0
        stats["reward/time_s"] = time.perf_counter() - t_all
        acc = [k for k, s in enumerate(self.specs) if s.success]
        return ScoreResult(rewards, per, stats, np.nan_to_num(per[:, acc[0]]) if acc else None)

    def take_failures(self) -> dict[str, tuple[dict, str]]:
        """``{function name: ({kind: count}, first failure message)}`` of the failed calls since the last
        call (functions without failures left out); forgets them."""
        out, self._pending = self._pending, {}
        return out

    def _failure_message(self, spec: RewardSpec, tally: _Tally) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in tally.counts.items() if v)
        samples = "\n  ".join(tally.samples) or "(none kept)"
        return (
            f"reward function {spec.name!r} failed on {tally.consecutive} consecutive calls "
            f"(limit {self.max_consecutive_failures}: config key max_reward_failures); failures in this batch: "
            f"{counts}. "
            f"A reward must return a finite float in [{spec.low}, {spec.high}] within {spec.timeout_s} s. "
            f"First failures:\n  {samples}"
        )

    def close(self) -> None:
        """Stop the worker threads/processes (idempotent)."""
        if not self._closed:
            self._closed = True
            for r in self._runners:
                r.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


def score_batch(
    specs: Sequence[RewardSpec] | RewardScorer,
    prompts: Sequence[Prompt],
    completions: Sequence[str],
    **scorer_kwargs: Any,
) -> tuple[np.ndarray, dict]:
    """``(rewards: f32[B], stats)`` for one batch.

    ``specs`` is a :class:`RewardScorer` (workers and consecutive-failure counters persist across batches
    -- what a training loop should use) or a sequence of :class:`RewardSpec` (a temporary scorer is built
    with ``scorer_kwargs`` and closed; counters then span this batch only).
    """
    if isinstance(specs, RewardScorer):
        if scorer_kwargs:
            raise TypeError("score_batch: scorer options go to RewardScorer(...), not to score_batch")
        res = specs.score(prompts, completions)
        return res.rewards, res.stats
    with RewardScorer(specs, **scorer_kwargs) as scorer:
        res = scorer.score(prompts, completions)
    return res.rewards, res.stats
