"""reasoning-gym datasets as a task: procedurally generated (no download), scored by each dataset's own
``score_answer``.

``datasets={name: weight}`` (with per-dataset ``config`` options) become one reasoning-gym composite dataset
(``reasoning_gym.create_dataset("composite", ...)``): ``size`` train prompts from ``seed`` and ``eval_size``
held-out prompts from ``seed + EVAL_SEED_OFFSET`` (reasoning-gym draws item ``i`` from ``Random(seed + i)``,
so nearby seeds share items; the offset exceeds any allowed size, and a generated question that also appears
among the train ones is dropped from the eval set, so the two are disjoint). The answer is read from the
completion as reasoning-gym's evaluation does (``reasoning_gym.utils.extract_answer``: the last
``<answer>...</answer>``; the whole stripped completion when there is no tag) and scored by the source
dataset's ``score_answer`` (in [0, 1]; partial credit exists for some datasets).
"""
from __future__ import annotations

from typing import Any, Mapping

from .base import Prompt, SFTExample, Task

__all__ = ["REASONING_GYM_ID_BASE", "ReasoningGymConfigError", "ReasoningGymReward", "ReasoningGymTask", "extract_rg_answer"]

REASONING_GYM_ID_BASE = 1_400_000_000
_EVAL_OFFSET = 100_000_000
EVAL_SEED_OFFSET = 1_000_000_007


def extract_rg_answer(completion: str) -> str:
    """The completion's answer as reasoning-gym's evaluation reads it."""
    from reasoning_gym.utils import extract_answer

    out = extract_answer(str(completion))
    return out if out is not None else str(completion).strip()


def _score_fn(source: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source)


class ReasoningGymReward:
    """Picklable ``(prompt, completion) -> float``: the source dataset's ``score_answer`` on the extracted answer
    (the entry rebuilt from ``prompt.answer`` and ``prompt.meta["entry_metadata"]``)."""

    def __call__(self, prompt: Prompt, completion: str) -> float:
        meta = prompt.meta["entry_metadata"]
        entry = {"question": prompt.text, "answer": prompt.answer, "metadata": meta}
        return float(_score_fn(meta["source_dataset"])(extract_rg_answer(completion), entry))


class ReasoningGymConfigError(ValueError):
    """``task.datasets`` / ``task.config`` name no reasoning-gym dataset or option; the message names the key."""


def _check_names(datasets: Mapping, config: Mapping, known: Mapping) -> None:
    """Every ``datasets`` name is a reasoning-gym dataset with a finite weight > 0, and every ``config`` entry is
    one of ``datasets``."""
    import difflib

    for n in datasets:
        if n not in known:
            close = difflib.get_close_matches(n, list(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ReasoningGymConfigError(f"config key 'task.datasets.{n}': no reasoning-gym dataset {n!r}; {hint}"
                                          "reasoning_gym.factory.DATASETS lists them all")
    for n, w in datasets.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w < float("inf"):
            raise ReasoningGymConfigError(f"config key 'task.datasets.{n}': weight {w!r} is not a number > 0 (the "
                                          f"dataset's share of the prompts); give e.g. {n}: 1.0, or drop {n!r}")
    for n in config:
        if n not in datasets:
            raise ReasoningGymConfigError(f"config key 'task.config.{n}': {n!r} has options but is not in "
                                          f"task.datasets {sorted(datasets)}; add it there with a weight, or drop "
                                          "its config entry")


def _check_options(name: str, opts: dict, config_cls) -> None:
    """``opts`` build ``config_cls`` (the dataset's config dataclass) and pass its own ``validate``."""
    import dataclasses

    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    bad = [k for k in opts if k not in fields]
    if bad:
        raise ReasoningGymConfigError(f"config key 'task.config.{name}.{bad[0]}': {config_cls.__name__} has no option "
                                      f"{bad[0]!r}; valid options: {', '.join(fields)}")
    try:
        cfg = config_cls(**opts)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ReasoningGymConfigError(f"config key 'task.config.{name}': {config_cls.__name__} rejects {opts}: "
                                      f"{' '.join(str(e).split()) or type(e).__name__}") from None


class ReasoningGymTask(Task):
    """A reasoning-gym composite (see the module docstring).

    Args:
      datasets: ``{reasoning-gym dataset name: weight}``.
      config: ``{dataset name: {option: value}}`` passed to that dataset's config.
      size, eval_size: train / held-out prompts generated.
      seed: train seed (eval: ``seed + EVAL_SEED_OFFSET``).
    """

    def __init__(self, datasets: Mapping[str, float], *, config: Mapping[str, Mapping[str, Any]] | None = None,
                 size: int = 1000, eval_size: int = 128, seed: int = 0, name: str = "reasoning_gym",
                 id_base: int = REASONING_GYM_ID_BASE):
        import reasoning_gym

        from reasoning_gym.factory import DATASETS

        config = dict(config or {})
        _check_names(datasets, config, DATASETS)
        for n, opts in config.items():
            _check_options(n, dict(opts), DATASETS[n][1])
        if size >= _EVAL_OFFSET or eval_size >= _EVAL_OFFSET:
            raise ValueError(f"task.size: at most {_EVAL_OFFSET - 1} prompts")
        self._rg = reasoning_gym
        self.datasets, self.config = dict(datasets), config
        self.size, self.eval_size, self.seed, self.name, self.id_base = size, eval_size, int(seed), name, id_base
        self.reward_fn, self.reward_isolation = ReasoningGymReward(), "thread"

    def _composite(self, size: int, seed: int):
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(n, float(w), dict(self.config.get(n, {}))) for n, w in self.datasets.items()]
        return self._rg.create_dataset("composite", datasets=specs, size=size, seed=seed)

    def _prompts(self, ds, offset: int, skip: set[str]) -> list[Prompt]:
        out = []
        for i in range(len(ds)):
            e = ds[i]
            if e["question"] in skip:
                continue
            meta = dict(e["metadata"])
            out.append(Prompt(id=self.id_base + offset + i, text=e["question"], answer=str(e["answer"]),
                              task=self.name, meta={"entry_metadata": meta, "dataset": meta["source_dataset"]}))
        return out

    def _build(self):
        train = self._prompts(self._composite(self.size, self.seed), 0, set())
        ev = self._prompts(self._composite(self.eval_size, self.seed + EVAL_SEED_OFFSET), _EVAL_OFFSET,
                           {p.text for p in train})
        return train, ev

    def verify(self, prompt: Prompt, completion: str) -> float:
        return self.reward_fn(prompt, completion)

    def answer_key(self, prompt: Prompt, completion: str) -> str | None:
        return extract_rg_answer(completion) or None

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        if part is not None:
            raise ValueError(f"task {self.name!r} has no parts")
        self._ensure()
        return [SFTExample(p.text, p.answer) for p in self._train]
