"""The watchdog of a multi-process run: a lost process ends every survivor with one line and exit 75.

A process of a multi-process run (``jax.distributed``) that dies leaves the others blocked in a collective or a
barrier; the recoverable coordination service (`mwra.initialize_distributed`) only marks it dead once its
heartbeat timeout passes. A started :class:`Watchdog` asks the service every ``period_s`` which processes are
alive; when one is declared dead, or the coordinator stops answering, it prints :func:`lost_process_line` (which
process, the intact checkpoint round, the resume command) and ends the process with `LOST_EXIT_CODE` from its own
thread (``os._exit``: the main thread may be blocked in C code, which no Python exception reaches).

    info = mwra.initialize_distributed(...)
    watchdog = Watchdog(out_dir, info.heartbeat_timeout_s).start()   # a no-op in a single-process run
    ...                                                               # the run
    watchdog.stop()   # at the latest when the process exits (start registers it with atexit)

``mrl train`` starts one (`trainer.loop.train_from_yaml`). While it runs, a native abort is held
(:class:`AbortHold`): gloo ``std::terminate`` s a process whose collective lost its peer, from its own thread, and
the watchdog must get to name the lost process first.

JAX has no public API for the coordination service's liveness query: the client comes from
`mwra.distributed.coordination_client` (``jax._src``; see there).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax

from mrl_jax.mwra.distributed import DEFAULT_HEARTBEAT_S, barrier, coordination_client

__all__ = ["LOST_EXIT_CODE", "WATCH_PERIOD_S", "AbortHold", "Watchdog", "lost_process_line"]

LOST_EXIT_CODE = 75   # a process of the run was lost: resume every process (EX_TEMPFAIL)
WATCH_PERIOD_S = 1.0   # how often the watchdog asks the coordination service which processes are alive


class Watchdog:
    """Watches the processes of a multi-process run whose directory is ``out_dir`` (see the module docstring).

    ``heartbeat_s``: the run's heartbeat timeout (`mwra.DistributedInfo.heartbeat_timeout_s`); an abort is held
    that long (plus five periods), and at exit the watchdog waits that long (plus 10 s) for the others.
    """

    def __init__(self, out_dir, heartbeat_s: float = DEFAULT_HEARTBEAT_S, *, period_s: float = WATCH_PERIOD_S):
        self.out_dir, self.heartbeat_s, self.period_s = Path(out_dir), heartbeat_s, period_s
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._aborts: AbortHold | None = None

    @property
    def patience_s(self) -> float:
        """How long the exit waits for the other processes (and, after a failure, for the watchdog's verdict)."""
        return self.heartbeat_s + 10

    def start(self) -> "Watchdog":
        """Start watching (once; a no-op in a single-process run): the thread, the abort hold, `stop` at exit."""
        client = coordination_client()
        if client is None or jax.process_count() == 1 or self._thread is not None:
            return self
        everyone = list(range(jax.process_count()))
        self._thread = threading.Thread(target=self._watch, args=(client, everyone), name="mrl-watch", daemon=True)
        self._thread.start()
        self._aborts = AbortHold(self.heartbeat_s + 5 * self.period_s, self._closing).install()
        atexit.register(self.stop)   # runs before `mwra.distributed`'s own exit (registered earlier, runs later)
        return self

    def _watch(self, client, everyone: list[int]) -> None:
        while not self._closing.wait(self.period_s):
            try:
                dead = sorted(set(everyone) - set(client.get_live_nodes(everyone)))
            except Exception:  # noqa: BLE001 -- the coordinator (process 0) no longer answers
                dead = None
            # a peer leaving at the end of a finished run looks the same for a moment: this process is then
            # past the exit barrier and sets `_closing` within the grace period
            if (dead is None or dead) and not self._closing.wait(2 * self.period_s):
                print(lost_process_line(dead, self.out_dir), file=sys.stderr, flush=True)
                os._exit(LOST_EXIT_CODE)

    def stop(self) -> None:
        """Wait (at most `patience_s`) for every process to finish, still watching: a peer that died meanwhile is
        named and this process exits 75. After a failed wait, give the dead peer's heartbeat timeout the time to
        reach the watchdog. Then stop the thread and the abort hold. Idempotent."""
        if self._thread is None:
            return
        atexit.unregister(self.stop)
        try:
            barrier("mrl.watch.exit", timeout_s=self.patience_s)
        except Exception:  # noqa: BLE001 -- a peer that never arrives: the watchdog says so if it is dead
            self._thread.join(timeout=self.patience_s)
        self._closing.set()
        self._thread.join(timeout=10)
        self._aborts.release()
        self._thread = None


_ABORT_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)


class AbortHold:
    """Hold a native abort (SIGABRT) for up to ``wait_s`` unless ``released`` is set, then let it go on.

    A peer killed in the middle of a collective can make gloo ``std::terminate`` this process from its own thread
    ("op.preamble.length <= op.nbytes": the ranks no longer agree on which collective they are in). Python's
    ``signal`` module cannot hold it (its C handler returns, and ``abort`` then kills the process), so the
    handler is libc's (``ctypes``): the aborting thread waits in it while the watchdog names the lost process
    and exits. ``install`` is a no-op where libc's ``signal`` cannot be reached."""

    def __init__(self, wait_s: float, released: threading.Event):
        self.wait_s, self.released = wait_s, released
        self._signal = None
        self._handler = None   # kept alive as long as it is installed
        self._previous = None

    def install(self) -> "AbortHold":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._signal, self._raise = libc.signal, getattr(libc, "raise")
        except (OSError, AttributeError):
            return self
        self._signal.argtypes, self._signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
        self._handler = _ABORT_HANDLER(self._held)
        self._previous = self._signal(signal.SIGABRT, ctypes.cast(self._handler, ctypes.c_void_p))
        return self

    def _held(self, signum: int) -> None:
        if not self.released.is_set():
            os.write(2, f"mrl train: a native abort (a collective whose peer died?); waiting up to {self.wait_s:.0f} "
                        "s for the lost-process check\n".encode())
            deadline = time.monotonic() + self.wait_s
            while time.monotonic() < deadline and not self.released.is_set():
                time.sleep(0.1)
        self._signal(signum, self._previous)   # the handler before ours (libc's default: the abort goes on)
        self._raise(signum)

    def release(self) -> None:
        """Put the handler before ours back (an abort from now on goes on at once)."""
        if self._handler is not None:
            self._signal(signal.SIGABRT, self._previous)
            self._handler = None


def _complete_round(out: Path | None) -> int | None:
    """The newest complete checkpoint under ``out/checkpoints`` (orbax finalises a step by renaming its
    temporary folder to the bare step number)."""
    ckpts = None if out is None else out / "checkpoints"
    steps = [int(p.name) for p in ckpts.iterdir() if p.name.isdigit()] if ckpts and ckpts.is_dir() else []
    return max(steps) if steps else None


def lost_process_line(dead: list[int] | None, out: Path | None) -> str:
    """The one line a surviving process prints when the processes ``dead`` stopped answering (``None``: the
    coordinator itself is gone)."""
    who = (f"process {', '.join(map(str, dead))} of {jax.process_count()} stopped answering" if dead else
           f"the coordinator (process 0) or another process of {jax.process_count()} is gone")
    r = _complete_round(out)
    cmd = " ".join(["mrl"] + [a for a in sys.argv[1:]] + ["--resume"]) if Path(sys.argv[0]).name == "mrl" and \
        "--resume" not in sys.argv else "the same command with --resume"
    kept = (f"the checkpoint of round {r} in {out / 'checkpoints'} is intact (later rounds are redone)"
            if r is not None else "no checkpoint was complete yet (the run starts over)")
    return (f"mrl train: {who} (no heartbeat within the timeout), so this process stops too (exit "
            f"{LOST_EXIT_CODE}); {kept}; restart every process with {cmd}")
