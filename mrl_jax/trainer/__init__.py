"""Orchestration of MRL rounds: configs, the round function, the run loop, checkpoints and logs."""

from mrl_jax.trainer.config import PolicySpec, RunConfig
from mrl_jax.trainer.hooks import RoundInfo, TrainingStopped
from mrl_jax.trainer.loop import Trainer, evaluate_from_yaml, train, train_from_yaml
from mrl_jax.trainer.round import RoundInputs, RunState, run_round
from mrl_jax.trainer.run import Run

__all__ = ["PolicySpec", "RoundInfo", "RoundInputs", "Run", "RunConfig", "RunState", "Trainer", "TrainingStopped",
           "evaluate_from_yaml", "run_round", "train", "train_from_yaml"]
