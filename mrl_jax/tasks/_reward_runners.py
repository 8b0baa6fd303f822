"""Where reward calls run (see :mod:`mrl_jax.tasks.rewards`): each call validated, in a persistent worker thread or
in spawned worker processes, time-limited per call."""
from __future__ import annotations

import collections
import math
import multiprocessing
import multiprocessing.connection
import numbers
import pickle
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from .reward_spec import RewardFailure, RewardFn, RewardSpec


# ------------------------------------------------------------------------------------ validation
def _short(v: Any, n: int = 60) -> str:
    try:
        r = repr(v)
    except Exception:  # noqa: BLE001 -- a broken __repr__ must not break scoring
        r = f"<{type(v).__name__}>"
    return r if len(r) <= n else r[: n - 3] + "..."


def _classify(v: Any, low: float, high: float, allow_none: bool = False) -> tuple[str, float, str | None]:
    """``(kind, value, message)``: kind "ok" or one of FAILURE_KINDS; an allowed None is "ok" with NaN."""
    if v is None and allow_none:
        return "ok", math.nan, None
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


def _call(fn: RewardFn, prompt: Any, completion: Any, low: float, high: float,
          allow_none: bool = False) -> tuple[str, float, str | None]:
    try:
        return _classify(fn(prompt, completion), low, high, allow_none)
    except BaseException as e:  # noqa: BLE001 -- isolate everything, including SystemExit
        return "errors", 0.0, _format_exc(e)


Result = tuple[str, float, "str | None"]   # (kind, value, message), as `_classify` gives it


def _call_unit(spec: RewardSpec, prompts: Sequence, completions: Sequence, unit: Sequence[int]) -> list[Result] | None:
    """The results of the items at positions ``unit``: one call of a batched ``fn`` on lists of them, else
    ``fn(prompt, completion)`` per item. None when a batched call of several items failed as a whole (raised or
    returned no list of one value per item): the caller retries them one by one."""
    fn, low, high, none = spec.fn, spec.low, spec.high, spec.allow_none
    if not spec.batched:
        return [_call(fn, prompts[p], completions[p], low, high, none) for p in unit]
    try:
        out = fn([prompts[p] for p in unit], [completions[p] for p in unit])
        if not isinstance(out, (list, tuple)) or len(out) != len(unit):
            raise TypeError(f"returned {_short(out)}; expected a list of {len(unit)} values, one per completion")
    except BaseException as e:  # noqa: BLE001 -- isolate everything, including SystemExit
        return None if len(unit) > 1 else [("errors", 0.0, _format_exc(e))]
    return [_classify(v, low, high, none) for v in out]


def units_of(spec: RewardSpec, positions: Sequence[int]) -> list[list[int]]:
    """``positions`` cut into the calls ``spec`` makes: one per item, or ``spec.batch_size`` items per call."""
    size = (spec.batch_size or max(len(positions), 1)) if spec.batched else 1
    return [list(positions[i:i + size]) for i in range(0, len(positions), size)]


def unit_limit(spec: RewardSpec, unit: Sequence[int]) -> float | None:
    """The time limit of a call on ``unit``: ``timeout_s`` per item."""
    return None if spec.timeout_s is None else spec.timeout_s * len(unit)


# Record callback: record(pos, kind, value, message) -> keep going?
Record = Callable[[int, str, float, "str | None"], bool]


# ---------------------------------------------------------------------------------- thread runner
class _Job:
    """The calls left of one batch: ``units`` (lists of positions) in order; ``state`` is ``(unit, start time)`` of
    the call running, None once the job ended."""
    __slots__ = ("spec", "prompts", "completions", "record", "units", "state", "abandoned", "stopped", "lock",
                 "done")

    def __init__(self, spec, prompts, completions, units, record):
        self.spec, self.prompts, self.completions, self.record = spec, prompts, completions, record
        self.units = collections.deque(units)
        self.state = (self.units.popleft(), time.perf_counter())
        self.abandoned = self.stopped = False
        self.lock = threading.Lock()
        self.done = threading.Event()


def _thread_worker_main(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        while True:
            unit = job.state[0]
            results = _call_unit(job.spec, job.prompts, job.completions, unit)
            with job.lock:
                if job.abandoned:
                    return  # the caller timed this call out and replaced this thread
                if results is None:
                    job.units.extendleft([p] for p in reversed(unit))
                else:
                    for pos, (kind, val, msg) in zip(unit, results):
                        if not job.record(pos, kind, val, msg):
                            job.stopped = True
                            break
                if job.stopped or not job.units:
                    job.state = None
                    break
                job.state = (job.units.popleft(), time.perf_counter())
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
        """Score every item; False when ``record`` asked to stop. Timeouts are recorded here: a batched call past
        its limit is retried item by item, an item's call scores a timeout."""
        units = units_of(self.spec, range(len(prompts)))
        while units:
            self._ensure_worker()
            job = _Job(self.spec, prompts, completions, units, record)
            self._queue.put(job)
            units = []
            while True:
                st = job.state
                limit = None if st is None else unit_limit(self.spec, st[0])
                if limit is None:
                    job.done.wait()
                    break
                if job.done.wait(max(st[1] + limit - time.perf_counter(), 5e-4)):
                    break
                with job.lock:
                    if job.state is not st:
                        continue  # it returned just in time
                    job.abandoned = True
                    self._abandoned.append(self._thread)
                    self._thread = self._queue = None
                    unit, units = st[0], list(job.units)
                    if len(unit) > 1:
                        units[:0] = [[p] for p in unit]
                    elif not record(unit[0], "timeouts", 0.0, f"call exceeded the {limit:g} s limit"):
                        return False
                break
            if job.done.is_set():
                return not job.stopped
        return True

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)
        self._thread = self._queue = None


# --------------------------------------------------------------------------------- process runner
def _process_worker_main(conn, payload: bytes) -> None:
    """Loads the pickled spec, then answers each list of units: ``("done", [(pos, kind, value, message), ...])``
    per call, ``("split",)`` when a batched call failed as a whole and its items follow one by one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the run's: the parent stops its workers, no traces
    try:
        spec = pickle.loads(payload)
    except BaseException as e:  # noqa: BLE001
        conn.send(("fatal", f"could not load the reward function in the worker process: {_format_exc(e)}"))
        return
    conn.send(("ready",))
    while True:
        try:
            units = conn.recv()
        except (EOFError, OSError):
            return
        if units is None:
            return
        for unit in units:
            positions = [u[0] for u in unit]
            prompts, completions = {u[0]: u[1] for u in unit}, {u[0]: u[2] for u in unit}
            results = _call_unit(spec, prompts, completions, positions)
            if results is not None:
                conn.send(("done", [(p, *r) for p, r in zip(positions, results)]))
                continue
            conn.send(("split",))
            for p in positions:
                conn.send(("done", [(p, *_call_unit(spec, prompts, completions, [p])[0])]))


class _Worker:
    """A worker process, the units it holds (lists of positions, the running one first) and that call's start."""
    __slots__ = ("proc", "conn", "pending", "t0")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.pending: collections.deque = collections.deque()
        self.t0 = 0.0


class _ProcessRunner:
    def __init__(self, spec: RewardSpec, mp_context: str, startup_timeout_s: float):
        self.spec = spec
        try:
            self._payload = pickle.dumps(spec)
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
        proc = self._ctx.Process(target=_process_worker_main, args=(child, self._payload), daemon=True,
                                 name=f"reward-{self.spec.name}")
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

    def _send(self, k: int, units: list[list[int]], prompts, completions) -> None:
        w = self._workers[k]
        if w is None or not w.proc.is_alive():
            if w is not None:
                self._kill(w)
            w = self._workers[k] = self._spawn()
        w.pending = collections.deque(units)
        w.conn.send([[(p, prompts[p], completions[p]) for p in u] for u in units])
        w.t0 = time.perf_counter()

    def _replace(self, k: int, prompts, completions) -> None:
        w = self._workers[k]
        rest = list(w.pending)
        self._kill(w)
        self._workers[k] = None
        if rest:
            self._send(k, rest, prompts, completions)

    def _limit(self, k: int) -> float:
        w = self._workers[k]
        return w.t0 + unit_limit(self.spec, w.pending[0])

    def _lost(self, k: int, kind: str, msg: str, prompts, completions, record: Record) -> bool:
        """Worker ``k``'s running call died or ran out of time: its process replaced; a batched call's items
        retried one by one, an item's call recorded as ``kind``."""
        unit = self._workers[k].pending.popleft()
        if len(unit) > 1:
            self._workers[k].pending.extendleft([p] for p in reversed(unit))
        self._replace(k, prompts, completions)
        return len(unit) > 1 or record(unit[0], kind, 0.0, msg)

    def _receive(self, k: int, prompts, completions, record: Record) -> bool:
        w = self._workers[k]
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            w.proc.join(1.0)
            return self._lost(k, "errors", f"worker process died (exit code {w.proc.exitcode})", prompts,
                              completions, record)
        unit = w.pending.popleft()
        w.t0 = time.perf_counter()
        if msg[0] == "split":
            w.pending.extendleft([p] for p in reversed(unit))
            return True
        return all(record(*row) for row in msg[1])

    def run(self, prompts: Sequence, completions: Sequence, record: Record) -> bool:
        n = len(prompts)
        if n == 0:
            return True
        nw = min(len(self._workers), n)
        bounds = np.linspace(0, n, nw + 1).astype(int)
        active: set[int] = set()
        for k in range(nw):
            self._send(k, units_of(self.spec, range(bounds[k], bounds[k + 1])), prompts, completions)
            active.add(k)
        timeout = self.spec.timeout_s
        try:
            while active:
                wait_s = None if timeout is None else max(0.0, min(self._limit(k) for k in active) - time.perf_counter())
                conns = {self._workers[k].conn: k for k in active}
                for conn in multiprocessing.connection.wait(list(conns), timeout=wait_s):
                    k = conns[conn]
                    if not self._receive(k, prompts, completions, record):
                        return False
                    if self._workers[k] is None or not self._workers[k].pending:
                        active.discard(k)
                if timeout is not None:
                    for k in list(active):
                        if time.perf_counter() >= self._limit(k) and not self._workers[k].conn.poll():
                            limit = unit_limit(self.spec, self._workers[k].pending[0])
                            if not self._lost(k, "timeouts", f"call exceeded the {limit:g} s limit; worker killed",
                                              prompts, completions, record):
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
