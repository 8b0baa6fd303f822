"""A run's construction as values: ``build_parts(cfg)`` builds every piece of a config once and returns them as
one frozen `Parts` -- the task and its prompts fitted to the policies' limits (`Prompts`), each policy's built
pieces on its mesh (`trainer.policy.BuiltPolicy`), each policy's slot width (`prompt_width`), the device
placement, the SEE text budget. The planners are functions of these values: the memory plan
(`trainer.memory.plan_memory(parts)`) and the TPU plan (`trainer.tpu_plan.plan_for_topology`); `trainer.run.Run`
composes their results, a `Policy` born complete (mesh, slot width, slots, update) from its pieces.

    parts = build_parts(cfg)                               # tokenizers, models, placement, pinned updates
    memory = plan_memory(parts)                            # None where no device limit is known
    policies = [b.policy(w, s) for b, w, s in zip(parts.policies, parts.widths, slots)]

``abstract=True``: models as shapes only (checkpoints' ``config.json`` read, no weights), for compiling the steps
(``devices`` may then be a TPU topology's, `mrl_jax.trainer.tpu_plan`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError, config_warning
from mrl_jax.sampler import bucket_length
from mrl_jax.tasks import Prompt, Task
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.encoding import PROMPT_BUCKETS
from mrl_jax.trainer.placement import Placement, make_placement
from mrl_jax.trainer.policy import (BuiltPolicy, add_lora, build_model, build_policy, build_prompt_format,
                                    build_tokenizer)
from mrl_jax.trainer.round import RunState


def build_task(cfg: RunConfig) -> Task:
    """The run's task: ``cfg.task.build`` with the run's held-out size."""
    return cfg.task.build(cfg.eval_prompts)


def _no_heldout(cfg: RunConfig) -> str:
    """The error of a task that gave no held-out prompt: its held-out figures would be 0.0 of nothing."""
    t = cfg.task
    key, fix = {"dataset": ("task.eval_fraction", "raise task.eval_fraction, or give the held-out rows in "
                                                  "task.eval_path (or task.eval_split of a directory)"),
                "jsonl": ("task.path", "the file holds too few distinct prompts for its 10% hash split; add rows, "
                                       "or use name: dataset with task.eval_path")}.get(t.name, ("task", "use another task"))
    return (f"config key '{key}': the task {t.name!r} has no held-out prompts, so every evaluation would report "
            f"success 0.0 of n 0; {fix}")


def task_corpus(task: Task) -> list[str]:
    """Texts a locally trained tokenizer learns from: every prompt and answer."""
    prompts = task.train_prompts() + task.eval_prompts()
    return [p.text for p in prompts] + [p.answer for p in prompts]


def text_budget(requested: int, policies: Sequence) -> int:
    """SEE bytes per completion text: enough for ``max_new_tokens`` of the longest token of each policy's
    tokenizer (``requested`` 0 = exactly that; a smaller explicit value is a config error)."""
    need = {p.name: (int(p.tokenizer.byte_table.lengths.max()) * p.max_completion_length, p.max_completion_length)
            for p in policies}
    worst = max(need, key=lambda n: need[n][0])
    size, tokens = need[worst]
    if requested == 0:
        return size
    if requested < size:
        raise ConfigError(f"config key 'see.max_text_bytes': {requested} bytes may not hold {tokens} tokens of policy "
                          f"{worst!r} (its longest token is {size // tokens} bytes); set it to >= {size}, or 0 to "
                          "size it automatically.")
    return requested


def prompt_lengths(texts: Sequence[str], tokenizers: Sequence, formats: Sequence) -> np.ndarray:
    """int[N, num_policies]: each policy's prompt token count (template and BOS included), as ``encode_prompts``
    encodes it."""
    out = np.zeros((len(texts), len(tokenizers)), np.int64)
    for k, (tok, fmt) in enumerate(zip(tokenizers, formats)):
        out[:, k] = [len(q) for q in fmt.encode(tok, texts)]
    return out


# -------------------------------------------------------------------------------------------- prompts
@dataclasses.dataclass(frozen=True)
class Prompts:
    """The task's prompts as the run draws them: ``train`` (every train prompt, the SEE's dense ids in this
    order), ``eval`` (held out, after ``overlong_prompts``), the train ids never drawn (``rejected``), the
    truncated prompt that replaces an overlong one (``replacement``, by id) and the overlong counts (``stats``)."""

    train: tuple
    eval: tuple
    rejected: frozenset = frozenset()
    replacement: Mapping[int, Prompt] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    stats: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    def drawn_texts(self) -> list[str]:
        """Every train prompt's text as a round draws it (rejected ones never, truncated ones truncated)."""
        return [self.replacement.get(p.id, p).text for p in self.train if p.id not in self.rejected]


def _truncated(prompt: Prompt, fits, limits) -> Prompt:
    """``prompt`` with the longest tail of its text that fits every policy's limit (``fits(text)``)."""
    text = prompt.text
    lo, hi = 0, len(text)  # find the smallest start whose tail fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(text[mid:]) else (mid + 1, hi)
    while lo < len(text) and not fits(text[lo:]):
        lo += 1
    if not fits(text[lo:]):
        raise ConfigError(
            f"config key 'policies[*].max_prompt_length': limits {list(limits)} are shorter than the "
            "prompt template alone; raise max_prompt_length (or shorten prompt_template).")
    return dataclasses.replace(prompt, text=text[lo:])


def fit_prompts(train: Sequence[Prompt], held_out: Sequence[Prompt], tokenizers: Sequence, formats: Sequence,
                limits: Sequence[int], overlong: str, eval_prompts: int) -> Prompts:
    """The prompt length limits (``overlong``: the config's ``overlong_prompts``, reject or truncate) applied to the
    train and held-out prompts; a warning when fewer than ``eval_prompts`` held-out prompts remain."""
    limits_ = np.asarray(limits)

    def lengths(texts):
        return prompt_lengths(texts, tokenizers, formats)

    def fits(text: str) -> bool:
        return bool(np.all(lengths([text])[0] <= limits_))

    rejected: set[int] = set()
    replacement: dict[int, Prompt] = {}
    stats = {}
    kept_eval = list(held_out)
    for split, prompts in (("train", train), ("eval", held_out)):
        if not prompts:
            continue
        over = np.any(lengths([p.text for p in prompts]) > limits_, axis=1)
        stats[f"{split}_prompts_overlong"] = int(over.sum())
        if not over.any():
            continue
        if overlong == "reject":
            if over.all():
                raise ConfigError(
                    f"config key 'policies[*].max_prompt_length': every {split} prompt is longer than the "
                    f"limits {list(limits)} (tokens per policy); raise max_prompt_length or set "
                    "overlong_prompts: truncate.")
            rejected.update(p.id for p, o in zip(prompts, over) if o)
            kept = [p for p, o in zip(prompts, over) if not o]
        else:
            kept = [_truncated(p, fits, limits) if o else p for p, o in zip(prompts, over)]
            replacement.update((p.id, q) for p, q, o in zip(prompts, kept, over) if o)
        if split == "eval":
            kept_eval = kept
    if len(kept_eval) < eval_prompts:
        config_warning("eval_prompts", f"{eval_prompts}, but the task has {len(kept_eval)} "
                                       "held-out prompts (after overlong_prompts); each evaluation uses those")
    return Prompts(train=tuple(train), eval=tuple(kept_eval), rejected=frozenset(rejected),
                   replacement=MappingProxyType(replacement), stats=MappingProxyType(stats))


def prompt_width(texts: Sequence[str], tokenizer, prompt_format, limit: int) -> int:
    """The widest prompt array a round can give a policy: its longest of ``texts`` (the train prompts as drawn:
    `Prompts.drawn_texts`), bucketed and capped at ``limit`` as ``encoding.encode_prompts`` does."""
    seqs = prompt_format.encode(tokenizer, list(texts))
    longest = max(1, max(len(s) for s in seqs))
    return max(longest, min(bucket_length(longest, PROMPT_BUCKETS), limit))


# ---------------------------------------------------------------------------------------------- parts
def _size(tree) -> int:
    """Elements in ``tree`` (arrays or shapes): a model's parameter count for the cost model."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def _shapes(tree):
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves without shardings (what a numpy template restores as)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@dataclasses.dataclass(frozen=True)
class Parts:
    """The built pieces of a run (`build_parts`): nothing sized by a compile yet. ``widths[i]``: policy i's slot
    width (`prompt_width` of the drawn train prompts); ``text_bytes``: the SEE's bytes per text."""

    cfg: RunConfig
    task: Task
    prompts: Prompts
    policies: tuple      # BuiltPolicy per policy
    widths: tuple        # int per policy
    placement: Placement
    text_bytes: int

    def policy_template(self, i: int):
        """Policy i's ``PolicyState`` as placed ShapeDtypeStructs (shapes, dtypes, shardings; nothing computed)."""
        st = self.policies[i].state_shapes
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st,
                            self.placement.shardings(i, st))

    def init_see(self) -> see_lib.SEE:
        """The empty exchange of the run."""
        return self.cfg.see.build(self.text_bytes, max(p.max_completion_length for p in self.policies),
                                  len(self.policies), len(self.prompts.train))

    def state_template(self) -> RunState:
        """The run's starting state's shapes, dtypes and (placed) shardings, nothing computed: what a checkpoint
        is restored onto."""
        return RunState(policies=tuple(self.policy_template(i) for i in range(len(self.policies))),
                        see=_shapes(jax.eval_shape(self.init_see)))


def build_parts(cfg: RunConfig, *, task: Task | None = None, cache_dir: str | None = None,
                devices: Sequence | None = None, abstract: bool = False) -> Parts:
    """Every piece of ``cfg`` built once (module doc): tokenizers and models (their built weights, no warm start,
    no optimizer state), the device plan (MWRA, ``cfg.mwra``; ``devices`` defaults to ``jax.devices()``), each
    policy's update pinned to its mesh, the prompts fitted to the limits and each policy's slot width.
    ``ConfigError`` naming the key for every config that cannot be built."""
    platform = (list(devices) if devices is not None else jax.devices())[0].platform
    task = task or build_task(cfg)
    train = task.train_prompts()
    corpus = task_corpus(task)
    tokenizers, models_ = [], []
    for i, spec in enumerate(cfg.policies):
        tok = build_tokenizer(spec, corpus, cache_dir)
        model = build_model(spec, tok, seed=cfg.seed * 1000 + i, abstract=abstract, platform=platform)
        tokenizers.append(tok)
        models_.append(add_lora(spec, model, seed=cfg.seed * 1000 + i))
    formats = [build_prompt_format(spec, tok) for spec, tok in zip(cfg.policies, tokenizers)]
    texts = [p.text for p in train[:256]]   # the cost model's prompt part: mean prompt tokens
    prompt_tokens = prompt_lengths(texts, tokenizers, formats).mean(axis=0) if texts else np.zeros(len(formats))
    placement = make_placement(cfg, [_size(nnx.state(m)) for m in models_], [float(t) for t in prompt_tokens],
                               devices)
    built: tuple[BuiltPolicy, ...] = tuple(
        build_policy(i, spec, tok, model, cfg, placement, fmt)
        for i, (spec, tok, model, fmt) in enumerate(zip(cfg.policies, tokenizers, models_, formats)))
    prompts = fit_prompts(train, task.eval_prompts(), tokenizers, formats, [b.prompt_limit for b in built],
                          cfg.overlong_prompts, cfg.eval_prompts)
    if not prompts.eval:
        raise ConfigError(_no_heldout(cfg))
    text_bytes = text_budget(cfg.see.max_text_bytes, built)
    drawn = prompts.drawn_texts()
    widths = tuple(prompt_width(drawn, b.tokenizer, b.prompt_format, b.prompt_limit) for b in built)
    return Parts(cfg=cfg, task=task, prompts=prompts, policies=built, widths=widths, placement=placement,
                 text_bytes=text_bytes)


__all__ = ["Parts", "Prompts", "build_parts", "build_task", "fit_prompts", "prompt_lengths", "prompt_width",
           "task_corpus", "text_budget"]
