"""Run logs: metrics per policy per round (JSONL + trackers), per-prompt rewards, sampled completions, progress.

Every record carries its ``round``; on resume ``truncate_after(round)`` drops records newer than the
checkpoint so the file has no gap and no duplicate. Lines are flushed and fsynced every round, so a
killed process loses at most the round in flight.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from mrl_jax.report.progress import Progress, round_figures
from mrl_jax.trainer.trackers import make_trackers, tracker_scalars


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)) or hasattr(value, "__array__"):
        arr = np.asarray(value)
        value = arr.item() if arr.ndim == 0 else arr.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


def _rewrite_jsonl(path: Path, keep) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
        if keep(record):
            kept.append(line)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class RunLog:
    """Append-only logs of one run directory: ``metrics.jsonl``, ``samples.jsonl``, ``groups.jsonl``, and the
    trackers of ``report_to`` (TensorBoard ``tb/``, W&B); the progress display of the rounds."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, progress: "bool | Progress" = True,
                 purge_step: int | None = None, rounds: tuple[int, int] | None = None,
                 report_to: Sequence[str] | None = None, config: Mapping | None = None):
        """``purge_step``: on resume, the first round redone; TensorBoard hides older events of rounds >= it.
        ``progress``: True = a ``Progress`` over ``rounds`` = (first round, end) made here, or one given.
        ``report_to``: trackers (default tensorboard + jsonl; ``tensorboard=False`` drops TensorBoard);
        ``config``: the run config sent to W&B."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.samples_path = self.out_dir / "samples.jsonl"
        self.groups_path = self.out_dir / "groups.jsonl"
        report_to = list(report_to) if report_to is not None else ["tensorboard", "jsonl"]
        if not tensorboard:
            report_to = [n for n in report_to if n != "tensorboard"] or ["none"]
        self._trackers = make_trackers(report_to, self.out_dir, purge_step=purge_step, config=config)
        first, end = rounds if rounds is not None else (0, None)
        if isinstance(progress, Progress):
            self._progress = progress
        else:
            self._progress = Progress(None if end is None else end - first, title="train", enabled=bool(progress))
        self._progress.start(str(first), compile=True)   # the first round of a process compiles
        self._end = end
        self._eval: dict[str, float] = {}
        self._last: dict[str, Mapping] = {}

    def truncate_after(self, round_index: int) -> None:
        """Drop records of rounds > ``round_index`` (those not covered by the checkpoint resumed from)."""
        for path in (self.metrics_path, self.samples_path, self.groups_path):
            _rewrite_jsonl(path, lambda r: int(r.get("round", -1)) <= round_index)

    def _append(self, path: Path, records: list[dict]) -> None:
        with path.open("a") as f:
            for record in records:
                f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_round(self, round_index: int, per_policy: Mapping[str, Mapping[str, Any]]) -> None:
        """One JSONL record per policy: ``{"round", "policy", **metrics}``; the trackers get the scalars.

        A policy's ``groups`` entry (per-prompt rewards of the round, see ``round.run_round``) goes to
        ``groups.jsonl`` instead. Entries named ``<policy>/eval`` are held-out evaluations (``success``):
        logged the same way, shown by the progress display beside the next round."""
        groups = [{"round": round_index, "policy": n, **m["groups"]} for n, m in per_policy.items()
                  if isinstance(m.get("groups"), Mapping)]
        per_policy = {n: {k: v for k, v in m.items() if k != "groups"} for n, m in per_policy.items()}
        records = [{"round": round_index, "policy": name, **m} for name, m in per_policy.items()]
        self._append(self.metrics_path, records)
        if groups:
            self._append(self.groups_path, groups)
        plain = {n: {k: _plain(v) for k, v in m.items()} for n, m in per_policy.items()}
        scalars = tracker_scalars(plain)
        for tracker in self._trackers:
            tracker.log(round_index, scalars)
        evals = {n[:-len("/eval")]: m.get("success") for n, m in per_policy.items() if n.endswith("/eval")}
        self._eval.update(evals)
        if len(evals) == len(per_policy):
            return
        self._last = {n: m for n, m in plain.items() if n not in evals}
        if self._progress.done(round_figures(self._last, self._eval), label=str(round_index)):
            self._eval = {}
        if self._end is None or round_index + 1 < self._end:
            self._progress.start(str(round_index + 1))

    def log_samples(self, round_index: int, samples: list[dict]) -> None:
        """Sampled completions (policy, prompt, completion, reward) of a round."""
        self._append(self.samples_path, [{"round": round_index, **s} for s in samples])

    @staticmethod
    def read_records(path: str | Path) -> list[dict]:
        """The records of a JSONL log (a line torn by a kill mid-write is skipped); [] if it does not exist."""
        path = Path(path)
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def read_metrics(self) -> list[dict]:
        return self.read_records(self.metrics_path)

    def close(self, finished: bool = True) -> None:
        """Close the trackers and the progress display; ``finished``: a closing line, the rounds logged and an
        eval not yet shown (none for a run that stopped: its stop says where)."""
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []
        tail = f"{self._progress.completed} rounds logged"
        if self._eval:
            tail += "; eval success " + " ".join(f"{n} {float(_plain(v)):.3f}" for n, v in self._eval.items())
        self._progress.close(tail if finished else None)
