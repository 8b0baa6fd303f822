"""Orchestration of MRL rounds: configs, the round function, the run loop, checkpoints and logs."""

from mrl_jax.trainer.config import PolicySpec, RunConfig
from mrl_jax.trainer.loop import Run, TrainingStopped, evaluate_from_yaml, train, train_from_yaml
from mrl_jax.trainer.round import RunState, run_round

__all__ = ["PolicySpec", "Run", "RunConfig", "RunState", "TrainingStopped", "evaluate_from_yaml", "run_round",
           "train", "train_from_yaml"]
