"""A run: its built pieces (`trainer.parts.Parts`: task, prompts length-fitted, the device plan), their memory
plan, one ``Policy`` record per policy born with its sampler sized; and the arrays it starts from
(``Run.initial_state``), kept out of the constructor so a resumed run never warm-starts: it restores onto
``Run.state_template()``, shapes and shardings only.

Determinism: the prompts and RNG key of round ``r`` (``Run.round_inputs``) depend only on ``(seed, r)``, so a
run resumed from the checkpoint of round ``r`` continues exactly as an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError
from mrl_jax.sampler import ragged, rungs, slot_count
from mrl_jax.tasks import Prompt, Task
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.dynamic_sampling import oversampler
from mrl_jax.trainer.evaluation import evaluate
from mrl_jax.trainer.memory import padded_prompts, plan_memory
from mrl_jax.trainer.parts import build_parts, build_task, prompt_lengths, task_corpus, text_budget
from mrl_jax.trainer.placement import Placement
from mrl_jax.trainer.policy import Policy
from mrl_jax.trainer.reference import initial_reference
from mrl_jax.trainer.round import RoundInputs, RunState
from mrl_jax.trainer.sft import uniform_draw, warm_start


class Run:
    """A run's static parts: task, prompts, policies (records with tokenizer, mesh, jitted steps), plan."""

    def __init__(self, cfg: RunConfig, *, task: Task | None = None, cache_dir: str | None = None,
                 devices: Sequence | None = None):
        """Composes the run's values: its built pieces (`trainer.parts.build_parts`: tokenizers, models -- their
        built weights are what ``initial_state`` starts from; no warm start, no optimizer state --, the device
        plan over ``devices``, default ``jax.devices()``, each policy's update pinned to its mesh), their memory
        plan (``memory``: `trainer.memory.plan_memory`; None where no device limit is known; ``ConfigError``
        when the run does not fit) and each `Policy` born with its sampler sized: a slot width of the widest
        train prompt (every round's decode program the same) and the slots the plan chose, else
        ``sampling.slots`` (unset: every row). A run that samples nothing (export) uses the parts alone."""
        parts = build_parts(cfg, task=task, cache_dir=cache_dir, devices=devices)
        memory = plan_memory(parts)
        slots = ([f.slots for f in memory.figures] if memory is not None
                 else [b.spec.sampling.slots for b in parts.policies])
        self.cfg = cfg
        self.parts = parts
        self.task = parts.task
        self.train_prompts: list[Prompt] = list(parts.prompts.train)
        self.eval_prompts: list[Prompt] = list(parts.prompts.eval)
        self.rejected: frozenset[int] = parts.prompts.rejected
        self.replacement: dict[int, Prompt] = dict(parts.prompts.replacement)
        self.prompt_stats: dict = dict(parts.prompts.stats)
        self.dense = {p.id: k for k, p in enumerate(self.train_prompts)}
        self.placement: Placement = parts.placement
        self.memory = memory
        self.policies: list[Policy] = [b.policy(w, s) for b, w, s in zip(parts.policies, parts.widths, slots)]
        self.warm_start_losses: dict[str, list[float]] = {}

    def sampler_lines(self) -> list[str]:
        """One line per policy: its sampler in a train round (`mrl_jax.sampler`): the rows (P x G, P padded
        to its data axis), the decode slots S and the rungs the round's tail moves down (`sampler.rungs`)."""
        out = []
        for pol, built in zip(self.policies, self.parts.policies):
            d = int(pol.mesh.devices.size)
            rows = padded_prompts(self, d) * pol.num_generations
            s = slot_count(rows, pol.slots, d)
            asked = pol.spec.sampling.slots   # pol.slots: the config's, or the S the memory plan chose
            why = f"sampling.slots {asked}" if asked is not None else (
                "every row" if s == rows else "the most the memory plan fits")
            ladder = rungs(pol.graphdef, built.state_shapes.params, s, pol.sampling.max_new_tokens, d, pol.spec.sampling.ladder,
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
        out = []
        for pol, built in zip(self.policies, self.parts.policies):
            params = built.params
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
        return self.parts.state_template()

    def _init_see(self) -> see_lib.SEE:
        return self.parts.init_see()

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
