"""``task:`` of a run config: which verifiable task, and the table that builds it (one builder per name)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Callable, Literal, Optional

from mrl_jax.configs import ConfigError, check, field
from mrl_jax.tasks import ArithmeticTask, DatasetError, DatasetTask, JsonlTask, StringTask, Task, default_mixture


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """The verifiable task."""

    name: Literal["mixture", "arith", "reverse", "jsonl", "dataset", "reasoning_gym"] = field(
        "mixture", help="mixture = add/rev/copy + a fact table split in parts A and B; arith = 2-digit addition; "
                        "reverse = string reversal; jsonl = a local file; dataset = a local file or save_to_disk "
                        "directory read by `datasets` (mrl_jax.tasks.dataset); reasoning_gym = generated "
                        "reasoning-gym datasets")
    path: Optional[str] = field(None, help="jsonl / dataset: the local file (dataset: parquet, jsonl, json, csv, arrow "
                                           "or a save_to_disk directory; never the hub)")
    num_facts: int = field(32, help="mixture: fact table size")
    seed: int = field(0, help="task generator seed (dataset: seed of the eval_fraction hash split; reasoning_gym: "
                              "train seed, the eval set uses a seed 1_000_000_007 above it)")
    format: Literal["auto", "json", "jsonl", "parquet", "csv", "arrow"] = field(
        "auto", help="dataset: file format (auto = from the extension)")
    split: Optional[str] = field(None, help="dataset: split of a save_to_disk DatasetDict (default train)")
    prompt_field: str = field("prompt", help="dataset: prompt column: a string (TRL standard) or messages "
                                             "[{role: system}?, {role: user}] (TRL conversational)")
    answer_field: str = field("answer", help="dataset: reference-answer column; every column but the prompt reaches "
                                             "reward functions as a keyword argument")
    id_field: Optional[str] = field(None, help="dataset: integer id column (default: row position in the file)")
    eval_path: Optional[str] = field(None, help="dataset: held-out prompts from this file")
    eval_split: Optional[str] = field(None, help="dataset: held-out prompts from this split of the directory")
    eval_fraction: float = field(0.1, help="dataset: held-out fraction of the rows (seeded hash of the prompt) when "
                                           "neither eval_path nor eval_split is given")
    system_prompt: Optional[str] = field(None, help="dataset: text written before every prompt (blank line between)")
    verifier: Literal["math_verify", "gsm8k", "exact"] = field(
        "math_verify", help="dataset: answer check (math_verify = HF math-verify, run in reward worker processes "
                            "under reward_timeout_s; gsm8k = the number after ####; exact = stripped equality)")
    datasets: dict[str, float] = field(default_factory=dict, help="reasoning_gym: {dataset name: weight}")
    config: dict[str, dict] = field(default_factory=dict, help="reasoning_gym: {dataset name: its config options}")
    size: int = field(1000, help="reasoning_gym: train prompts generated (eval: eval_prompts of the run)")

    def __post_init__(self):
        check(self.name != "jsonl" or self.path is not None, "path", "task 'jsonl' needs a path to the .jsonl file")
        check(self.name != "dataset" or self.path is not None, "path", "task 'dataset' needs a local file or directory")
        check(self.name != "reasoning_gym" or bool(self.datasets), "datasets",
              "task 'reasoning_gym' needs {dataset name: weight, ...}")
        check(self.name != "reasoning_gym" or importlib.util.find_spec("reasoning_gym") is not None, "task.name",
              "task 'reasoning_gym' needs the reasoning-gym package, which `pip install -e .` does not bring; "
              "install it with pip install -e '.[reasoning]'")
        check(0.0 <= self.eval_fraction < 1.0, "eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        check(self.size > 0, "size", f"must be > 0, got {self.size}")
        check(sum(x is not None for x in (self.eval_path, self.eval_split)) <= 1, "eval_path",
              "give eval_path or eval_split, not both")
        for key in ("split", "eval_split", "eval_path"):
            check(self.name == "dataset" or getattr(self, key) is None, key,
                  f"only task 'dataset' reads it, this task is {self.name!r} (its held-out prompts are its own); "
                  f"drop task.{key} or use name: dataset")
        check(self.name != "dataset" or self.eval_path is not None or self.eval_split is not None
              or self.eval_fraction > 0, "eval_fraction",
              "0.0 with neither eval_path nor eval_split holds out no rows, so every held-out figure would be of "
              "nothing; set it > 0 (e.g. 0.1), or give the held-out rows in task.eval_path")

    def build(self, eval_prompts: int = 128) -> Task:
        """The task (``BUILDERS[name]``); ``eval_prompts``: the held-out prompts a generated task makes.
        ``ConfigError`` naming the key for a file or option the task refuses."""
        return BUILDERS[self.name](self, eval_prompts)


def _dataset(t: TaskSpec, eval_prompts: int) -> Task:
    plain = Path(t.path).is_file()   # a file has one split; a save_to_disk directory may have several
    for key in ("split", "eval_split"):
        if plain and getattr(t, key) is not None:
            raise ConfigError(f"config key 'task.{key}': {t.path} is a plain file, which has no splits (its rows "
                              f"are the training set); drop task.{key} and give held-out rows with "
                              "task.eval_path (another file) or task.eval_fraction, or point task.path at a "
                              "save_to_disk DatasetDict directory")
    try:
        task = DatasetTask(t.path, format=t.format, split=t.split, prompt_field=t.prompt_field,
                           answer_field=t.answer_field, id_field=t.id_field, eval_path=t.eval_path,
                           eval_split=t.eval_split, eval_fraction=0.0 if (t.eval_path or t.eval_split)
                           else t.eval_fraction, system_prompt=t.system_prompt, verifier=t.verifier, seed=t.seed)
        task.train_prompts()   # read now: a bad file is a config error
        return task
    except DatasetError as e:
        raise ConfigError(f"config key 'task': {e}") from None


def _reasoning_gym(t: TaskSpec, eval_prompts: int) -> Task:
    from mrl_jax.tasks.reasoning_gym import ReasoningGymConfigError, ReasoningGymTask

    try:
        return ReasoningGymTask(t.datasets, config=t.config, size=t.size, eval_size=eval_prompts, seed=t.seed)
    except ReasoningGymConfigError as e:
        raise ConfigError(str(e)) from None


def _jsonl(t: TaskSpec, eval_prompts: int) -> Task:
    if not Path(t.path).is_file():
        raise ConfigError(f"config key 'task.path': {t.path} is not a file (missing, or a directory); give the "
                          ".jsonl file of {prompt, answer} lines")
    return JsonlTask(t.path, seed=t.seed)


BUILDERS: dict[str, Callable[[TaskSpec, int], Task]] = {
    "mixture": lambda t, _: default_mixture(t.seed, num_facts=t.num_facts),
    "arith": lambda t, _: ArithmeticTask("add", 2, seed=t.seed),
    "reverse": lambda t, _: StringTask("rev", seed=t.seed),
    "jsonl": _jsonl,
    "dataset": _dataset,
    "reasoning_gym": _reasoning_gym,
}

__all__ = ["BUILDERS", "TaskSpec"]
