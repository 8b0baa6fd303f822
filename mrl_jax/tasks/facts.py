"""Synthetic fact table (the embedded-default demo's complementary knowledge) and the default mixture.

A table of ``num_keys`` random keys -> values, e.g. ``"fact:q7="`` -> ``"cfa"``. Values are distinct
random strings, so a value memorised for one key is always wrong for another, and guessing succeeds with
probability about ``1 / len(value_alphabet) ** value_len``: GRPO alone cannot discover a missing part.
The keys are partitioned into parts (default ``"A"`` and ``"B"``); ``sft_examples(part="A")`` warm-starts
a policy on part A only, and a verified peer answer is what can teach it part B.

Held-out prompts: a fact cannot be inferred from other facts, so by default the held-out set *is* the
table (``eval_prompts()`` returns the same prompts as ``train_prompts()``; ``heldout_disjoint`` is
False) and measures recall per part. With ``heldout_fraction > 0`` a seeded subset of keys per part is
held out of the RL train prompts (still in ``sft_examples``), and train / eval are disjoint.
"""
from __future__ import annotations

from typing import Sequence

from .base import ID_BLOCK, MixtureTask, Prompt, SFTExample, Task, _check_id_base, task_rng

__all__ = ["FactTableTask", "default_mixture"]


class FactTableTask(Task):
    """Key -> value lookup table split into parts.

    Args:
      num_keys: number of facts (keys ``f"{key_prefix}{i}"``, i < num_keys).
      parts: names of the partitions; keys are shuffled then split into equal contiguous groups.
      value_len: characters per value (answers are short; keep <= 12).
      value_alphabet: characters of the values.
      key_prefix: prefix of the key names.
      heldout_fraction: fraction of each part's keys removed from the train prompts and used as eval.
      seed: table, partition and split are a pure function of ``(seed, name)``.
      name: task name (and task token in the prompt text: ``f"{name}:{key}="``).
      id_base: first prompt id (default block 40).
    """

    def __init__(
        self,
        num_keys: int = 32,
        *,
        parts: Sequence[str] = ("A", "B"),
        value_len: int = 3,
        value_alphabet: str = "abcdefgh",
        key_prefix: str = "q",
        heldout_fraction: float = 0.0,
        seed: int = 0,
        name: str = "fact",
        id_base: int | None = None,
    ):
        parts = tuple(parts)
        if not parts or len(set(parts)) != len(parts):
            raise ValueError(f"FactTableTask: parts must be distinct names, got {parts}")
        if num_keys < len(parts):
            raise ValueError(f"FactTableTask: num_keys={num_keys} < number of parts {len(parts)}")
        if len(set(value_alphabet)) ** value_len < num_keys:
            raise ValueError("FactTableTask: value space too small for distinct values; raise value_len")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"FactTableTask: heldout_fraction must be in [0, 1), got {heldout_fraction}")
        if num_keys > ID_BLOCK:
            raise ValueError(f"FactTableTask: at most {ID_BLOCK} keys")
        self.num_keys, self.parts, self.value_len = int(num_keys), parts, int(value_len)
        self.value_alphabet, self.key_prefix = value_alphabet, key_prefix
        self.heldout_fraction, self.seed, self.name = float(heldout_fraction), int(seed), name
        self.heldout_disjoint = self.heldout_fraction > 0
        self.id_base = 40 * ID_BLOCK if id_base is None else int(id_base)
        _check_id_base(self.id_base, self.num_keys, self.name)
        self._all: list[Prompt] | None = None

    def table(self) -> dict[str, str]:
        """The full ``{key: value}`` table."""
        self._ensure()
        return {p.meta["key"]: p.answer for p in self._all}

    def _build(self):
        rng = task_rng(self.seed, self.name)
        k = len(self.value_alphabet)
        values: list[str] = []
        seen: set[str] = set()
        while len(values) < self.num_keys:
            v = "".join(self.value_alphabet[i] for i in rng.integers(0, k, size=self.value_len))
            if v not in seen:
                seen.add(v)
                values.append(v)
        order = rng.permutation(self.num_keys)  # key index -> position in the partition order
        n_parts = len(self.parts)
        part_of = {}
        for pos, key_idx in enumerate(order.tolist()):
            part_of[key_idx] = self.parts[pos * n_parts // self.num_keys]
        heldout: set[int] = set()
        if self.heldout_fraction > 0:
            for part in self.parts:
                keys = [i for i in range(self.num_keys) if part_of[i] == part]
                n_out = max(1, int(round(self.heldout_fraction * len(keys))))
                n_out = min(n_out, len(keys) - 1)
                heldout |= {keys[j] for j in rng.permutation(len(keys))[:n_out].tolist()}
        prompts = []
        for i in range(self.num_keys):
            key = f"{self.key_prefix}{i}"
            prompts.append(
                Prompt(
                    id=self.id_base + i,
                    text=f"{self.name}:{key}=",
                    answer=values[i],
                    task=self.name,
                    meta={"key": key, "part": part_of[i], "split": "eval" if i in heldout else "train"},
                )
            )
        self._all = prompts
        if not heldout:
            return prompts, prompts
        return [p for p in prompts if p.id - self.id_base not in heldout], [
            p for p in prompts if p.id - self.id_base in heldout
        ]

    def sft_examples(self, part: str | None = None) -> list[SFTExample]:
        """Pairs for every fact of ``part`` (all parts when None), held-out keys included."""
        self._ensure()
        if part is not None and part not in self.parts:
            raise ValueError(f"task {self.name!r} has no part {part!r} (parts: {list(self.parts)})")
        return [SFTExample(p.text, p.answer) for p in self._all if part is None or p.meta["part"] == part]


def default_mixture(seed: int = 0, *, num_facts: int = 32, fact_parts: Sequence[str] = ("A", "B")) -> MixtureTask:
    """The embedded-default demo mixture: shared skills + a partitioned fact table.

    Components: ``add1`` (1-digit addition), ``rev`` and ``copy`` (length 3..6 over ``"abcdef"``), and
    ``fact`` (``num_facts`` keys in ``fact_parts``). ``sft_examples(part="A")`` gives every shared-skill
    example plus the facts of part A, so two policies warm-started on parts A and B share the task-token
    conditioning but know complementary facts. Sampling weights favour the fact table (half the prompts).
    """
    from .arith import ArithmeticTask
    from .strings import StringTask

    tasks = [
        ArithmeticTask("add", 1, seed=seed),
        StringTask("rev", min_len=3, max_len=6, alphabet="abcdef", n_train=1000, n_eval=100, seed=seed),
        StringTask("copy", min_len=3, max_len=6, alphabet="abcdef", n_train=1000, n_eval=100, seed=seed),
        FactTableTask(num_facts, parts=fact_parts, seed=seed),
    ]
    return MixtureTask(tasks, weights=[1, 1, 1, 3], seed=seed, name="default")
