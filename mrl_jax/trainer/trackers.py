"""Experiment trackers of a run (``report_to`` in the run config, TRL's name): TensorBoard, W&B.

``metrics.jsonl`` (the ``jsonl`` entry) is the run's own record — resume and ``mrl report`` read it — so
``RunLog`` always writes it. The trackers get every scalar of a round as ``<policy>/<name>``, where
``name`` is TRL's GRPOTrainer name when the concept is the same (``TRL_NAMES``) and our internal key
otherwise; the internal keys themselves are not renamed.

W&B runs through its own client (optional extra ``pip install 'mrl-jax[wandb]'``); ``WANDB_MODE``,
``WANDB_PROJECT`` etc. are honoured, files go under the run directory (``WANDB_DIR`` overrides), and the
W&B run id is kept in ``wandb_run_id`` so ``--resume`` continues the same W&B run.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Mapping, Sequence

REPORT_TO = ("tensorboard", "jsonl", "wandb")

# internal metric key -> TRL GRPOTrainer log name (same concept)
TRL_NAMES = {
    "reward/mean": "reward",
    # the learner's reward_std is TRL's (mean over prompts of the group std); the scorer's reward/std is the
    # std over every reward of the round and keeps its own name
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "kl": "kl",
    "entropy": "entropy",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "num_tokens": "num_tokens",
    "clip_ratio/low_mean": "clip_ratio/low_mean",
    "clip_ratio/high_mean": "clip_ratio/high_mean",
    "clip_ratio/region_mean": "clip_ratio/region_mean",
    "completion/mean_length": "completions/mean_length",
    "completion/truncated": "completions/clipped_ratio",
    "learning_rate": "learning_rate",
}
# per reward function: reward/<fn>/mean -> rewards/<fn>/mean (TRL: one entry per reward function)
_REWARD_FN = re.compile(r"^reward/(?!mean$|std$|success_rate$|time_s$)([^/]+)/(mean|std)$")


def tracker_name(key: str) -> str:
    """TRL's name for an internal metric key, else the key itself."""
    if key in TRL_NAMES:
        return TRL_NAMES[key]
    m = _REWARD_FN.match(key)
    return f"rewards/{m.group(1)}/{m.group(2)}" if m else key


def tracker_scalars(per_policy: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{"<policy>/<tracker name>": float}`` of every finite-or-nan number; an unmapped key that collides
    with a TRL name is kept as ``<policy>/mrl/<key>``."""
    out: dict[str, float] = {}
    for policy, metrics in per_policy.items():
        names = {k: tracker_name(k) for k in metrics}
        taken = {n for k, n in names.items() if n != k}
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    continue
            name = names[key] if names[key] != key or key not in taken else f"mrl/{key}"
            out[f"{policy}/{name}"] = float(value)
    return out


def validate_report_to(report_to: Sequence[str]) -> list[str]:
    """The requested trackers; raises ValueError on an unknown one (``none`` = no tracker)."""
    names = [str(n).lower() for n in report_to]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; choose from {list(REPORT_TO)} or ['none']")
    return names


class TensorBoardTracker:
    """Scalars to ``<run>/tb`` (tensorboardX); ``purge_step`` hides events of redone rounds on resume. A NaN scalar
    (a skipped update's loss) is written as it is, without tensorboardX's ``NaN or Inf found`` warning: the run
    says itself which term went non-finite."""

    def __init__(self, out_dir: Path, purge_step: int | None = None):
        import logging

        from tensorboardX import SummaryWriter

        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        self._writer = SummaryWriter(str(out_dir / "tb"), flush_secs=30, purge_step=purge_step)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbTracker:
    """One W&B run per run directory (id kept in ``wandb_run_id``; resumed with ``resume="allow"``)."""

    def __init__(self, out_dir: Path, config: Mapping | None = None):
        try:
            import wandb
        except ImportError as e:
            from mrl_jax.configs import ConfigError

            raise ConfigError("config key 'report_to': wandb needs the W&B client: pip install 'mrl-jax[wandb]' "
                              "(or drop wandb from report_to)") from e
        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        wandb_dir = Path(os.environ.get("WANDB_DIR") or out_dir)
        wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mrl_jax"), name=out_dir.name, id=run_id,
                                   resume="allow", dir=str(wandb_dir), config=dict(config or {}),
                                   settings=wandb.Settings(console="off"))
        except Exception as e:  # noqa: BLE001 -- no login, no network, a bad entity: all mean "no W&B run"
            from mrl_jax.configs import ConfigError

            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"config key 'report_to': wandb could not start a run ({type(e).__name__}: {first}); "
                              "run `wandb login`, or set WANDB_MODE=offline to write the W&B run under the run "
                              "directory without an account (or drop wandb from report_to)") from None

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({k: (v if math.isfinite(v) else float("nan")) for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


def make_trackers(report_to: Sequence[str], out_dir: Path, *, purge_step: int | None = None,
                  config: Mapping | None = None) -> list:
    """The tracker objects of ``report_to`` (``jsonl`` has none: RunLog writes metrics.jsonl itself)."""
    trackers = []
    for name in validate_report_to(report_to):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(out_dir, purge_step))
        elif name == "wandb":
            trackers.append(WandbTracker(out_dir, config))
    return trackers


__all__ = ["REPORT_TO", "TRL_NAMES", "TensorBoardTracker", "WandbTracker", "make_trackers", "tracker_name",
           "tracker_scalars", "validate_report_to"]
