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


# Record callback: record(pos, kind, value, message) -> keep going?
Record = Callable[[int, str, float, "str | None"], bool]


# ---------------------------------------------------------------------------------- thread runner
class _Job:
    __slots__ = ("fn", "prompts", "completions", "start", "low", "high", "allow_none", "record",
                 "state", "finished", "abandoned", "stopped", "lock", "done")

    def __init__(self, fn, prompts, completions, start, low, high, record, allow_none=False):
        self.fn, self.prompts, self.completions = fn, prompts, completions
        self.start, self.low, self.high, self.record = start, low, high, record
        self.allow_none = allow_none
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
            kind, val, msg = _call(fn, prompts[pos], completions[pos], low, high, job.allow_none)
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
            job = _Job(self.spec.fn, prompts, completions, start, self.spec.low, self.spec.high, record,
                       self.spec.allow_none)
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
def _process_worker_main(conn, payload: bytes, low: float, high: float, allow_none: bool = False) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the run's: the parent stops its workers, no traces
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
            kind, val, msg = _call(fn, prompt, completion, low, high, allow_none)
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
            args=(child, self._payload, self.spec.low, self.spec.high, self.spec.allow_none),
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
