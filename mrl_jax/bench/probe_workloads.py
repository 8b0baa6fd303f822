"""The work ``mrl bench probes`` gives every probe: two tasks, each with its policies, warm starts and RL budget.

- ``facts``: the demo's facts transfer (``mrl_jax.demo``): two policies of different families and tokenizers,
  warm-started on the shared skill ``copy`` and on their own half of a fact table; the curve is held-out
  greedy success, the skills own / foreign facts and copy.
- ``reasoning``: algorithmic string reasoning where GRPO alone learns -- ``copy`` (4-8 letters), ``rev``
  (reverse, 3-5) and ``sort`` (3-5), exact-match verified, held-out inputs disjoint from the train ones. Three
  policies of three families and tokenizer algorithms (Llama + byte-level BPE, GPT-2 + Unigram, Qwen2 +
  characters) with different warm-start budgets (1000 / 700 / 600 SFT steps), so they begin between 15 % and
  60 % sampled pass@1 with different skills; the curve is held-out sampled reward@1 (the mean exact-match
  reward of K samples at temperature 1, the paper's reward@1), every ``eval_every`` rounds.

A workload is a value: its settings (the budget), its task, the run config of one (probe, seed) cell and the
names of the skills read from the final evaluation's groups.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

FACT_SKILLS = ("own_facts", "foreign_facts", "copy")
REASONING_SKILLS = ("copy", "rev", "sort")


@dataclasses.dataclass(frozen=True)
class FactsSettings:
    """The facts task's budget (``quick``: one seed, a few rounds, tiny warm start)."""

    rounds: int = 30
    prompts_per_round: int = 32
    num_generations: int = 8
    sft_steps: int = 200
    num_facts: int = 32
    eval_copy_prompts: int = 32
    eval_every: int = 1
    eval_samples: int = 4          # pass@k (k = 1, 2, 4) at the warm start and at the end

    @classmethod
    def make(cls, quick: bool) -> "FactsSettings":
        if quick:
            return cls(rounds=3, prompts_per_round=8, num_generations=4, sft_steps=60, num_facts=8,
                       eval_copy_prompts=8, eval_samples=2)
        return cls()


@dataclasses.dataclass(frozen=True)
class ReasoningSettings:
    """The reasoning task's budget: calibrated so ``none`` alone gains >= 0.1 sampled pass@1 on average."""

    rounds: int = 50
    prompts_per_round: int = 32
    num_generations: int = 8
    sft_steps: tuple[int, int, int] = (1000, 700, 600)
    learning_rate: float = 1e-3
    eval_per_skill: int = 32        # held-out inputs per skill (96 prompts)
    eval_every: int = 5
    eval_samples: int = 4           # reward@1 = the mean over these samples; pass@k up to k = 4

    @classmethod
    def make(cls, quick: bool) -> "ReasoningSettings":
        if quick:
            return cls(rounds=3, prompts_per_round=8, num_generations=4, sft_steps=(60, 40, 20), eval_per_skill=4,
                       eval_every=1, eval_samples=2)
        return cls()


@dataclasses.dataclass(frozen=True)
class Workload:
    """One task of the bench: ``config(probe, settings, seed, num_eval) -> RunConfig``; ``skills(by_group,
    part) -> {skill: success}`` from a policy's final greedy evaluation; ``curve_key``: the eval record's figure
    plotted per round (``success`` = greedy, ``pass@1`` = sampled reward@1)."""

    name: str
    title: str
    settings: Callable[[bool], object]
    task: Callable[[object], object]
    config: Callable[[str, object, int, int], object]
    skills: tuple[str, ...]
    read_skills: Callable[[dict, str | None], dict]
    curve_key: str
    curve_label: str


def facts_task(s: FactsSettings):
    """The demo's task with a held-out copy set small enough that every held-out prompt is evaluated."""
    from mrl_jax.tasks import FactTableTask, MixtureTask, StringTask

    return MixtureTask([StringTask("copy", min_len=3, max_len=6, alphabet="abcdef", n_train=1000,
                                   n_eval=s.eval_copy_prompts),
                        FactTableTask(s.num_facts, parts=("A", "B"))], weights=[1, 1], name="demo")


def facts_config(probe: str, s: FactsSettings, seed: int, num_eval: int):
    """The demo's two policies under ``probe``; held-out evaluation after every round (reward@1 curve), sampled
    pass@k at the warm start and the end; one checkpoint (the end): an unfinished cell restarts."""
    from mrl_jax.demo import DemoSettings, demo_config

    ds = DemoSettings(rounds=s.rounds, prompts_per_round=s.prompts_per_round, num_generations=s.num_generations,
                      sft_steps=s.sft_steps, num_facts=s.num_facts)
    cfg = demo_config(probe, ds, seed)
    return dataclasses.replace(cfg, eval_every=s.eval_every, eval_prompts=num_eval, eval_samples=s.eval_samples,
                               checkpoint_every=s.rounds, keep_checkpoints=1)


def facts_skills(by_group: dict, part: str | None) -> dict:
    foreign = "B" if part == "A" else "A"
    return {"own_facts": by_group.get(f"fact:{part}"), "foreign_facts": by_group.get(f"fact:{foreign}"),
            "copy": by_group.get("copy")}


def reasoning_task(s: ReasoningSettings):
    """copy / rev / sort over small alphabets: 1000 train inputs each, ``eval_per_skill`` held out."""
    from mrl_jax.tasks import MixtureTask, StringTask

    n = s.eval_per_skill
    return MixtureTask([StringTask("copy", min_len=4, max_len=8, alphabet="abcdefgh", n_train=1000, n_eval=n),
                        StringTask("rev", min_len=3, max_len=5, alphabet="abcdef", n_train=1000, n_eval=n),
                        StringTask("sort", min_len=3, max_len=5, alphabet="abcdef", n_train=1000, n_eval=n)],
                       weights=[1, 1, 1], name="reasoning")


def reasoning_config(probe: str, s: ReasoningSettings, seed: int, num_eval: int):
    """Three policies of three families and tokenizers under ``probe``, warm-started on the whole task for
    different budgets; sampled evaluation (reward@1, pass@k) every ``eval_every`` rounds."""
    from mrl_jax.trainer.config import (ModelSpec, OptimizerSpec, PolicySpec, RunConfig, SamplingSpec, SeeSpec,
                                        TokenizerSpec, WarmStartSpec)

    def policy(name, model, tokenizer, steps):
        return PolicySpec(name=name, model=model, tokenizer=tokenizer, probes=probe,
                          warm_start=WarmStartSpec(steps=steps, learning_rate=3e-3, batch_size=32),
                          sampling=SamplingSpec(max_new_tokens=10),
                          optimizer=OptimizerSpec(learning_rate=s.learning_rate, max_grad_norm=1.0))

    llama, gpt2, qwen = s.sft_steps
    return RunConfig(
        policies=[policy("llama_bpe", ModelSpec(family="llama", hidden_size=64, num_layers=2, num_heads=4,
                                                num_kv_heads=2), TokenizerSpec(kind="byte_bpe", vocab_size=300), llama),
                  policy("gpt2_unigram", ModelSpec(family="gpt2", hidden_size=64, num_layers=2, num_heads=4),
                         TokenizerSpec(kind="unigram", vocab_size=300), gpt2),
                  policy("qwen2_char", ModelSpec(family="qwen2", hidden_size=64, num_layers=2, num_heads=4,
                                                 num_kv_heads=2), TokenizerSpec(kind="char", vocab_size=300), qwen)],
        seed=seed, rounds=s.rounds, prompts_per_round=s.prompts_per_round, num_generations=s.num_generations,
        eval_every=s.eval_every, eval_prompts=num_eval, eval_samples=s.eval_samples, eval_temperature=1.0,
        checkpoint_every=s.rounds, keep_checkpoints=1,
        see=SeeSpec(capacity=1024, per_prompt_cap=8, peer_rollouts_per_prompt=4, peer_successes_per_prompt=1))


def reasoning_skills(by_group: dict, part: str | None) -> dict:
    return {k: by_group.get(k) for k in REASONING_SKILLS}


FACTS = Workload("facts", "the demo's facts transfer (two policies; own / foreign facts and the shared copy skill)",
                 FactsSettings.make, facts_task, facts_config, FACT_SKILLS, facts_skills, "success",
                 "held-out greedy reward@1")
REASONING = Workload("reasoning", "algorithmic string reasoning (copy / reverse / sort; three policies of three "
                     "families and tokenizers with different warm starts)", ReasoningSettings.make, reasoning_task,
                     reasoning_config, REASONING_SKILLS, reasoning_skills, "pass@1",
                     "held-out sampled reward@1 (T = 1)")
WORKLOADS = {w.name: w for w in (FACTS, REASONING)}
