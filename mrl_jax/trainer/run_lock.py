"""Who may touch a run directory: one ``train`` writing it, readers beside it.

``train`` (new or resumed) holds an exclusive ``fcntl.flock`` on ``OUT/.lock`` for its whole life (`run_lock`),
so a second ``mrl train`` on the same ``--out`` cannot interleave its records and checkpoints with the first
one's. ``mrl eval`` and ``mrl export`` hold it shared while they read a checkpoint (`read_lock`): refused while a
``train`` writes there (checkpoints appear and are deleted), and a ``train`` started meanwhile is refused until
the reader is done. The verbs that write files of their own (``eval``, ``plan``, ...) given a directory that
holds a run write into a folder of their name beside the run's files (`beside_run`), never over them.

The lock file holds the PID of its exclusive holder while held (read by the refused process to name it) and is
emptied on release, so a finished run's directory is the same whichever process last held it. The kernel drops
the lock when its process dies (kill -9 included): a stale file never blocks a resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

from mrl_jax.configs import ConfigError
from mrl_jax.trainer.checkpoint import CheckpointError

LOCK_NAME = ".lock"
RUN_MARKERS = (LOCK_NAME, "checkpoints", "metrics.jsonl")   # what only `mrl train` writes in a directory


class RunDirectoryBusy(CheckpointError):
    """Another live process holds the run directory's lock; the message names it and what to do."""


def out_directory(out: str | os.PathLike, flag: str = "--out") -> Path:
    """``out`` created as a directory; a ``ConfigError`` naming ``flag`` when it is a file."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a directory; give a directory (created if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"{flag} {out}: a parent of it is a file; give a directory path") from None
    return out


def holds_run(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a run of ``mrl train`` (its lock, checkpoints or metrics)."""
    directory = Path(directory)
    return directory.is_dir() and any((directory / name).exists() for name in RUN_MARKERS)


def beside_run(out: str | os.PathLike, verb: str) -> Path:
    """Where verb ``verb`` writes its files given ``--out out``: ``out``, or ``out/<verb>`` when ``out`` holds a
    run (whose own files -- summary.json, plan.txt, records -- only ``train`` writes)."""
    out = Path(out)
    return out / verb if holds_run(out) else out


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"PID {pid}" if pid.isdigit() else "an unknown PID"


def _readers_only(fd: int) -> bool:
    """Whether the lock ``fd`` could not take exclusively is held shared only (``eval`` / ``export`` reading)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _busy(out, path: Path, readers: bool, resume: bool) -> RunDirectoryBusy:
    if readers:
        what = (f"{out} is being read: an `mrl eval` or `mrl export` holds {path} shared while it restores a "
                "checkpoint")
        fix = "wait for it to finish, then resume" if resume else (
            "wait for it to finish, or give this run another --out directory")
    else:
        what = (f"{out} is in use: another `mrl train` ({_holder(path)}) holds {path} and is writing its run "
                "there")
        fix = "let it finish (or stop it), then resume" if resume else (
            "wait for it to finish, or give this run another --out directory")
    return RunDirectoryBusy(f"{what}; {fix}")


@contextlib.contextmanager
def run_lock(out: str | os.PathLike, *, resume: bool = False) -> Iterator[Path]:
    """Hold the exclusive lock of run directory ``out`` (created if missing) inside the ``with``; raises
    ``RunDirectoryBusy`` at once, naming the holder (a ``train``'s PID, or a reading ``eval``) and the fix for a
    new run or a ``resume``, when another process holds it."""
    path = out_directory(out) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(out, path, _readers_only(fd), resume) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def read_lock(run_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold run directory ``run_dir``'s lock shared inside the ``with`` (several readers at once; the lock file
    made if the run has none, as any ``train`` there would); raises ``RunDirectoryBusy`` at once, naming the
    ``train`` writing there by its PID, when one holds it. Nothing in ``run_dir`` is written."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, (os.O_RDONLY if path.exists() else os.O_RDWR | os.O_CREAT) | os.O_CLOEXEC, 0o644)
    except PermissionError:   # a run directory this user cannot write: no train of theirs can write there either
        yield path
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"{run_dir} is in use: `mrl train` ({_holder(path)}) holds {path} and is writing its run there "
                "(checkpoints are written and deleted); evaluate it once that run has finished or stopped") from None
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


__all__ = ["LOCK_NAME", "RUN_MARKERS", "RunDirectoryBusy", "beside_run", "holds_run", "out_directory", "read_lock",
           "run_lock"]
