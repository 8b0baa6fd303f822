"""The round loop's hooks (levanter's ``trainer.add_hook(fn, every=N)`` shape): functions of a ``RoundInfo``
run after each round at their cadence -- checkpoints, held-out evaluation, logs, stop conditions.

A stop condition raises ``TrainingStopped`` from its hook; that ends ``Trainer.rounds`` (the generator) with the
exception, after the hook saved what the run needs to resume.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from mrl_jax.tasks import Prompt
from mrl_jax.trainer.checkpoint import RunCheckpointer
from mrl_jax.trainer.policy import Policy
from mrl_jax.trainer.round import RoundInputs, RunState


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (repeated non-finite updates, failing rewards); state is saved."""


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """One finished round: its ``inputs``, the ``state`` after it, ``metrics`` ``{policy: {name: value}}``, the
    logged ``samples``; ``last``: the run's final round."""

    inputs: RoundInputs
    state: RunState
    metrics: dict
    samples: list
    last: bool

    @property
    def round(self) -> int:
        return self.inputs.index


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn(info)`` after every ``every``-th round (rounds ``every - 1``, ``2 * every - 1``, ...), and after the
    last round too when ``at_end``."""

    fn: Callable[[RoundInfo], None]
    every: int = 1
    at_end: bool = False

    def due(self, info: RoundInfo) -> bool:
        return (info.round + 1) % self.every == 0 or (self.at_end and info.last)


class CheckpointHook:
    """Saves the state after a round as the checkpoint of that round, at most once per round (a stop hook
    calls it again before stopping). ``to_host``: what is saved of the state (multi-host: gathered)."""

    def __init__(self, ckpt: RunCheckpointer, to_host: Callable[[RunState], RunState] = lambda s: s):
        self.ckpt, self.to_host = ckpt, to_host
        self.saved: int | None = None

    def __call__(self, info: RoundInfo) -> None:
        if self.saved != info.round:
            self.ckpt.save(info.round, self.to_host(info.state), {"round": info.round})
            self.saved = info.round


class LastInputs:
    """Keeps a reference to the last (rows, see_view) each policy's update got (``record``, the round's
    ``on_update``), so rows that made the update non-finite can be saved for inspection (no copy, no device
    sync)."""

    def __init__(self):
        self.inputs: dict[str, tuple] = {}

    def record(self, policy: Policy, rows, see_view) -> None:
        self.inputs[policy.name] = (rows, see_view)

    def save(self, name: str, path: Path, prompts: Sequence[Prompt], round_index: int) -> Path | None:
        """Write the last rows and SEE view of ``name`` as ``path`` (.npz); arrays named by their field path
        (``batch.<field>``, ``view.<field>``: the file's format, kept)."""
        if name not in self.inputs:
            return None
        arrays = {"round": np.asarray(round_index), "prompts": np.asarray([p.text for p in prompts]),
                  "answers": np.asarray([p.answer for p in prompts])}
        for prefix, tree in zip(("batch", "view"), self.inputs[name]):
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                key = prefix + jax.tree_util.keystr(kp).replace("'", "").replace("[", ".").replace("]", "")
                arrays[key] = np.asarray(jax.device_get(leaf))
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path


def nonfinite_cause(metrics: dict, probe: str = "none") -> str:
    """Which term of a skipped update went non-finite, and its fix, from the policy's round ``metrics`` (the
    loss is the policy-gradient term, KL included, plus the probe chain ``probe``'s loss terms)."""
    def bad(key: str) -> bool:
        v = metrics.get(key)
        return v is not None and not math.isfinite(v)

    if bad("reward_mean") or bad("reward_std"):
        return (f"the rewards overflow or are not finite (reward_mean {metrics.get('reward_mean')}): check the reward "
                "functions")
    if bad("pg_loss"):
        return (f"the policy-gradient term is non-finite (pg_loss {metrics['pg_loss']}, kl {metrics.get('kl')}) "
                "with finite rewards: lower the learning rate")
    if bad("loss"):
        terms = sorted(k for k in metrics if "/" in k and bad(k))
        named = f" (non-finite: {', '.join(terms)})" if terms else ""
        return (f"the loss terms of probe {probe!r} are non-finite (loss {metrics['loss']}, pg_loss "
                f"{metrics.get('pg_loss')} finite){named}: fix the probe's loss_terms or its options")
    return (f"the gradient is non-finite with a finite loss (grad_norm {metrics.get('grad_norm')}): lower the "
            "learning rate")


class SkippedUpdatesStop:
    """Stop condition: a policy skipped ``limit`` updates in a row (non-finite loss or gradient; the count is the
    optimizer state's, ``skipped_in_a_row``, so it runs on across a resume). The first skip of a streak is one
    stderr line naming the non-finite term (``nonfinite_cause``; ``probes``: ``{policy: probe spec}``). Before
    raising ``TrainingStopped`` it saves the round's checkpoint (``save``) and each such policy's last batch
    (``failed_batch_<policy>_round<r>.npz`` in ``out``); the rounds' ``on_update`` is ``recorder.record`` for the
    batches."""

    def __init__(self, limit: int, save: CheckpointHook, out: Path, probes: dict | None = None):
        self.limit, self.save, self.out, self.probes = limit, save, Path(out), dict(probes or {})
        self.recorder = LastInputs()
        self._said: set[str] = set()   # policies whose current streak of skips was reported

    def _cause(self, name: str, metrics: dict) -> str:
        return nonfinite_cause(metrics, self.probes.get(name, "none"))

    def __call__(self, info: RoundInfo) -> None:
        r = info.round
        for n, m in info.metrics.items():
            if m.get("skipped_in_a_row", 0.0) == 0:
                self._said.discard(n)
            elif n not in self._said and m.get("skipped", 0.0) > 0 and self.limit > 1:
                self._said.add(n)
                print(f"mrl train: round {r}: policy {n!r} skipped its update: {self._cause(n, m)}; the run stops "
                      f"after {self.limit} in a row (max_skipped_updates)", file=sys.stderr, flush=True)
        bad = [n for n, m in info.metrics.items() if m.get("skipped_in_a_row", 0.0) >= self.limit]
        if not bad:
            return
        self.save(info)
        saved = [self.recorder.save(n, self.out / f"failed_batch_{n}_round{r}.npz", info.inputs.prompts, r)
                 for n in bad]
        causes = "; ".join(f"{n}: {self._cause(n, info.metrics[n])}" for n in bad)
        raise TrainingStopped(
            f"policies {bad} skipped {self.limit} updates in a row ({causes}); state saved at round {r} in "
            f"{self.save.ckpt.directory}; the last batch of each is in {[str(p) for p in saved if p]}. Fix it, then "
            "--resume.")


def log_hook(log) -> Callable[[RoundInfo], None]:
    """Each round's metrics and samples to the run log (``RunLog``)."""

    def hook(info: RoundInfo) -> None:
        log.log_round(info.round, info.metrics)
        log.log_samples(info.round, info.samples)

    return hook


def eval_hook(run, log, num_prompts: int) -> Callable[[RoundInfo], None]:
    """Held-out greedy success of every policy (``run.evaluate``) to the run log as ``<policy>/eval``; with
    ``eval_samples`` also its avg@K / pass@k / maj@K, and the population's pass@k as ``population/eval`` (its
    ``success`` = population pass@1)."""

    def hook(info: RoundInfo) -> None:
        res = run.evaluate(info.state, num_prompts)
        pop = res.pop("population", None)
        rec = {f"{n}/eval": {k: v for k, v in m.items() if k in ("success",) or "@" in k} for n, m in res.items()}
        if pop is not None:
            rec["population/eval"] = {"success": pop["pass@1"], **{k: v for k, v in pop.items() if "@" in k}}
        log.log_round(info.round, rec)

    return hook


__all__ = ["CheckpointHook", "Hook", "LastInputs", "RoundInfo", "SkippedUpdatesStop", "TrainingStopped", "eval_hook",
           "log_hook", "nonfinite_cause"]


def reward_failure_hook(scorer) -> Callable[[RoundInfo], None]:
    """One stderr line per round whose reward calls failed (per function: count by kind, first message; a
    failed call scores 0), so a run never trains on failing rewards in silence."""
    import sys

    def report(info: RoundInfo) -> None:
        for name, (kinds, first) in scorer.take_failures().items():
            counts = ", ".join(f"{k} {v}" for k, v in kinds.items() if v)
            first = " ".join(str(first).split())[:300]
            print(f"mrl train: warning: round {info.round}: reward {name!r} failed on {sum(kinds.values())} calls "
                  f"({counts}; each scored 0); first: {first}", file=sys.stderr, flush=True)

    return report
