"""Run logs: metrics per policy per round (JSONL + TensorBoard), sampled completions, progress line.

Every record carries its ``round``; on resume ``truncate_after(round)`` drops records newer than the
checkpoint so the file has no gap and no duplicate. Lines are flushed and fsynced every round, so a
killed process loses at most the round in flight.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np


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
    """Append-only logs of one run directory: ``metrics.jsonl``, ``samples.jsonl``, ``tb/``."""

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True, progress: bool = True,
                 purge_step: int | None = None):
        """``purge_step``: on resume, the first round redone; TensorBoard hides older events of rounds >= it."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.samples_path = self.out_dir / "samples.jsonl"
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"), flush_secs=30, purge_step=purge_step)
        self._progress = progress
        self._t0 = time.perf_counter()

    def truncate_after(self, round_index: int) -> None:
        """Drop records of rounds > ``round_index`` (those not covered by the checkpoint resumed from)."""
        for path in (self.metrics_path, self.samples_path):
            _rewrite_jsonl(path, lambda r: int(r.get("round", -1)) <= round_index)

    def _append(self, path: Path, records: list[dict]) -> None:
        with path.open("a") as f:
            for record in records:
                f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log_round(self, round_index: int, per_policy: Mapping[str, Mapping[str, Any]]) -> None:
        """One JSONL record per policy: ``{"round", "policy", **metrics}``; also TensorBoard scalars."""
        records = [{"round": round_index, "policy": name, **m} for name, m in per_policy.items()]
        self._append(self.metrics_path, records)
        if self._tb is not None:
            for name, metrics in per_policy.items():
                for key, value in metrics.items():
                    v = _plain(value)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        self._tb.add_scalar(f"{name}/{key}", v, round_index)
        if self._progress:
            rewards = " | ".join(
                f"{n} reward {float(_plain(m.get('reward/mean', float('nan')))):.3f}" for n, m in per_policy.items())
            elapsed = time.perf_counter() - self._t0
            print(f"round {round_index:>5} | {rewards} | {elapsed:7.1f}s", file=sys.stderr, flush=True)

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

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
