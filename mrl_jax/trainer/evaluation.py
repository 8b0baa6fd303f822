"""Held-out evaluation: greedy completions of every policy, verified, grouped by task and part; with
``samples=K`` also K sampled completions per prompt: avg@K, pass@k, maj@K per policy and the population
metrics (:mod:`mrl_jax.trainer.evaluation_metrics`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Sequence

import jax
import numpy as np

from mrl_jax.tasks import Prompt, Task
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
from mrl_jax.trainer.evaluation_metrics import population_metrics, sample_metrics
from mrl_jax.trainer.placement import mesh_generate
from mrl_jax.trainer.policy import Policy, PolicyState


def prompt_group(prompt: Prompt) -> str:
    """``task`` or ``task:part`` (the fact table's parts are the demo's own/foreign skills)."""
    part = prompt.meta.get("part") if prompt.meta else None
    return f"{prompt.task}:{part}" if part else prompt.task


def evaluate_policy(policy: Policy, state: PolicyState, task: Task, prompts: Sequence[Prompt], *,
                    batch_size: int = 256) -> dict:
    """Greedy success of one policy: ``{"success": f, "by_group": {group: f}, "n": int}``."""
    greedy = dataclasses.replace(policy.sampling, greedy=True)
    hits: dict[str, list[float]] = defaultdict(list)
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - n) if len(prompts) > batch_size else chunk
        ids, mask, _ = encode_prompts(policy.tokenizer, policy.prompt_format, [p.text for p in chunk],
                                     max_width=policy.prompt_limit)
        out = mesh_generate(policy, state.params, ids, mask, jax.random.key(0), greedy)   # read on every process
        texts, _ = decode_completions(policy.tokenizer, out.tokens, out.mask, policy.sampling.eos_ids)
        for p, t in zip(chunk[:n], texts[:n]):
            hits[prompt_group(p)].append(float(task.verify(p, t) >= 1.0))
    every = [h for v in hits.values() for h in v]
    return {"success": float(np.mean(every)) if every else 0.0, "n": len(every),
            "by_group": {g: float(np.mean(v)) for g, v in sorted(hits.items())}}


def _answer_key(task: Task, prompt: Prompt, text: str):
    """The completion's answer as majority voting compares it: the task's ``answer_key`` (the dataset task's
    verifier), else the stripped text."""
    fn = getattr(task, "answer_key", None)
    return fn(prompt, text) if fn is not None else (text.strip() or None)


def sample_policy(policy: Policy, state: PolicyState, task: Task, prompts: Sequence[Prompt], num_samples: int,
                  temperature: float, *, seed: int = 0, batch_size: int = 64) -> tuple[np.ndarray, list]:
    """``(correct bool[N, K], answers)``: ``num_samples`` completions per prompt at ``temperature`` (the policy's
    top_k / top_p kept), verified (``>= 1``) and their answer keys (N lists of K)."""
    cfg = dataclasses.replace(policy.sampling, greedy=False, temperature=float(temperature))
    correct = np.zeros((len(prompts), num_samples), bool)
    answers: list = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start:start + batch_size])
        n = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - n) if len(prompts) > batch_size else chunk
        ids, mask, _ = encode_prompts(policy.tokenizer, policy.prompt_format, [p.text for p in chunk])
        key = jax.random.fold_in(jax.random.key(seed), start)
        out = mesh_generate(policy, state.params, ids, mask, key, cfg, num_samples=num_samples)
        texts, _ = decode_completions(policy.tokenizer, out.tokens, out.mask, policy.sampling.eos_ids)
        for i, p in enumerate(chunk[:n]):
            row = texts[i * num_samples:(i + 1) * num_samples]
            correct[start + i] = [float(task.verify(p, t)) >= 1.0 for t in row]
            answers.append([_answer_key(task, p, t) for t in row])
    return correct, answers


def evaluate(policies: Sequence[Policy], states: Sequence[PolicyState], task: Task,
             prompts: Sequence[Prompt], *, samples: int = 0, temperature: float = 1.0, seed: int = 0) -> dict:
    """``{policy name: evaluate_policy(...)}``; with ``samples`` K > 0 each policy's entry also holds
    ``sample_metrics`` (avg@K, pass@k, maj@K) and the result a ``"population"`` entry
    (``population_metrics``: population pass@k, pairwise transfer)."""
    out = {pol.name: evaluate_policy(pol, st, task, prompts) for pol, st in zip(policies, states)}
    if samples <= 0 or not prompts:
        return out
    tables = {}
    for pol, st in zip(policies, states):
        correct, answers = sample_policy(pol, st, task, prompts, samples, temperature, seed=seed)
        out[pol.name].update(sample_metrics(correct, answers))
        tables[pol.name] = correct
    out["population"] = population_metrics(tables)
    return out
