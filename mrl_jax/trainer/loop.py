"""The run loop of ``mrl train``: set-up, rounds, checkpoints, logs, evaluation, resume.

Determinism: the prompts and RNG key of round ``r`` depend only on ``(seed, r)``, so a run resumed from
the checkpoint of round ``r`` continues exactly as an uninterrupted one would (same params, same
metrics); the checkpoint holds every policy's params and optimizer state and the SEE buffer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError, load_yaml, to_dict
from mrl_jax.tasks import ArithmeticTask, JsonlTask, RewardScorer, RewardSpec, StringTask, Task, default_mixture, task_reward
from mrl_jax.trainer.checkpoint import CheckpointError, RunCheckpointer
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.evaluation import evaluate
from mrl_jax.trainer.metrics import RunLog
from mrl_jax.trainer.policy import Policy, build_model, build_policy, build_tokenizer, param_count
from mrl_jax.trainer.round import RunState, ViewShape, run_round
from mrl_jax.trainer.sft import uniform_draw, warm_start


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (repeated non-finite updates, failing rewards); state is saved."""


def build_task(cfg: RunConfig) -> Task:
    t = cfg.task
    if t.name == "mixture":
        return default_mixture(t.seed, num_facts=t.num_facts)
    if t.name == "arith":
        return ArithmeticTask("add", 2, seed=t.seed)
    if t.name == "reverse":
        return StringTask("rev", seed=t.seed)
    return JsonlTask(t.path, seed=t.seed)


def task_corpus(task: Task) -> list[str]:
    """Texts a locally trained tokenizer learns from: every prompt and answer."""
    prompts = task.train_prompts() + task.eval_prompts()
    return [p.text for p in prompts] + [p.answer for p in prompts]


class Run:
    """The built pieces of a run: task, policies (static) and the initial state."""

    def __init__(self, cfg: RunConfig, *, task: Task | None = None, cache_dir: str | None = None, warm: bool = True):
        self.cfg = cfg
        self.task = task or build_task(cfg)
        self.train_prompts = self.task.train_prompts()
        self.eval_prompts = self.task.eval_prompts()
        self.dense = {p.id: k for k, p in enumerate(self.train_prompts)}
        corpus = task_corpus(self.task)
        self.policies: list[Policy] = []
        states = []
        for i, spec in enumerate(cfg.policies):
            tok = build_tokenizer(spec, corpus, cache_dir)
            model = build_model(spec, tok, seed=cfg.seed * 1000 + i)
            pol, st = build_policy(i, spec, tok, model, cfg)
            if warm and spec.warm_start.steps > 0:
                ws = spec.warm_start
                params, _ = warm_start(pol.graphdef, st.params, tok, spec.prompt_template, self.sft_draw(ws.part),
                                       steps=ws.steps,
                                       batch_size=ws.batch_size, learning_rate=ws.learning_rate,
                                       completion_length=spec.sampling.max_new_tokens, seed=cfg.seed * 1000 + i)
                st = st.replace(params=params)
            self.policies.append(pol)
            states.append(st)
        max_src = max(p.sampling.max_new_tokens for p in self.policies)
        see = see_lib.init(cfg.see.capacity, cfg.see.max_text_bytes, max_src, len(self.policies),
                           len(self.train_prompts), per_prompt_cap=cfg.see.per_prompt_cap,
                           success_capacity=cfg.see.capacity, tau=cfg.see.success_threshold)
        self.state = RunState(policies=tuple(states), see=see)
        self.view_shape = ViewShape(peer_rollouts=cfg.see.peer_rollouts_per_prompt,
                                    peer_successes=cfg.see.peer_successes_per_prompt)

    def sft_draw(self, part: str | None):
        """Warm-start batches: the mixture's weighted draw (a small fact table is not drowned), else uniform."""
        if hasattr(self.task, "sample_sft"):
            return lambda n, rng: self.task.sample_sft(n, rng, part=part)
        return uniform_draw(self.task.sft_examples(part))

    def round_prompts(self, round_index: int):
        """The prompts of round ``r``: a function of (task seed, run seed, r) only."""
        rng = np.random.default_rng([self.cfg.seed, round_index])
        prompts = self.task.sample_train(self.cfg.prompts_per_round, rng)
        return prompts, np.asarray([self.dense[p.id] for p in prompts], np.int32)

    def round_key(self, round_index: int) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self.cfg.seed), round_index)

    def evaluate(self, state: RunState, num_prompts: int | None = None) -> dict:
        prompts = self.eval_prompts[:num_prompts] if num_prompts else self.eval_prompts
        return evaluate(self.policies, state.policies, self.task, prompts)


def _reward_scorer(run: Run, reward_specs: Sequence[RewardSpec] | None) -> RewardScorer:
    specs = list(reward_specs) if reward_specs else [task_reward(run.task, timeout_s=run.cfg.reward_timeout_s)]
    return RewardScorer(specs, max_consecutive_failures=run.cfg.max_reward_failures)


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, task: Task | None = None,
          reward_specs: Sequence[RewardSpec] | None = None, progress: bool = True) -> dict:
    """Run (or resume) an MRL run into ``out_dir``; returns the summary (also written as summary.json)."""
    out = Path(out_dir)
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    latest = ckpt.latest_round()
    if latest is not None and not resume:
        raise CheckpointError(f"{out} already holds checkpoints (latest round {latest}); pass --resume to continue "
                              "it or choose a new --out directory.")
    run = Run(cfg, task=task, warm=not (resume and latest is not None))
    log = RunLog(out, progress=progress)
    state, start = run.state, 0
    if resume and latest is not None:
        state, meta = ckpt.restore(run.state)
        start = int(meta["round"]) + 1
        log.truncate_after(start - 1)
    elif resume:
        log.truncate_after(-1)
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    skipped = {p.name: 0 for p in run.policies}
    history = []
    try:
        with _reward_scorer(run, reward_specs) as scorer:
            for r in range(start, cfg.rounds):
                prompts, dense = run.round_prompts(r)
                state, metrics, samples = run_round(
                    run.policies, state, prompts, dense, scorer=scorer, key=run.round_key(r), round_index=r,
                    num_generations=cfg.num_generations, view_shape=run.view_shape)
                log.log_round(r, metrics)
                log.log_samples(r, samples)
                history.append({n: m["reward/mean"] for n, m in metrics.items()})
                for name, m in metrics.items():
                    skipped[name] = skipped[name] + 1 if m.get("skipped", 0.0) > 0 else 0
                if (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds:
                    ckpt.save(r, state, {"round": r})
                bad = [n for n, c in skipped.items() if c >= cfg.max_skipped_updates]
                if bad:
                    ckpt.save(r, state, {"round": r})
                    raise TrainingStopped(
                        f"policies {bad} skipped {cfg.max_skipped_updates} updates in a row (non-finite loss or "
                        f"gradient); state saved at round {r} in {ckpt.directory}. Lower the learning rate or check "
                        "the rewards, then --resume.")
                if cfg.eval_every and (r + 1) % cfg.eval_every == 0:
                    log.log_round(r, {f"{n}/eval": {"success": v["success"]}
                                      for n, v in run.evaluate(state, cfg.eval_prompts).items()})
    finally:
        log.close()
        ckpt.close()
    final = run.evaluate(state, cfg.eval_prompts)
    summary = {"rounds": cfg.rounds, "resumed_from": start - 1 if start else None,
               "policies": {p.name: {"params": param_count(s), "eval": final[p.name]}
                            for p, s in zip(run.policies, state.policies)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def train_from_yaml(config_path, out_dir, *, resume=False, coordinator=None, num_processes=None,
                    process_id=None) -> dict:
    """``mrl train``: multi-host set-up (a no-op on one host), config load, ``train``."""
    from mrl_jax.mwra import initialize_distributed

    initialize_distributed(coordinator, num_processes, process_id)
    return train(load_yaml(RunConfig, config_path), out_dir, resume=resume)


def evaluate_from_yaml(config_path, run_dir) -> dict:
    """``mrl eval``: held-out success per policy from the run's latest checkpoint."""
    cfg = load_yaml(RunConfig, config_path)
    run = Run(cfg, warm=False)
    ckpt = RunCheckpointer(run_dir, keep=cfg.keep_checkpoints)
    try:
        state, meta = ckpt.restore(run.state)
    finally:
        ckpt.close()
    return {"round": meta["round"], "eval": run.evaluate(state, cfg.eval_prompts)}


__all__ = ["Run", "TrainingStopped", "build_task", "evaluate_from_yaml", "train", "train_from_yaml", "ConfigError"]
