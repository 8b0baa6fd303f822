"""String-transformation tasks over a small alphabet.

=======  ======================  ==========
op       prompt text             answer
=======  ======================  ==========
rev      ``"rev:abc="``          ``"cba"``
sort     ``"sort:cab="``         ``"abc"``
cnt      ``"cnt:a:abca="``       ``"2"``  (occurrences of the char before the second colon)
copy     ``"copy:abc="``         ``"abc"``
shift    ``"shift:abh="``        ``"bca"`` (next letter of the alphabet, wrapping)
=======  ======================  ==========
"""
from __future__ import annotations

from .base import ID_BLOCK, Prompt, Task, _check_id_base, task_rng

__all__ = ["StringTask", "STRING_OPS"]

STRING_OPS = ("rev", "sort", "cnt", "copy", "shift")
_ALIASES = {"reverse": "rev", "count": "cnt"}


class StringTask(Task):
    """A string transformation with exact verification.

    Args:
      op: one of ``STRING_OPS`` (aliases: "reverse", "count").
      min_len, max_len: input length range (inclusive); keep ``max_len <= 12`` for short answers.
      alphabet: characters of the inputs (distinct; default ``"abcdefgh"``).
      n_train, n_eval: numbers of distinct train / held-out inputs.
      seed: the prompts are a pure function of ``(seed, name)``.
      name: task name (default: the op).
      id_base: first prompt id (default: a fixed block per op).
    """

    def __init__(
        self,
        op: str = "rev",
        *,
        min_len: int = 3,
        max_len: int = 8,
        alphabet: str = "abcdefgh",
        n_train: int = 2000,
        n_eval: int = 200,
        seed: int = 0,
        name: str | None = None,
        id_base: int | None = None,
    ):
        op = _ALIASES.get(op, op)
        if op not in STRING_OPS:
            raise ValueError(f"StringTask: op must be one of {STRING_OPS}, got {op!r}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"StringTask: need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        if len(set(alphabet)) != len(alphabet) or len(alphabet) < 2:
            raise ValueError(f"StringTask: alphabet must be >= 2 distinct characters, got {alphabet!r}")
        if any(c in ":=" or c.isspace() for c in alphabet):
            raise ValueError("StringTask: alphabet may not contain ':', '=' or whitespace")
        self.op, self.min_len, self.max_len, self.alphabet = op, int(min_len), int(max_len), alphabet
        self.n_train, self.n_eval, self.seed = int(n_train), int(n_eval), int(seed)
        self.name = name or op
        if self.n_train < 1 or self.n_eval < 0 or self.n_train + self.n_eval > ID_BLOCK:
            raise ValueError(f"StringTask {self.name!r}: need n_train >= 1, n_eval >= 0, total <= {ID_BLOCK}")
        self.id_base = (20 + STRING_OPS.index(op)) * ID_BLOCK if id_base is None else int(id_base)
        _check_id_base(self.id_base, self.n_train + self.n_eval, self.name)

    def answer_for(self, s: str, char: str | None = None) -> str:
        """The reference answer for input ``s`` (``char`` is the counted character for ``cnt``)."""
        if self.op == "rev":
            return s[::-1]
        if self.op == "sort":
            return "".join(sorted(s, key=self.alphabet.index))
        if self.op == "cnt":
            return str(s.count(char))
        if self.op == "copy":
            return s
        k = len(self.alphabet)
        return "".join(self.alphabet[(self.alphabet.index(c) + 1) % k] for c in s)

    def _build(self):
        rng = task_rng(self.seed, self.name)
        n = self.n_train + self.n_eval
        seen: set[str] = set()
        items: list[tuple[str, str | None]] = []
        attempts = 0
        limit = 50 * n + 1000
        while len(items) < n and attempts < limit:
            attempts += 1
            length = int(rng.integers(self.min_len, self.max_len + 1))
            s = "".join(self.alphabet[i] for i in rng.integers(0, len(self.alphabet), size=length))
            char = None
            if self.op == "cnt":  # half the time a char of s, else any char (answers 0 occur)
                char = s[int(rng.integers(0, length))] if rng.random() < 0.5 else self.alphabet[
                    int(rng.integers(0, len(self.alphabet)))]
            key = f"{char}:{s}" if char is not None else s
            if key in seen:
                continue
            seen.add(key)
            items.append((s, char))
        if len(items) < n:
            raise ValueError(
                f"StringTask {self.name!r}: could only draw {len(items)} distinct inputs of length "
                f"{self.min_len}..{self.max_len} over {self.alphabet!r}; lower n_train + n_eval ({n})"
            )
        prompts = []
        for i, (s, char) in enumerate(items):
            body = f"{char}:{s}" if char is not None else s
            split = "train" if i < self.n_train else "eval"
            prompts.append(
                Prompt(
                    id=self.id_base + i,
                    text=f"{self.op}:{body}=",
                    answer=self.answer_for(s, char),
                    task=self.name,
                    meta={"op": self.op, "input": s, "char": char, "split": split},
                )
            )
        return prompts[: self.n_train], prompts[self.n_train :]
