"""One process per run directory: an exclusive ``fcntl.flock`` on ``OUT/.lock`` held for the life of a
``train`` (new or resumed), so a second ``mrl train`` on the same ``--out`` cannot interleave its records and
checkpoints with the first one's.

The lock file holds the PID of its holder while held (read by the refused process to name it) and is emptied on
release, so a finished run's directory is the same whichever process last held it. The kernel drops the lock
when its process dies (kill -9 included): a stale file never blocks a resume.
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


class RunDirectoryBusy(CheckpointError):
    """Another live process holds the run directory's lock; the message names its PID."""


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


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"PID {pid}" if pid.isdigit() else "another process"


@contextlib.contextmanager
def run_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the exclusive lock of run directory ``out`` (created if missing) inside the ``with``; raises
    ``RunDirectoryBusy`` at once, naming the holder's PID, when another process holds it."""
    path = out_directory(out) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryBusy(
                f"{out} is in use: {_holder(path)} holds {path} (a run is writing there); wait for it to finish or "
                "stop it before resuming, or choose another --out directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


__all__ = ["LOCK_NAME", "RunDirectoryBusy", "out_directory", "run_lock"]
