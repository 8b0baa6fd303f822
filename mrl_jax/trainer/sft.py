"""Supervised warm start: token cross-entropy on (prompt, answer) pairs, one jitted pure step.

Used by the demo (each policy learns a different part of the task before RL) and by ``warm_start`` in a
run config. The answer is encoded exactly as a sampled completion would be (continuation + EOS), so
the warm-started policy emits the format the verifier reads.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mrl_jax.learner import rows_logp
from mrl_jax.tokenization import Tokenizer
from mrl_jax.trainer.encoding import encode_completions, encode_prompts


def make_sft_step(graphdef, optimizer: optax.GradientTransformation):
    """Jitted ``step(params, opt_state, prompt_ids, prompt_mask, ids, mask) -> (params, opt_state, loss)``.

    loss = mean over answer tokens of -log pi(token | prefix); arrays as from ``encode_prompts`` /
    ``encode_completions`` (``ids int32[B, Tc]``, ``mask f32[B, Tc]``).
    """

    def loss_fn(params, prompt_ids, prompt_mask, ids, mask):
        logp, _ = rows_logp(nnx.merge(graphdef, params), prompt_ids, prompt_mask, ids, mask)
        return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    def step(params, opt_state, prompt_ids, prompt_mask, ids, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, prompt_ids, prompt_mask, ids, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


Draw = Callable[[int, np.random.Generator], Sequence[tuple[str, str]]]


def uniform_draw(examples: Sequence[tuple[str, str]]) -> Draw:
    """Draw (prompt, answer) pairs uniformly with replacement from a fixed list."""
    if not examples:
        raise ValueError("warm start has no examples: check warm_start.part against the task's parts")
    return lambda n, rng: [examples[i] for i in rng.integers(0, len(examples), size=n)]


def _frozen_base(optimizer, params):
    """A LoRA policy's params (``nnx.LoRAParam`` leaves present): only the adapters move."""
    if not jax.tree.leaves(nnx.split_state(params, nnx.LoRAParam, ...)[0]):
        return optimizer
    labels = jax.tree.map(lambda _: "frozen", params)
    for path, _ in nnx.to_flat_state(nnx.split_state(params, nnx.LoRAParam, ...)[0]):
        node = labels
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = "train"
    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def warm_start(graphdef, params, tokenizer: Tokenizer, template: str, draw: Draw, *, steps: int, batch_size: int,
               learning_rate: float, max_completion_length: int, seed: int):
    """Run ``steps`` SFT steps on batches ``draw(batch_size, rng)`` (seeded); returns (params, losses)."""
    optimizer = _frozen_base(optax.adamw(learning_rate), params)
    opt_state = optimizer.init(params)
    step = make_sft_step(graphdef, optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        pairs = draw(batch_size, rng)
        prompts = [p for p, _ in pairs]
        answers = [a for _, a in pairs]
        p_ids, p_mask, _ = encode_prompts(tokenizer, template, prompts)
        ids, mask, _ = encode_completions(tokenizer, answers, max_completion_length)
        params, opt_state, loss = step(params, opt_state, p_ids, p_mask, ids, mask)
        losses.append(loss)
    return params, [float(x) for x in jax.device_get(losses)]
