"""Held-out evaluation: greedy completions of every policy, verified, grouped by task and part."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax.rollout import generate
from mrl_jax.tasks import Prompt, Task
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
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
        if policy.mesh is not None:   # on the policy's MWRA mesh, read on every process
            from mrl_jax.trainer.placement import mesh_generate

            out = mesh_generate(policy, state.params, ids, mask, jax.random.key(0), greedy)
        else:
            out = jax.device_get(generate(policy.graphdef, state.params, jnp.asarray(ids), jnp.asarray(mask),
                                          jax.random.key(0), greedy))
        texts, _ = decode_completions(policy.tokenizer, out.tokens, out.mask, policy.sampling.eos_ids)
        for p, t in zip(chunk[:n], texts[:n]):
            hits[prompt_group(p)].append(float(task.verify(p, t) >= 1.0))
    every = [h for v in hits.values() for h in v]
    return {"success": float(np.mean(every)) if every else 0.0, "n": len(every),
            "by_group": {g: float(np.mean(v)) for g, v in sorted(hits.items())}}


def evaluate(policies: Sequence[Policy], states: Sequence[PolicyState], task: Task,
             prompts: Sequence[Prompt]) -> dict:
    """``{policy name: evaluate_policy(...)}``."""
    return {pol.name: evaluate_policy(pol, st, task, prompts) for pol, st in zip(policies, states)}
