"""Reward functions named in a run config (``rewards:``), with TRL's signature, and the built-ins.

A config entry is ``{function: "package.module:name", weight, name, isolation: thread | process, batch_size}`` or
``{builtin: accuracy | format | overlong, weight, name, ...options}``. A user function has TRL's signature::

    fn(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns) -> list[float | None]

where ``columns`` are the dataset's other columns (one list per column), as TRL passes them. As in TRL, one call
gets every completion of the scored batch (``batch_size: N`` in the entry: N per call), so a reward that ranks or
normalises within its batch sees all of it. The scorer's isolation, time limit (``reward_timeout_s`` per
completion) and failure counting (:mod:`mrl_jax.tasks.rewards`) apply per call; a call that raises, hangs or
returns no list of one value per completion is retried one completion at a time, so one bad completion scores 0
alone and counts as one failure. ``None`` means "not applicable": that component leaves the row's weighted sum
(TRL's ``nansum``) and its mean/std.

Built-ins: ``accuracy`` -- the task's verifier (its value is also the run's *success*, see
:func:`mrl_jax.tasks.rewards.gate_success`); ``format`` -- 1.0 when the completion matches ``pattern``
(``re.fullmatch``, DOTALL; default the think/answer layout of TRL's ``think_format_reward``); ``overlong``
-- DAPO's soft over-length penalty over ``max_length`` tokens with a ``cache`` window: 0 up to
``max_length - cache`` tokens, then linear down to -1 at ``max_length``, -1 beyond.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Mapping, Sequence

from mrl_jax.configs import import_attribute

from .base import Prompt, Task
from .reward_spec import Completion, RewardSpec

__all__ = ["Completion", "FormatReward", "OverlongReward", "TRLReward", "build_reward_specs", "resolve_function"]

BUILTINS = ("accuracy", "format", "overlong")
THINK_FORMAT = r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>"


def resolve_function(path: str, key: str = "rewards") -> Callable:
    """The callable at ``"package.module:name"``; ValueError (one line, naming ``key``) when it does not resolve."""
    mod_name, sep, attr = str(path).partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"config key '{key}': {path!r} is not 'package.module:function'")
    obj = import_attribute(mod_name, attr, f"config key '{key}'")
    if not callable(obj):
        raise ValueError(f"config key '{key}': {path!r} is a {type(obj).__name__}, not a function")
    return obj


def _columns(prompt: Prompt) -> dict:
    cols = (prompt.meta or {}).get("columns") or {}
    out = {"answer": prompt.answer} if not cols else {}
    out.update(cols)
    return out


class TRLReward:
    """``(prompts, completions) -> list[float | None]`` calling a TRL-signature function once on lists of the items
    (a batched :class:`RewardSpec`). Picklable by its import path, so it runs in worker processes too."""

    def __init__(self, path: str):
        self.path = path
        self.fn = resolve_function(path)

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> list:
        """One value per item; each dataset column a list over the items (None where an item lacks it)."""
        columns = [_columns(p) for p in prompts]
        names = list(dict.fromkeys(k for c in columns for k in c))
        kwargs = {k: [c.get(k) for c in columns] for k in names}
        ids = [getattr(c, "ids", None) for c in completions]
        out = self.fn(prompts=[p.text for p in prompts], completions=[str(c) for c in completions],
                      completion_ids=[i if i is not None else [] for i in ids], **kwargs)
        if not isinstance(out, (list, tuple)) or len(out) != len(prompts):
            raise TypeError(f"{self.path} must return a list with one value per completion ({len(prompts)}), got "
                            f"{str(out)[:60]}")
        return list(out)

    def __reduce__(self):
        return (TRLReward, (self.path,))


class FormatReward:
    """1.0 when the completion matches ``pattern`` entirely (``re.DOTALL``), else 0.0."""

    def __init__(self, pattern: str = THINK_FORMAT):
        self.pattern = pattern
        self._re = re.compile(pattern, re.DOTALL)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if self._re.fullmatch(str(completion).strip()) else 0.0

    def __reduce__(self):
        return (FormatReward, (self.pattern,))


class OverlongReward:
    """DAPO's soft over-length penalty in [-1, 0] on the completion's token count (``Completion.ids``)."""

    def __init__(self, max_length: int, cache: int):
        if not 0 <= cache < max_length:
            raise ValueError(f"overlong: need 0 <= cache < max_length, got cache={cache}, max_length={max_length}")
        self.max_length, self.cache = int(max_length), int(cache)

    def __call__(self, prompt: Prompt, completion: str) -> float:
        ids = getattr(completion, "ids", None)
        if ids is None:
            raise TypeError("overlong needs the completion's token ids (score with completion_ids=...)")
        n, start = len(ids), self.max_length - self.cache
        if n <= start:
            return 0.0
        return -1.0 if n > self.max_length else (start - n) / max(self.cache, 1)

    def __reduce__(self):
        return (OverlongReward, (self.max_length, self.cache))


def _no_task(prompt: Prompt, completion: str) -> float:
    raise RuntimeError("reward specs built without a task (config check) cannot score")


def _builtin(entry: Mapping, task: Task | None, key: str) -> tuple[Callable, str, tuple[float, float], bool]:
    """``(fn, isolation, (low, high), success)`` of a built-in entry."""
    kind, opts = entry["builtin"], {k: v for k, v in entry.items() if k not in ("builtin", "weight", "name")}
    allowed = {"accuracy": set(), "format": {"pattern"}, "overlong": {"max_length", "cache"}}
    if kind not in allowed:
        raise ValueError(f"config key '{key}.builtin': {kind!r} is not one of {list(BUILTINS)}")
    extra = sorted(set(opts) - allowed[kind])
    if extra:
        raise ValueError(f"config key '{key}': builtin {kind!r} takes no {extra} (options: {sorted(allowed[kind])})")
    if kind == "accuracy":
        if task is None:   # checking a config before the task exists
            return _no_task, "thread", (0.0, 1.0), True
        return (getattr(task, "reward_fn", task.verify), getattr(task, "reward_isolation", "thread"),
                (0.0, 1.0), True)
    if kind == "format":
        try:
            return FormatReward(opts.get("pattern", THINK_FORMAT)), "thread", (0.0, 1.0), False
        except re.error as e:
            raise ValueError(f"config key '{key}.pattern': bad regex ({e})") from None
    if "max_length" not in opts:
        raise ValueError(f"config key '{key}.max_length': builtin overlong needs max_length (tokens)")
    try:
        fn = OverlongReward(int(opts["max_length"]), int(opts.get("cache", int(opts["max_length"]) // 4)))
    except ValueError as e:
        raise ValueError(f"config key '{key}': {e}") from None
    return fn, "thread", (-1.0, 0.0), False


def _weight(entry: Mapping, key: str) -> float:
    """``entry``'s weight (default 1.0); a ``ValueError`` naming ``rewards[i].weight`` unless a finite number."""
    w = entry.get("weight", 1.0)
    ok = isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
    if not ok:
        raise ValueError(f"config key '{key}.weight': {w!r} is not a finite number; give a number such as "
                         "weight: 0.5 (the total reward is the weighted sum)")
    return float(w)


def build_reward_specs(entries: Sequence[Mapping], task: Task | None, *, timeout_s: float) -> list[RewardSpec]:
    """The :class:`RewardSpec` list of a config's ``rewards:``. When no ``accuracy`` entry is given, the
    verifier still runs with weight 0: it defines success. ``task`` None checks the entries only (ValueError
    naming ``rewards[i]``); the accuracy placeholder then cannot score."""
    specs: list[RewardSpec] = []
    for i, entry in enumerate(entries):
        key = f"rewards[{i}]"
        if not isinstance(entry, Mapping) or ("function" in entry) == ("builtin" in entry):
            raise ValueError(f"config key '{key}': give exactly one of 'function: pkg.mod:name' or 'builtin: "
                             f"{' | '.join(BUILTINS)}'")
        weight = _weight(entry, key)
        if "function" in entry:
            extra = sorted(set(entry) - {"function", "weight", "name", "isolation", "batch_size"})
            if extra:
                raise ValueError(f"config key '{key}': unknown options {extra} (function, weight, name, isolation, "
                                 "batch_size)")
            batch_size = entry.get("batch_size")
            if batch_size is not None and not (type(batch_size) is int and batch_size >= 1):
                raise ValueError(f"config key '{key}.batch_size': {batch_size!r} is not a whole number >= 1; give "
                                 "batch_size: 1 to call the function per completion, or leave it out for the batch")
            isolation = entry.get("isolation", "thread")
            if isolation not in ("thread", "process"):
                raise ValueError(f"config key '{key}.isolation': {isolation!r} is not 'thread' or 'process'")
            try:
                fn = TRLReward(entry["function"])
            except ValueError as e:
                raise ValueError(str(e).replace("'rewards'", f"'{key}.function'")) from None
            name = entry.get("name") or entry["function"].rpartition(":")[2].rpartition(".")[2]
            specs.append(RewardSpec(fn, weight=weight, name=name, timeout_s=timeout_s, isolation=isolation,
                                    low=-math.inf, high=math.inf, allow_none=True, batched=True,
                                    batch_size=batch_size))
            continue
        fn, isolation, (low, high), success = _builtin(entry, task, key)
        specs.append(RewardSpec(fn, weight=weight, name=entry.get("name") or entry["builtin"], timeout_s=timeout_s,
                                isolation=isolation, low=low, high=high, success=success))
    if not any(s.success for s in specs):
        fn, isolation, _, _ = _builtin({"builtin": "accuracy"}, task, "rewards")
        specs.append(RewardSpec(fn, weight=0.0, name="accuracy", timeout_s=timeout_s, isolation=isolation,
                                success=True))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"config key 'rewards': names {dup} repeat; give each entry a distinct name")
    return specs
