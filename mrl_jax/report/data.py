"""Reading a run directory (complete, still going, or killed) and the complementarity matrix."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

PROBE_PREFIXES = ("prp", "sgt", "xgrpo", "replay")


def _float(value: Any) -> float:
    """A logged number (non-finite ones are logged as the strings 'nan', 'inf')."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _numeric(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() in ("nan", "inf", "-inf")
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass
class RunRecords:
    """What a run directory holds; any file may be missing or end in a torn line."""

    run_dir: Path
    train: list[dict]      # metrics.jsonl records of training rounds
    evals: list[dict]      # held-out evaluations: {"round", "policy", "success", pass@k...}; policy "population"
                           # holds the population metrics (its success = population pass@1)
    groups: list[dict]     # groups.jsonl: {"round", "policy", "prompt_ids", "rewards" [P][G], "tau"}
    samples: list[dict]    # samples.jsonl
    summary: dict | None   # summary.json (written when the run finished)
    config: dict | None    # config.json

    @property
    def policies(self) -> list[str]:
        """Policy names in the order they were logged."""
        return list(dict.fromkeys(r["policy"] for r in self.train))

    @property
    def last_round(self) -> int | None:
        return max((int(r["round"]) for r in self.train), default=None)

    def series(self, policy: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(rounds int[N], values f64[N]) of one metric of one policy (rounds where it was logged)."""
        rows = [(int(r["round"]), _float(r[key])) for r in self.train if r["policy"] == policy and key in r]
        rows.sort()
        return np.asarray([a for a, _ in rows], np.int64), np.asarray([b for _, b in rows], np.float64)

    def keys(self, prefix: str = "") -> list[str]:
        """Numeric metric keys starting with ``prefix`` (sorted)."""
        out = {k for r in self.train for k, v in r.items()
               if k.startswith(prefix) and k not in ("round", "policy") and _numeric(v)}
        return sorted(out)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log; a line torn by a kill (or still being written) is skipped; [] if absent.
    (Same reading as ``trainer.metrics.RunLog.read_records``; kept here so a report needs no JAX import.)"""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_run(run_dir: str | Path) -> RunRecords:
    """The records of ``run_dir``; raises FileNotFoundError when it holds no metrics.jsonl."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: no metrics.jsonl (made by `mrl train`)")
    records = read_jsonl(metrics_path)
    train = [r for r in records if "policy" in r and "round" in r and not str(r["policy"]).endswith("/eval")]
    evals = [{"round": int(r["round"]), "policy": str(r["policy"])[:-len("/eval")], "success": _float(r.get("success")),
              **{k: _float(v) for k, v in r.items() if "@" in k}}   # sampled eval: avg@K, pass@k, maj@K
             for r in records if "round" in r and str(r.get("policy", "")).endswith("/eval")]
    return RunRecords(run_dir=run_dir, train=train, evals=evals,
                      groups=read_jsonl(run_dir / "groups.jsonl"),
                      samples=read_jsonl(run_dir / "samples.jsonl"),
                      summary=_read_json(run_dir / "summary.json"), config=_read_json(run_dir / "config.json"))


def complementarity(groups: list[dict], policies: list[str]) -> dict:
    """Per round, ``matrix[i][j]`` = fraction of the round's prompts on which policy i has no success among
    its samples (every reward < tau, or the logged verifier ``success``) while policy j has at least one (SGT's
    rescue opportunities for i).

    Returns ``{"policies", "rounds": [r], "matrix": f[R][N][N], "mean": f[N][N], "prompts": [P per round]}``;
    a round is used only when every policy logged it on the same prompts (a killed run's last round may
    have only some)."""
    by_round: dict[int, dict[str, dict]] = {}
    for g in groups:
        by_round.setdefault(int(g["round"]), {})[g["policy"]] = g
    rounds, mats, sizes = [], [], []
    for r in sorted(by_round):
        got = by_round[r]
        if any(p not in got for p in policies):
            continue
        if len({tuple(map(str, got[p]["prompt_ids"])) for p in policies}) != 1:
            continue
        success = [np.any(np.asarray(got[p]["success"], bool) if "success" in got[p] else
                          np.asarray(got[p]["rewards"], np.float64) >= float(got[p]["tau"]), axis=1)
                   for p in policies]   # "success": the verifier's, when the rewards have other components
        mat = np.asarray([[float(np.mean(~si & sj)) for sj in success] for si in success])
        rounds.append(r)
        mats.append(mat.tolist())
        sizes.append(int(success[0].shape[0]))
    mean = np.mean(np.asarray(mats), axis=0).tolist() if mats else None
    return {"policies": list(policies), "rounds": rounds, "matrix": mats, "mean": mean, "prompts": sizes}


__all__ = ["PROBE_PREFIXES", "RunRecords", "complementarity", "load_run"]
