"""Reward API: plain Python callables, weighted, isolated and time-limited per call.

A reward function is any callable ``fn(prompt: Prompt, completion: str) -> float``. Wrap it in a
:class:`RewardSpec` (weight, name, per-call time limit, isolation, valid range) and score batches with
a :class:`RewardScorer` (or the one-shot :func:`score_batch`). The batch reward is the weighted *sum*
``sum_k weight_k * r_k`` (as TRL's ``reward_weights``).

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

import collections
import math
import multiprocessing
import multiprocessing.connection
import numbers
import pickle
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from .base import Prompt, Task

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
_ISOLATIONS = ("thread", "process")

RewardFn = Callable[[Prompt, str], Any]


class RewardFailure(RuntimeError):
    """A reward function failed systematically (or its worker could not start); training must stop."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward function and how to call it.

    Attributes:
      fn: ``fn(prompt, completion) -> float``.
      weight: multiplier in the weighted sum of rewards (may be negative, e.g. a penalty).
      name: stats name (default: the function's ``__name__``); unique within a scorer.
      timeout_s: per-call time limit in seconds (None: no limit -- not recommended).
      isolation: "thread" or "process" (see the module docstring).
      low, high: valid range of the returned value; outside it the call scores 0 (``out_of_range``).
      num_workers: worker processes for ``isolation="process"`` (a batch is split between them).
    """

    fn: RewardFn
    weight: float = 1.0
    name: str | None = None
    timeout_s: float | None = 5.0
    isolation: str = "thread"
    low: float = 0.0
    high: float = 1.0
    num_workers: int = 1

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
        if self.isolation not in _ISOLATIONS:
            raise ValueError(f"RewardSpec {self.name!r}: isolation must be one of {_ISOLATIONS}, got {self.isolation!r}")
        if not self.low <= self.high:
            raise ValueError(f"RewardSpec {self.name!r}: need low <= high, got [{self.low}, {self.high}]")
        if int(self.num_workers) < 1:
            raise ValueError(f"RewardSpec {self.name!r}: num_workers must be >= 1")


def task_reward(task: Task, *, weight: float = 1.0, timeout_s: float = 1.0, name: str | None = None) -> RewardSpec:
    """The built-in verifier of ``task`` as a reward (thread fast path, time-limited, range [0, 1])."""
    return RewardSpec(task.verify, weight=weight, name=name or task.name, timeout_s=timeout_s, isolation="thread")


class ScoreResult(NamedTuple):
    """rewards: f32[B] weighted sum; per_function: f32[B, K] raw values (0 on failure); stats: dict."""

    rewards: np.ndarray
    per_function: np.ndarray
    stats: dict


# ------------------------------------------------------------------------------------ validation
def _short(v: Any, n: int = 60) -> str:
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 -- a broken __repr__ must not break scoring
        r = f"<{type(v).__name__}>"
    return r if len(r) <= n else r[: n - 3] + "..."


def _classify(v: Any, low: float, high: float) -> tuple[str, float, str | None]:
    """``(kind, value, message)``: kind "ok" or one of FAILURE_KINDS."""
    t = type(v)
    try:
        if t is float or t is int or t is bool:
            f = float(v)
        elif isinstance(v, (numbers.Real, np.bool_)):
            f = float(v)
        elif hasattr(v, "__array__") and getattr(v, "size", None) == 1 and getattr(v, "ndim", 9) <= 1:
            a = np.asarray(v)
            if a.dtype.kind not in "biuf":
                return "bad_type", 0.0, f"returned an array of dtype {a.dtype}; expected a float"
            f = float(a.reshape(()))
        else:
            return "bad_type", 0.0, f"returned {t.__name__} {_short(v)}; expected a float"
    except OverflowError:
        return "out_of_range", 0.0, f"returned {_short(v)}, too large for a float"
    if f != f or f == math.inf or f == -math.inf:
        return "nonfinite", 0.0, f"returned {f}"
    if f < low or f > high:
        return "out_of_range", 0.0, f"returned {f}, outside [{low}, {high}]"
    return "ok", f, None


def _format_exc(e: BaseException) -> str:
    where = ""
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        fr = tb[-1]
        where = f" (at {fr.filename.rsplit('/', 1)[-1]}:{fr.lineno})"
    msg = f"{type(e).__name__}: {e}"
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return msg + where


def _call(fn: RewardFn, prompt: Any, completion: Any, low: float, high: float) -> tuple[str, float, str | None]:
    try:
        return _classify(fn(prompt, completion), low, high)
    except BaseException as e:  # noqa: BLE001 -- isolate everything, including SystemExit
        return "errors", 0.0, _format_exc(e)


# Record callback: record(pos, kind, value, message) -> keep going?
Record = Callable[[int, str, float, "str | None"], bool]


# ---------------------------------------------------------------------------------- thread runner
class _Job:
    __slots__ = ("fn", "prompts", "completions", "start", "low", "high", "record",
                 "state", "finished", "abandoned", "stopped", "lock", "done")

    def __init__(self, fn, prompts, completions, start, low, high, record):
        self.fn, self.prompts, self.completions = fn, prompts, completions
        self.start, self.low, self.high, self.record = start, low, high, record
        self.state = (start, time.perf_counter())  # (position being called, its start time)
        self.finished = start  # positions < finished are recorded
        self.abandoned = self.stopped = False
        self.lock = threading.Lock()
        self.done = threading.Event()


def _thread_worker_main(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, prompts, completions, low, high = job.fn, job.prompts, job.completions, job.low, job.high
        for pos in range(job.start, len(prompts)):
            job.state = (pos, time.perf_counter())
            kind, val, msg = _call(fn, prompts[pos], completions[pos], low, high)
            with job.lock:
                if job.abandoned:
                    return  # the caller timed this call out and replaced this thread
                job.finished = pos + 1
                if not job.record(pos, kind, val, msg):
                    job.stopped = True
                    break
        job.done.set()


class _ThreadRunner:
    def __init__(self, spec: RewardSpec):
        self.spec = spec
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._abandoned: list[threading.Thread] = []

    def live_abandoned(self) -> int:
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        return len(self._abandoned)

    def _ensure_worker(self) -> None:
        if self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=_thread_worker_main, args=(self._queue,), daemon=True, name=f"reward-{self.spec.name}"
            )
            self._thread.start()

    def run(self, prompts: Sequence, completions: Sequence, record: Record) -> bool:
        """Score every item; False when ``record`` asked to stop. Timeouts are recorded here."""
        n, start, timeout = len(prompts), 0, self.spec.timeout_s
        while start < n:
            self._ensure_worker()
            job = _Job(self.spec.fn, prompts, completions, start, self.spec.low, self.spec.high, record)
            self._queue.put(job)
            while True:
                st = job.state
                if timeout is None:
                    job.done.wait()
                    break
                remaining = st[1] + timeout - time.perf_counter()
                if job.done.wait(max(remaining, 5e-4)):
                    break
                if job.state is not st or time.perf_counter() < st[1] + timeout:
                    continue
                with job.lock:
                    if job.finished != st[0]:
                        continue  # it returned just in time
                    job.abandoned = True
                    self._abandoned.append(self._thread)
                    self._thread = self._queue = None
                    keep_going = record(st[0], "timeouts", 0.0, f"call exceeded the {timeout:g} s limit")
                if not keep_going:
                    return False
                start = st[0] + 1
                break
            if job.done.is_set():
                return not job.stopped
        return True

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
        self._thread = self._queue = None


# --------------------------------------------------------------------------------- process runner
def _process_worker_main(conn, payload: bytes, low: float, high: float) -> None:
    try:
        fn = pickle.loads(payload)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", f"could not load the reward function in the worker process: {_format_exc(e)}"))
        return
    conn.send(("ready",))
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):
            return
        if items is None:
            return
        for pos, prompt, completion in items:
            kind, val, msg = _call(fn, prompt, completion, low, high)
            conn.send((pos, kind, val, msg))


class _Worker:
    __slots__ = ("proc", "conn", "pending", "t0")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.pending: collections.deque = collections.deque()
        self.t0 = 0.0


class _ProcessRunner:
    def __init__(self, spec: RewardSpec, mp_context: str, startup_timeout_s: float):
        self.spec = spec
        try:
            self._payload = pickle.dumps(spec.fn)
        except Exception as e:  # noqa: BLE001
            raise ValueError(
                f"reward {spec.name!r} uses isolation='process' but its function cannot be pickled by reference "
                f"({type(e).__name__}: {e}); define it at module level (not a lambda or closure) or use "
                "isolation='thread'"
            ) from None
        self._ctx = multiprocessing.get_context(mp_context)
        self._startup_timeout_s = startup_timeout_s
        self._workers: list[_Worker | None] = [None] * int(spec.num_workers)

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_process_worker_main,
            args=(child, self._payload, self.spec.low, self.spec.high),
            daemon=True,
            name=f"reward-{self.spec.name}",
        )
        proc.start()
        child.close()
        w = _Worker(proc, parent)
        msg = None
        if parent.poll(self._startup_timeout_s):
            try:
                msg = parent.recv()
            except (EOFError, OSError):
                msg = None
        if msg != ("ready",):
            proc.join(0.5)
            code = proc.exitcode
            self._kill(w)
            if isinstance(msg, tuple) and msg and msg[0] == "fatal":
                detail = msg[1]
            elif code is not None:
                detail = (
                    f"it exited with code {code} while starting (see its stderr; a script that starts workers "
                    "must guard its entry point with `if __name__ == '__main__':`)"
                )
            else:
                detail = f"no 'ready' within {self._startup_timeout_s:g} s"
            raise RewardFailure(f"reward {self.spec.name!r}: worker process failed to start: {detail}")
        return w

    @staticmethod
    def _kill(w: _Worker) -> None:
        try:
            w.proc.kill()
            w.proc.join(2.0)
        except Exception:  # noqa: BLE001
            pass
        try:
            w.conn.close()
        except Exception:  # noqa: BLE001
            pass

    def _send(self, k: int, positions: list[int], prompts, completions) -> None:
        w = self._workers[k]
        if w is None or not w.proc.is_alive():
            if w is not None:
                self._kill(w)
            w = self._workers[k] = self._spawn()
        w.pending = collections.deque(positions)
        w.conn.send([(p, prompts[p], completions[p]) for p in positions])
        w.t0 = time.perf_counter()

    def _replace(self, k: int, prompts, completions) -> None:
        w = self._workers[k]
        rest = list(w.pending)
        self._kill(w)
        self._workers[k] = None
        if rest:
            self._send(k, rest, prompts, completions)

    def run(self, prompts: Sequence, completions: Sequence, record: Record) -> bool:
        n = len(prompts)
        if n == 0:
            return True
        nw = min(len(self._workers), n)
        bounds = np.linspace(0, n, nw + 1).astype(int)
        active: set[int] = set()
        for k in range(nw):
            self._send(k, list(range(bounds[k], bounds[k + 1])), prompts, completions)
            active.add(k)
        timeout = self.spec.timeout_s
        try:
            while active:
                now = time.perf_counter()
                wait_s = None if timeout is None else max(0.0, min(self._workers[k].t0 for k in active) + timeout - now)
                conns = {self._workers[k].conn: k for k in active}
                for conn in multiprocessing.connection.wait(list(conns), timeout=wait_s):
                    k = conns[conn]
                    w = self._workers[k]
                    try:
                        pos, kind, val, msg = conn.recv()
                    except (EOFError, OSError):
                        w.proc.join(1.0)
                        pos = w.pending.popleft()
                        code = w.proc.exitcode
                        self._replace(k, prompts, completions)
                        if not record(pos, "errors", 0.0, f"worker process died (exit code {code})"):
                            return False
                    else:
                        w.pending.popleft()
                        w.t0 = time.perf_counter()
                        if not record(pos, kind, val, msg):
                            return False
                    if self._workers[k] is None or not self._workers[k].pending:
                        active.discard(k)
                if timeout is not None:
                    now = time.perf_counter()
                    for k in list(active):
                        w = self._workers[k]
                        if now >= w.t0 + timeout and not w.conn.poll():
                            pos = w.pending.popleft()
                            self._replace(k, prompts, completions)
                            if not record(pos, "timeouts", 0.0, f"call exceeded the {timeout:g} s limit; worker killed"):
                                return False
                            if self._workers[k] is None or not self._workers[k].pending:
                                active.discard(k)
            return True
        finally:
            for k in active:  # stopped early: drop workers that still hold work
                if self._workers[k] is not None:
                    self._kill(self._workers[k])
                    self._workers[k] = None

    def live_abandoned(self) -> int:
        return 0

    def close(self) -> None:
        for k, w in enumerate(self._workers):
            if w is None:
                continue
            try:
                w.conn.send(None)
                w.proc.join(0.5)
            except Exception:  # noqa: BLE001
                pass
            if w.proc.is_alive():
                self._kill(w)
            else:
                w.conn.close()
            self._workers[k] = None


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
        self._closed = False

    def score(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> ScoreResult:
        """Score ``completions[i]`` for ``prompts[i]`` with every function; see :class:`ScoreResult`."""
        if self._closed:
            raise RuntimeError("RewardScorer is closed")
        B = len(prompts)
        if len(completions) != B:
            raise ValueError(f"score: {B} prompts but {len(completions)} completions")
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
            per[:, k] = values
            pre = f"reward/{spec.name}/"
            stats[pre + "mean"] = float(per[:, k].mean()) if B else 0.0
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
        rewards = per @ self.weights if K > 1 else per[:, 0] * self.weights[0]
        rewards = rewards.astype(np.float32)
        stats["reward/mean"] = float(rewards.mean()) if B else 0.0
        stats["reward/std"] = float(rewards.std()) if B else 0.0
        stats["reward/time_s"] = time.perf_counter() - t_all
        return ScoreResult(rewards, per, stats)

    def _failure_message(self, spec: RewardSpec, tally: _Tally) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in tally.counts.items() if v)
        samples = "\n  ".join(tally.samples) or "(none kept)"
        return (
            f"reward function {spec.name!r} failed on {tally.consecutive} consecutive calls "
            f"(max_consecutive_failures={self.max_consecutive_failures}); failures in this batch: {counts}. "
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
