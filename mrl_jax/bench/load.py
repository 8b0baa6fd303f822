"""Honest benchmark figures: the machine's load around every timed section, and a bounded wait for quiet.

A figure is *contended* when it was taken while something else competed for the cores:

* the 1-minute load average before the section was above ``threshold`` (default 0.25 per core: 0.5 on a
  2-core machine), or
* the OTHER processes (not this one, not its children) used more than ``threshold`` cores on average
  during the section (sampled from ``/proc/<pid>/stat``).

The load average *after* a section is recorded too but does not decide: it counts this process's own
work (a 10 s section running 1 core raises it by ~0.15), so on a quiet machine it rises anyway.

    with section("llama_quick") as rec:      # rec is a dict, filled on exit
        timed_work()
    figures["load"] = rec; figures["contended"] = rec["contended"]

Every section is also appended to a process-wide log that :func:`collect` returns (``script_main`` and
``mrl bench`` attach it to each benchmark's JSON with a top-level ``contended``).
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterator

__all__ = ["load_average", "default_threshold", "cpu_times", "busy_processes", "is_contended",
           "wait_idle", "settle_sections", "section", "collect", "summarize"]

_LOG: list[dict] = []
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def load_average() -> float:
    """The 1-minute load average (``os.getloadavg()[0]``; -1.0 where unavailable)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return -1.0


def default_threshold(cores: int | None = None) -> float:
    """0.5 on a 2-core machine, scaled by the number of cores elsewhere (0.25 per core)."""
    return 0.25 * float(cores or os.cpu_count() or 1)


def _own_family(stats: dict[int, tuple]) -> set[int]:
    """This process and every descendant (by ppid) among ``stats`` {pid: (comm, ppid, ticks)}."""
    me, fam = os.getpid(), {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, (_, ppid, _) in stats.items():
            if ppid in fam and pid not in fam:
                fam.add(pid)
                grew = True
    fam.add(me)
    return fam


def cpu_times() -> dict[int, tuple[str, int, int]]:
    """{pid: (comm, ppid, utime + stime in clock ticks)} for every process in /proc ({} without /proc)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        lp, rp = raw.find("("), raw.rfind(")")
        fields = raw[rp + 2:].split()
        if lp < 0 or rp < 0 or len(fields) < 13:
            continue
        out[int(name)] = (raw[lp + 1:rp], int(fields[1]), int(fields[11]) + int(fields[12]))
    return out


def busy_processes(before: dict, after: dict, wall_s: float, *, min_cores: float = 0.05,
                   exclude: set[int] | None = None) -> list[dict]:
    """Other processes that used >= ``min_cores`` cores between two :func:`cpu_times` snapshots.

    Returns [{"pid", "name", "cores"}] sorted by cores, this process and its children excluded.
    """
    if wall_s <= 0:
        return []
    skip = _own_family(after) if exclude is None else exclude
    busy = []
    for pid, (name, _, ticks) in after.items():
        if pid in skip:
            continue
        prev = before.get(pid)  # absent: started during the block, all its CPU time is inside it
        cores = (ticks - (prev[2] if prev is not None else 0)) / _CLK / wall_s
        if cores >= min_cores:
            busy.append({"pid": pid, "name": name, "cores": round(cores, 3)})
    return sorted(busy, key=lambda d: -d["cores"])


def is_contended(load_before: float, other_cores: float, threshold: float) -> bool:
    """True when the machine was not quiet: load before > threshold or others used > threshold cores."""
    return bool(load_before > threshold or other_cores > threshold)


def wait_idle(max_wait_s: float, threshold: float | None = None, *, poll_s: float = 5.0,
              load_reader: Callable[[], float] | None = None, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Wait (at most ``max_wait_s``) until ``load_reader()`` < ``threshold``.

    Returns {"idle": reached, "waited_s", "load", "threshold", "polls"}; never raises on timeout (the
    figures taken afterwards are then marked contended by :func:`section`).
    """
    threshold = default_threshold() if threshold is None else float(threshold)
    load_reader = load_reader or load_average
    t0, polls = clock(), 0
    load = load_reader()
    while load >= threshold and clock() - t0 < max_wait_s:
        sleep(max(0.0, min(poll_s, max_wait_s - (clock() - t0))))
        polls += 1
        load = load_reader()
    return {"idle": bool(load < threshold), "waited_s": round(clock() - t0, 2), "load": round(load, 3),
            "threshold": threshold, "polls": polls}


_SETTLE = {"max_s": 0.0}


def settle_sections(max_wait_s: float) -> None:
    """From now on every :func:`section` first waits (at most ``max_wait_s``; 0 = never) for the load to
    fall below its threshold: the benchmark's own set-up or previous section (a compile, the other
    framework's run) raises the 1-minute load too, and a section must start quiet to count as idle."""
    _SETTLE["max_s"] = max(0.0, float(max_wait_s))


@contextlib.contextmanager
def section(name: str, threshold: float | None = None, *,
            load_reader: Callable[[], float] | None = None,
            snapshot: Callable[[], dict] | None = None,
            clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> Iterator[dict]:
    """Record the machine's load around a timed block; yields the record dict, filled on exit.

    Record: name, load_before, load_after (1-min averages), other_cores (CPU cores the other processes
    used during the block), busy (the busiest of them), wall_s, threshold, contended; settled_s (the wait
    for quiet before it, see :func:`settle_sections`).
    """
    threshold = default_threshold() if threshold is None else float(threshold)
    load_reader, snapshot = load_reader or load_average, snapshot or cpu_times  # looked up at call time
    settled = 0.0
    if _SETTLE["max_s"] > 0:
        settled = wait_idle(_SETTLE["max_s"], threshold, load_reader=load_reader, sleep=sleep)["waited_s"]
    rec: dict = {"name": name, "load_before": round(load_reader(), 3), "threshold": threshold,
                 "settled_s": settled}
    snap0, t0 = snapshot(), clock()
    try:
        yield rec
    finally:
        wall = clock() - t0
        snap1 = snapshot()
        busy = busy_processes(snap0, snap1, wall, min_cores=0.0)
        other = sum(b["cores"] for b in busy)
        rec.update(load_after=round(load_reader(), 3), wall_s=round(wall, 4), other_cores=round(other, 3),
                   busy=[b for b in busy if b["cores"] >= 0.05][:8])
        rec["contended"] = is_contended(rec["load_before"], other, threshold)
        _LOG.append(rec)


def collect(clear: bool = True) -> list[dict]:
    """The section records logged since the last ``collect(clear=True)``."""
    out = list(_LOG)
    if clear:
        _LOG.clear()
    return out


def summarize(records: list[dict], wait: dict | None = None) -> dict:
    """{"contended": any section contended (or none recorded and the wait failed), "max_load_before",
    "max_other_cores", "sections": records, "wait_idle": wait}."""
    contended = any(r.get("contended") for r in records)
    if not records and wait is not None:
        contended = not wait.get("idle", False)
    return {"contended": bool(contended),
            "max_load_before": max((r["load_before"] for r in records), default=None),
            "max_other_cores": max((r["other_cores"] for r in records), default=None),
            "sections": records, "wait_idle": wait}
