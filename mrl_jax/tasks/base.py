"""Task and prompt datatypes, deterministic splitting, and the multi-task mixture.

A *task* is a finite, deterministic (from a seed) set of prompts with an exact verifier:

* ``train_prompts()`` -- prompts RL may train on;
* ``eval_prompts()``  -- held-out prompts (disjoint from the train ones for generated tasks; see
  :attr:`Task.heldout_disjoint`);
* ``verify(prompt, completion) -> float`` in ``[0, 1]``;
* ``sft_examples(part=None)`` -- ``(prompt_text, answer)`` pairs for supervised warm start.

Prompt ids are plain ``int`` values that fit in ``int32`` (SEE stores them in device arrays). Each task
owns a block of ``ID_BLOCK`` ids starting at its ``id_base``; a prompt's id is ``id_base + local index``.
The id of a prompt is a pure function of the task's configuration (including its seed), so it is stable
across runs; :class:`MixtureTask` checks that ids are unique across its components.
"""
from __future__ import annotations

import abc
import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

__all__ = [
    "ID_BLOCK",
    "INT32_MAX",
    "Prompt",
    "SFTExample",
    "Task",
    "MixtureTask",
    "exact_match",
    "filter_prompts",
    "hash_unit",
    "task_rng",
]

#: Ids reserved per task configuration: a task's prompts have ids ``id_base .. id_base + ID_BLOCK - 1``.
ID_BLOCK = 1_000_000
INT32_MAX = 2**31 - 1


@dataclass(frozen=True, eq=True)
class Prompt:
    """One prompt with its reference answer.

    Attributes:
      id: globally unique, stable integer id (fits in int32).
      text: the prompt text given to the policy, starting with the task token (e.g. ``"add:12+7="``).
      answer: the reference answer text (short, e.g. ``"19"``).
      task: name of the task that owns the prompt (the mixture dispatches :meth:`Task.verify` on it).
      meta: free-form metadata (e.g. ``{"part": "A", "key": "q7"}`` for facts). Not part of the hash.
    """

    id: int
    text: str
    answer: str
    task: str
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __hash__(self) -> int:  # meta is a dict: hash on the identifying fields only
        return hash((self.id, self.text, self.answer, self.task))


class SFTExample(NamedTuple):
    """A supervised pair: the model should continue ``prompt`` with ``answer``."""

    prompt: str
    answer: str


def exact_match(completion: str, answer: str) -> float:
    """1.0 iff ``completion`` equals ``answer`` after stripping leading/trailing whitespace, else 0.0.

    Interior characters must match exactly: a prefix (``"1"`` for ``"19"``), an extension (``"190"``),
    or inner whitespace (``"1 9"``) score 0.
    """
    return 1.0 if completion.strip() == answer else 0.0


def hash_unit(key: str, seed: int = 0) -> float:
    """A stable pseudo-random number in [0, 1) from ``(seed, key)`` (blake2b; independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def task_rng(seed: int, name: str) -> np.random.Generator:
    """Deterministic generator for task ``name`` under ``seed`` (CRC32 of the name, not Python's hash)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])


def filter_prompts(
    prompts: Iterable[Prompt], *, task: str | Sequence[str] | None = None, part: str | None = None
) -> list[Prompt]:
    """Prompts whose ``task`` is ``task`` (or one of them) and whose ``meta["part"]`` is ``part``."""
    tasks = None if task is None else ({task} if isinstance(task, str) else set(task))
    out = []
    for p in prompts:
        if tasks is not None and p.task not in tasks:
            continue
        if part is not None and p.meta.get("part") != part:
            continue
        out.append(p)
    return out


def _check_id_base(id_base: int, n: int, name: str) -> None:
    if id_base < 0 or id_base + max(n, 1) - 1 > INT32_MAX:
        raise ValueError(f"task {name!r}: ids {id_base}..{id_base + n - 1} do not fit in int32")


class Task(abc.ABC):
    """A verifiable task: deterministic prompts, an exact verifier, SFT pairs.

    Subclasses set ``self.name`` and implement :meth:`_build` returning ``(train, eval)`` prompt lists;
    the lists are built once, lazily. The default :meth:`verify` is :func:`exact_match` against
    ``prompt.answer``.
    """

    name: str
    #: partitions of the task's knowledge (e.g. ``("A", "B")`` for the fact table); ``()`` when none.
    parts: tuple[str, ...] = ()
    #: True when train and eval prompts are disjoint (texts and ids).
    heldout_disjoint: bool = True

    _train: list[Prompt] | None = None
    _eval: list[Prompt] | None = None
    _by_id: dict[int, Prompt] | None = None

    @abc.abstractmethod
    def _build(self) -> tuple[list[Prompt], list[Prompt]]:
        """Generate ``(train_prompts, eval_prompts)``."""

    def _ensure(self) -> None:
        if self._train is None:
            train, ev = self._build()
            self._train, self._eval = list(train), list(ev)
            by_id: dict[int, Prompt] = {}
            for p in self._train + self._eval:
                if p.id in by_id and by_id[p.id] != p:
                    raise ValueError(f"task {self.name!r}: duplicate prompt id {p.id}")
                by_id[p.id] = p
            self._by_id = by_id

    def train_prompts(self) -> list[Prompt]:
        """Prompts for training (a fresh list; the Prompt objects are shared and immutable)."""
        self._ensure()
        return list(self._train)

    def eval_prompts(self) -> list[Prompt]:
        """Held-out prompts (a fresh list)."""
        self._ensure()
        return list(self._eval)

    def prompt(self, prompt_id: int) -> Prompt:
        """The train or eval prompt with id ``prompt_id`` (KeyError if unknown)."""
        self._ensure()
        try:
            return self._by_id[int(prompt_id)]
        except KeyError:
            raise KeyError(f"task {self.name!r} has no prompt with id {prompt_id}") from None

    def verify(self, prompt: Prompt, completion: str) -> float:
        """Reward in [0, 1] of ``completion`` for ``prompt`` (exact match after stripping whitespace)."""
        return exact_match(completion, prompt.answer)

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        """Supervised ``(prompt, answer)`` pairs from the train prompts (``part`` selects a partition)."""
        self._ensure()
        if part is not None:
            if part not in self.parts:
                raise ValueError(f"task {self.name!r} has no part {part!r} (parts: {list(self.parts)})")
            prompts = [p for p in self._train if p.meta.get("part") == part]
        else:
            prompts = self._train
        return [SFTExample(p.text, p.answer) for p in prompts]

    def sample_train(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        """``n`` train prompts drawn uniformly with replacement."""
        self._ensure()
        idx = rng.integers(0, len(self._train), size=n)
        return [self._train[i] for i in idx]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class MixtureTask(Task):
    """Several tasks behind one interface; each prompt's text carries its task token.

    Args:
      tasks: component tasks (unique names, disjoint ids).
      weights: sampling weight per task for :meth:`sample_train` (default: uniform over tasks).
      seed: seed of the deterministic interleaving of :meth:`train_prompts` / :meth:`eval_prompts`.
      part_tasks: optional ``{part: [task names]}``; with it, ``sft_examples(part)`` includes un-partitioned
        tasks only when listed for that part (the "disjoint skills" setup). Without it, un-partitioned
        tasks are always included and partitioned tasks (the fact table) contribute the requested part.
      name: name of the mixture.
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        *,
        weights: Sequence[float] | None = None,
        seed: int = 0,
        part_tasks: Mapping[str, Sequence[str]] | None = None,
        name: str = "mixture",
    ):
        if not tasks:
            raise ValueError("MixtureTask needs at least one task")
        names = [t.name for t in tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"MixtureTask: duplicate task names {dup}; give the tasks distinct `name=`")
        if weights is None:
            weights = [1.0] * len(tasks)
        if len(weights) != len(tasks) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"MixtureTask: weights must be {len(tasks)} non-negative numbers with a positive sum")
        self.name = name
        self.tasks = list(tasks)
        self.by_name = {t.name: t for t in self.tasks}
        self.weights = np.asarray(weights, np.float64) / float(np.sum(weights))
        self.seed = int(seed)
        parts: list[str] = []
        for t in self.tasks:
            parts += [p for p in t.parts if p not in parts]
        if part_tasks is not None:
            for part, tnames in part_tasks.items():
                unknown = [n for n in tnames if n not in self.by_name]
                if unknown:
                    raise ValueError(f"MixtureTask: part_tasks[{part!r}] names unknown tasks {unknown}")
                if part not in parts:
                    parts.append(part)
        self.parts = tuple(parts)
        self.part_tasks = None if part_tasks is None else {k: list(v) for k, v in part_tasks.items()}
        self.heldout_disjoint = all(t.heldout_disjoint for t in self.tasks)
        self._sft_pool_cache: dict = {}

    def _build(self):
        owner: dict[int, str] = {}
        for t in self.tasks:
            for p in t.train_prompts() + t.eval_prompts():
                if owner.setdefault(p.id, t.name) != t.name:
                    raise ValueError(
                        f"MixtureTask: prompt id {p.id} is used by tasks {owner[p.id]!r} and {t.name!r}; "
                        "pass a distinct `id_base=` to one of them"
                    )
        rng = task_rng(self.seed, self.name)
        train = [p for t in self.tasks for p in t.train_prompts()]
        ev = [p for t in self.tasks for p in t.eval_prompts()]
        train = [train[i] for i in rng.permutation(len(train))]
        return train, ev

    def component(self, prompt: Prompt) -> Task:
        """The component task that owns ``prompt``."""
        try:
            return self.by_name[prompt.task]
        except KeyError:
            raise KeyError(
                f"mixture {self.name!r} has no task {prompt.task!r} (tasks: {list(self.by_name)})"
            ) from None

    def verify(self, prompt: Prompt, completion: str) -> float:
        return self.component(prompt).verify(prompt, completion)

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        if part is not None and part not in self.parts:
            raise ValueError(f"mixture {self.name!r} has no part {part!r} (parts: {list(self.parts)})")
        out: list[SFTExample] = []
        for t in self.tasks:
            if part is None:
                out += t.sft_examples()
            elif t.parts:
                if part in t.parts:
                    out += t.sft_examples(part)
            elif self.part_tasks is None or t.name in self.part_tasks.get(part, ()):
                out += t.sft_examples()
        rng = task_rng(self.seed, f"{self.name}/sft/{part}")
        return [out[i] for i in rng.permutation(len(out))]

    def sample_sft(self, n: int, rng: np.random.Generator, part: str | None = None) -> list[SFTExample]:
        """``n`` SFT pairs drawn like :meth:`sample_train`: a task by ``weights`` (among the tasks that
        contribute to ``part``), then one of its examples uniformly -- so a small fact table is not
        drowned by large generated tasks."""
        pools, p = self._sft_pools(part)
        ks = rng.choice(len(pools), size=n, p=p)
        return [pools[k][rng.integers(0, len(pools[k]))] for k in ks]

    def _sft_pools(self, part: str | None) -> tuple[list[list[SFTExample]], np.ndarray]:
        """(the SFT example pools contributing to ``part``, their draw probabilities), built once per part (a
        warm start draws thousands of batches from the same pools)."""
        if part not in self._sft_pool_cache:
            if part is not None and part not in self.parts:
                raise ValueError(f"mixture {self.name!r} has no part {part!r} (parts: {list(self.parts)})")
            pools, ws = [], []
            for t, w in zip(self.tasks, self.weights):
                if part is None:
                    ex = t.sft_examples()
                elif t.parts:
                    ex = t.sft_examples(part) if part in t.parts else []
                elif self.part_tasks is None or t.name in self.part_tasks.get(part, ()):
                    ex = t.sft_examples()
                else:
                    ex = []
                if ex and w > 0:
                    pools.append(ex)
                    ws.append(w)
            if not pools:
                raise ValueError(f"mixture {self.name!r}: no SFT examples for part {part!r}")
            self._sft_pool_cache[part] = (pools, np.asarray(ws) / np.sum(ws))
        return self._sft_pool_cache[part]

    def sample_train(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        """``n`` prompts: a task drawn by ``weights``, then a prompt uniformly within it."""
        ks = rng.choice(len(self.tasks), size=n, p=self.weights)
        out = []
        for k in ks:
            t = self.tasks[k]
            t._ensure()
            out.append(t._train[rng.integers(0, len(t._train))])
        return out
