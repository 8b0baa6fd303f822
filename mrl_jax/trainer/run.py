"""The built pieces of a run: task, prompts (length-fitted), one ``Policy`` record per policy, the device plan;
and the arrays it starts from (``Run.initial_state``), kept out of the constructor so a resumed run never
warm-starts: it restores onto ``Run.state_template()``, shapes and shardings only.

Determinism: the prompts and RNG key of round ``r`` (``Run.round_inputs``) depend only on ``(seed, r)``, so a
run resumed from the checkpoint of round ``r`` continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError, config_warning
from mrl_jax.sampler import ragged, rungs, slot_count
from mrl_jax.tasks import Prompt, Task
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.dynamic_sampling import oversampler
from mrl_jax.trainer.evaluation import evaluate
from mrl_jax.trainer.memory import plan_memory as compile_memory_plan
from mrl_jax.trainer.memory import padded_prompts, prompt_width
from mrl_jax.trainer.placement import Placement, make_placement
from mrl_jax.trainer.policy import (Policy, add_lora, build_model, build_policy, build_prompt_format,
                                    build_tokenizer)
from mrl_jax.trainer.reference import initial_reference
from mrl_jax.trainer.round import RoundInputs, RunState
from mrl_jax.trainer.sft import uniform_draw, warm_start


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


def text_budget(requested: int, policies: Sequence[Policy]) -> int:
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


def _size(tree) -> int:
    """Elements in ``tree`` (arrays or shapes): a model's parameter count for the cost model."""
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(tree)))


def _shapes(tree):
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves without shardings (what a numpy template restores as)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class Run:
    """A run's static parts: task, prompts, policies (records with tokenizer, mesh, jitted steps), plan."""

    def __init__(self, cfg: RunConfig, *, task: Task | None = None, cache_dir: str | None = None,
                 devices: Sequence | None = None, abstract: bool = False, plan_memory: bool = True):
        """Builds tokenizers and models (their built weights are what ``initial_state`` starts from); no warm
        start, no optimizer state. The devices planned (MWRA, ``cfg.mwra``; ``devices`` defaults to
        ``jax.devices()``), each policy's steps pinned to its mesh and its sampler sized: a slot width of the
        widest train prompt (every round's decode program the same) and, with ``plan_memory``, the slots the
        compiled memory plan chose (``memory``: `trainer.memory.plan_memory`; None where no device limit is
        known; ``ConfigError`` when the run does not fit), else ``sampling.slots`` (unset: every row).
        ``plan_memory=False``: nothing compiled (a run that samples nothing: export).
        ``abstract``: models as shapes only (checkpoints' ``config.json`` read, no weights), for compiling the
        steps (``devices`` may then be a TPU topology's, `mrl_jax.trainer.tpu_plan`, which plans their memory
        against its HBM); no state can be made, no memory plan here."""
        self.cfg = cfg
        self.abstract = abstract
        platform = (list(devices) if devices is not None else jax.devices())[0].platform
        self.task = task or build_task(cfg)
        self.train_prompts = self.task.train_prompts()
        self.eval_prompts = self.task.eval_prompts()
        self.dense = {p.id: k for k, p in enumerate(self.train_prompts)}
        corpus = task_corpus(self.task)
        self.warm_start_losses: dict[str, list[float]] = {}
        tokenizers, models_ = [], []
        for i, spec in enumerate(cfg.policies):
            tok = build_tokenizer(spec, corpus, cache_dir)
            model = build_model(spec, tok, seed=cfg.seed * 1000 + i, abstract=abstract, platform=platform)
            tokenizers.append(tok)
            models_.append(add_lora(spec, model, seed=cfg.seed * 1000 + i))
        formats = [build_prompt_format(spec, tok) for spec, tok in zip(cfg.policies, tokenizers)]
        texts = [p.text for p in self.train_prompts[:256]]   # the cost model's prompt part: mean prompt tokens
        prompt_tokens = prompt_lengths(texts, tokenizers, formats).mean(axis=0) if texts else np.zeros(len(formats))
        self.placement: Placement = make_placement(cfg, [_size(nnx.state(m)) for m in models_],
                                                   [float(t) for t in prompt_tokens], devices)
        built = [build_policy(i, spec, tok, model, cfg, self.placement)
                 for i, (spec, tok, model) in enumerate(zip(cfg.policies, tokenizers, models_))]
        self.policies: list[Policy] = [b.policy for b in built]
        self._weights = [b.params for b in built]   # per policy: the built params, before any warm start
        self._abstract = [b.state_shapes for b in built]
        self.update_at = [b.update_at for b in built]   # micro_batch_size -> unpinned update (memory plan fixes)
        self._fit_prompts()
        if not self.eval_prompts:
            raise ConfigError(_no_heldout(cfg))
        self._text_bytes = text_budget(cfg.see.max_text_bytes, self.policies)
        self.policies = [dataclasses.replace(p, slot_width=prompt_width(self, p)) for p in self.policies]
        self.memory = compile_memory_plan(self) if plan_memory and not abstract else None
        if self.memory is not None:   # the sampler as the plan compiled it: sampling.slots, or the most that fit
            self.policies = [dataclasses.replace(p, slots=f.slots) for p, f in zip(self.policies, self.memory.figures)]

    def sampler_lines(self) -> list[str]:
        """One line per policy: its sampler in a train round (`mrl_jax.rollout_slots`): the rows (P x G, P padded
        to its data axis), the decode slots S and the rungs the round's tail moves down (`slot_ladder.rungs`)."""
        out = []
        for pol, shapes in zip(self.policies, self._abstract):
            d = int(pol.mesh.devices.size)
            rows = padded_prompts(self, d) * pol.num_generations
            s = slot_count(rows, pol.slots, d)
            asked = pol.spec.sampling.slots   # pol.slots: the config's, or the S the memory plan chose
            why = f"sampling.slots {asked}" if asked is not None else (
                "every row" if s == rows else "the most the memory plan fits")
            ladder = rungs(pol.graphdef, shapes.params, s, pol.sampling.max_new_tokens, d, pol.spec.sampling.ladder,
                           ragged=ragged(pol.sampling.eos_ids, s, rows), ladder=pol.spec.sampling.ladder_shape)
            out.append(f"sampler {pol.name}: S = {s} decode slots for {rows} rows a round ({why}); "
                       f"rungs {', '.join(map(str, ladder))}")
        return out

    @property
    def prompt_limits(self) -> list[int]:
        return [p.prompt_limit for p in self.policies]

    # ------------------------------------------------------------------------------------------ state
    def warm_params(self) -> list:
        """Each policy's starting params: its built weights after the config's warm start (``warm_start``:
        steps, part, learning_rate, batch_size; none when steps is 0; each step's loss in
        ``warm_start_losses[name]``). Call once: the warm start donates the built weights."""
        if self.abstract:
            raise RuntimeError("an abstract Run (shapes only) has no weights to start from")
        out = []
        for pol, params in zip(self.policies, self._weights):
            ws = pol.spec.warm_start
            if ws.steps > 0:
                params, self.warm_start_losses[pol.name] = warm_start(pol.graphdef, params, pol.tokenizer, pol.prompt_format, self.sft_draw(ws.part),
                                       steps=ws.steps, batch_size=ws.batch_size, learning_rate=ws.learning_rate,
                                       max_completion_length=pol.max_completion_length, seed=self.cfg.seed * 1000 + pol.index)
            out.append(params)
        return out

    def initial_state(self, params: Sequence | None = None) -> RunState:
        """The state round 0 starts from: each policy's ``params`` (default ``warm_params()``; given ones are
        copied, so several runs can start from them) with a fresh optimizer state and its reference, placed on
        its mesh, and an empty SEE buffer."""
        params = self.warm_params() if params is None else [jax.tree.map(jnp.copy, p) for p in params]
        states = [pol.init_state(p, initial_reference(pol.spec, p)) for pol, p in zip(self.policies, params)]
        return self.place(RunState(policies=tuple(states), see=self._init_see()))

    def state_template(self) -> RunState:
        """``initial_state()``'s shapes, dtypes and (placed) shardings, nothing computed: what a checkpoint is
        restored onto."""
        pols = [jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st,
                             self.placement.shardings(i, st)) for i, st in enumerate(self._abstract)]
        return RunState(policies=tuple(pols), see=_shapes(jax.eval_shape(self._init_see)))

    def _init_see(self) -> see_lib.SEE:
        cfg = self.cfg
        return cfg.see.build(self._text_bytes, max(p.max_completion_length for p in self.policies), len(self.policies),
                             len(self.train_prompts))

    def place(self, state: RunState) -> RunState:
        """``state`` (e.g. restored from a checkpoint, host arrays) with every policy's arrays on its mesh."""
        return state.replace(policies=tuple(self.placement.place(i, s) for i, s in enumerate(state.policies)))

    def sft_draw(self, part: str | None):
        """Warm-start batches: the mixture's weighted draw (a small fact table is not drowned), else uniform."""
        if hasattr(self.task, "sample_sft"):
            return lambda n, rng: self.task.sample_sft(n, rng, part=part)
        return uniform_draw(self.task.sft_examples(part))

    # ---------------------------------------------------------------------------------------- prompts
    def _prompt_lengths(self, texts: Sequence[str]) -> np.ndarray:
        return prompt_lengths(texts, [p.tokenizer for p in self.policies], [p.prompt_format for p in self.policies])

    def _fits(self, text: str) -> bool:
        return bool(np.all(self._prompt_lengths([text])[0] <= np.asarray(self.prompt_limits)))

    def _truncated(self, prompt: Prompt) -> Prompt:
        """``prompt`` with the longest tail of its text that fits every policy's limit."""
        text = prompt.text
        lo, hi = 0, len(text)  # find the smallest start whose tail fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._fits(text[mid:]) else (mid + 1, hi)
        while lo < len(text) and not self._fits(text[lo:]):
            lo += 1
        if not self._fits(text[lo:]):
            raise ConfigError(
                f"config key 'policies[*].max_prompt_length': limits {self.prompt_limits} are shorter than the "
                "prompt template alone; raise max_prompt_length (or shorten prompt_template).")
        return dataclasses.replace(prompt, text=text[lo:])

    def _fit_prompts(self) -> None:
        """Apply the prompt length limits (``overlong_prompts``) to the train and eval prompts."""
        limits = np.asarray(self.prompt_limits)
        self.rejected: set[int] = set()
        self.replacement: dict[int, Prompt] = {}
        self.prompt_stats = {}
        for split in ("train", "eval"):
            prompts = self.train_prompts if split == "train" else self.eval_prompts
            if not prompts:
                continue
            over = np.any(self._prompt_lengths([p.text for p in prompts]) > limits, axis=1)
            self.prompt_stats[f"{split}_prompts_overlong"] = int(over.sum())
            if not over.any():
                continue
            if self.cfg.overlong_prompts == "reject":
                if over.all():
                    raise ConfigError(
                        f"config key 'policies[*].max_prompt_length': every {split} prompt is longer than the "
                        f"limits {self.prompt_limits} (tokens per policy); raise max_prompt_length or set "
                        "overlong_prompts: truncate.")
                self.rejected.update(p.id for p, o in zip(prompts, over) if o)
                kept = [p for p, o in zip(prompts, over) if not o]
            else:
                kept = [self._truncated(p) if o else p for p, o in zip(prompts, over)]
                self.replacement.update((p.id, q) for p, q, o in zip(prompts, kept, over) if o)
            if split == "eval":
                self.eval_prompts = kept
        if len(self.eval_prompts) < self.cfg.eval_prompts:
            config_warning("eval_prompts", f"{self.cfg.eval_prompts}, but the task has {len(self.eval_prompts)} "
                                           "held-out prompts (after overlong_prompts); each evaluation uses those")

    def _sample_prompts(self, rng: np.random.Generator) -> tuple[list[Prompt], int]:
        """``prompts_per_round`` train prompts from ``rng``, rejected ones drawn again; (prompts, rejections)."""
        P = self.cfg.prompts_per_round
        prompts = self.task.sample_train(P, rng)
        if not self.rejected:
            return prompts, 0
        kept = [p for p in prompts if p.id not in self.rejected]
        rejected = P - len(kept)
        for _ in range(1000):
            if len(kept) >= P:
                break
            more = self.task.sample_train(P, rng)
            rejected += sum(p.id in self.rejected for p in more)
            kept += [p for p in more if p.id not in self.rejected]
        if len(kept) < P:
            raise ConfigError("config key 'overlong_prompts': almost every train prompt is rejected as too long; "
                              "raise policies[*].max_prompt_length or set overlong_prompts: truncate.")
        return kept[:P], rejected

    def draw_inputs(self, round_index: int, batch: int = 0) -> RoundInputs:
        """The prompt source: batch ``batch`` of round ``r`` (a function of (task seed, run seed, r, batch)
        only): prompts, dense SEE ids, key and the prompt-length counts. Batch 0 is the round's; batch k > 0 is
        dynamic sampling's extra batch k (its prompts from ``default_rng([seed, r, k])``, its key
        ``fold_in(round key, k)``)."""
        seeds = [self.cfg.seed, round_index] + ([batch] if batch else [])
        prompts, rejected = self._sample_prompts(np.random.default_rng(seeds))
        counts = {"data/prompts_rejected": float(rejected),
                  "data/prompts_truncated": float(sum(p.id in self.replacement for p in prompts))}
        prompts = [self.replacement.get(p.id, p) for p in prompts]
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), round_index)
        return RoundInputs(index=round_index, prompts=tuple(prompts),
                           dense_ids=np.asarray([self.dense[p.id] for p in prompts], np.int32),
                           key=jax.random.fold_in(key, batch) if batch else key, counts=counts)

    def round_inputs(self, round_index: int) -> RoundInputs:
        """Round ``r``'s inputs (`draw_inputs` batch 0) with its dynamic-sampling oversampler."""
        return dataclasses.replace(self.draw_inputs(round_index),
                                   oversampler=oversampler(self.cfg.dynamic_sampling, self.draw_inputs, round_index))

    def evaluate(self, state: RunState, num_prompts: int | None = None, *, samples: int | None = None,
                 temperature: float | None = None) -> dict:
        """Held-out evaluation (``trainer.evaluation.evaluate``); ``samples`` / ``temperature`` default to the
        config's ``eval_samples`` / ``eval_temperature``."""
        prompts = self.eval_prompts[:num_prompts] if num_prompts else self.eval_prompts
        samples = self.cfg.eval_samples if samples is None else samples
        temperature = self.cfg.eval_temperature if temperature is None else temperature
        return evaluate(self.policies, state.policies, self.task, prompts, samples=samples, temperature=temperature,
                        seed=self.cfg.seed)


__all__ = ["Run", "build_task", "task_corpus", "text_budget"]
