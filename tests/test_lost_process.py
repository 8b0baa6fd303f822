"""A multi-process run whose process dies (docs/multihost.md, "When a process dies"): every survivor prints one
line naming the lost process and exits with `LOST_EXIT_CODE` (`trainer.watchdog`) -- never JAX's C++ abort (exit 134), which
raced that line and sometimes won while the coordination service pushed a fatal error to every process -- and a
run that ends normally ends with 0 on every process, however far apart they finish (tests/watch_worker.py)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import support
from mrl_jax.trainer.watchdog import LOST_EXIT_CODE

WORKER = Path(__file__).with_name("watch_worker.py")


def _run_two(mode: str, out: Path) -> list[tuple[int, str]]:
    """Both processes of ``mode`` to the end: [(exit code, stderr)]."""
    port = support.free_port()
    env = support.forced_devices_env(1)
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(out), str(i), str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
        return [(p.returncode, err) for p, err in zip(procs, errs)]
    finally:
        for p in procs:
            p.kill()


def test_the_survivor_of_a_dead_process_prints_one_line_and_exits_75(tmp_path):
    """Process 1 is killed (-9); process 0 stops with exit 75 and one line naming process 1 and the intact
    checkpoint, and no abort. Three runs: with the old barrier watchdog the abort printed its trace in the first."""
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    for _ in range(3):
        (code, err), _ = _run_two("kill1", tmp_path)
        lines = [ln for ln in err.splitlines() if ln.startswith("mrl train: ")]
        assert code == LOST_EXIT_CODE and len(lines) == 1, err[-3000:]
        assert "process 1 of 2 stopped answering" in lines[0]
        assert f"checkpoint of round 4 in {tmp_path / 'checkpoints'} is intact" in lines[0]
        assert "Terminating process" not in err and "process 0 done" not in err


def test_a_native_abort_after_a_peer_died_still_ends_in_the_line_and_75(tmp_path):
    """A thread of process 0 aborts (libc ``abort``: gloo's ``std::terminate`` when a collective's peer is killed
    under it, which Python cannot catch) half a second after process 1 died: the abort is held until the watchdog
    names process 1 and exits 75 (without the watchdog's `AbortHold` the process died with -6 and no line)."""
    (code, err), _ = _run_two("abort0", tmp_path)
    lines = [ln for ln in err.splitlines() if ln.startswith("mrl train: process 1 of 2 stopped answering")]
    assert code == LOST_EXIT_CODE and len(lines) == 1, (code, err[-3000:])
    assert "mrl train: a native abort" in err and "process 0 done" not in err


def test_an_abort_is_held_only_for_its_wait(tmp_path):
    """Where no watchdog ends the process, a held abort goes on after its wait: exit -6 (SIGABRT), not a hang."""
    script = ("import ctypes, threading, time\n"
              "from mrl_jax.trainer.watchdog import AbortHold\n"
              "hold = AbortHold(1.0, threading.Event()).install()\n"
              "threading.Thread(target=ctypes.CDLL(None).abort).start()\n"
              "time.sleep(30)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -6 and "waiting up to 1 s" in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert 1.0 <= time.monotonic() - t0 < 25


@pytest.mark.parametrize("how", ["released", "handed back"])
def test_an_abort_goes_on_at_once_once_the_hold_is_released_or_handed_back(how):
    """A released hold (the watchdog stopped: the run is leaving) lets an abort go on at once, without the waiting
    line; ``release()`` puts the handler before it back, here libc's default."""
    stop = "done.set()" if how == "released" else "hold.release()"
    script = ("import ctypes, threading, time\n"
              "from mrl_jax.trainer.watchdog import AbortHold\n"
              "done = threading.Event()\n"
              "hold = AbortHold(30.0, done).install()\n"
              f"{stop}\n"
              "threading.Thread(target=ctypes.CDLL(None).abort).start()\n"
              "time.sleep(30)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -6 and "native abort" not in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    assert time.monotonic() - t0 < 25


def test_a_single_process_watchdog_is_a_no_op(tmp_path):
    """One process: ``start`` starts no thread and installs nothing; ``stop`` (also twice) returns at once."""
    from mrl_jax.trainer.watchdog import Watchdog

    dog = Watchdog(tmp_path, 3)
    assert dog.start() is dog and dog._thread is None and dog._aborts is None
    dog.stop()
    dog.stop()
    assert dog.patience_s == 13


def test_processes_that_finish_apart_both_end_with_0(tmp_path):
    """Process 1 ends 3 s (the heartbeat timeout) after process 0 and is slow to leave: process 0 waits for it
    before it takes the coordination service down (without that wait process 1 aborted in its shutdown call), and
    neither reports a lost process."""
    results = _run_two("finish", tmp_path)
    for code, err in results:
        assert code == 0 and "mrl train:" not in err, err[-3000:]
    assert all(f"process {i} done" in err for i, (_, err) in enumerate(results))
