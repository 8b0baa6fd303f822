"""A worked example of a researcher's probe, loaded by import path (nothing in the library names it).

``hedge`` shrinks each own sample's GRPO advantage toward the pooled-baseline (XGRPO) advantage:

    A_hedge(y) = (1 - lam) * A_own(y) + lam * A_pool(y)        (own rows only; peer rows untouched)

with A_own = (r - mean_own(x)) / (std_own(x) + eps), the policy's own group statistics, and A_pool the same
with mean and std pooled over every policy's group for the prompt (``rows.pooled_advantages``, what ``xgrpo``
trains on: the probe declares its ``Pooling``, so a chain computes that baseline once for all its members). lam = 0 is independent GRPO, lam = 1 is XGRPO; in between it hedges between the
policy's own baseline (unbiased for its own distribution, noisy at small G) and the population's (lower
variance, biased toward what peers can do) -- a credibility-weighted baseline. The PG term is linear in the
advantages at ratio 1, so the first-step loss and gradient are exactly (1 - lam) * none + lam * xgrpo.

Use it in a run config (with the repository root on PYTHONPATH), chained with built-ins::

    probes: "experiments.probes.hedge:hedge:lam=0.5+sgt"

Metrics: hedge/shift (mean |A_hedge - A_own| over own rows), hedge/lam.
"""

from __future__ import annotations

import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.probes import OWN, Pooling, Probe, RunOptions, with_pooled


def hedge(options: RunOptions, lam: float = 0.5) -> Probe:
    """The hedged-baseline probe; ``options`` are the run's (advantage scale / eps, SEE threshold tau)."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"hedge: lam must be in [0, 1], got {lam}")
    pooling = Pooling(options.scale_rewards, options.reward_eps, options.tau)

    def hedged(rows, see_view, adv):
        """f32[R]: the hedged advantages (own rows), ``adv`` elsewhere."""
        mixed = (1.0 - lam) * adv + lam * with_pooled(rows, see_view, pooling).pooled_advantages
        return jnp.where(rows.row_kind == OWN, mixed, adv)

    def extend(rows, see_view, key):
        P, G = rows.num_prompts, rows.num_generations
        own = jnp.arange(rows.num_rows) < P * G
        own_adv = grpo.group_advantages(rows.rewards[:P * G].reshape(P, G), options.scale_rewards,
                                        options.reward_eps).reshape(-1)
        adv = jnp.concatenate([own_adv, jnp.zeros((rows.num_rows - P * G,), jnp.float32)])
        shift = jnp.abs(hedged(rows, see_view, adv) - adv) * own
        return rows, {"hedge/shift": (jnp.sum(shift), jnp.float32(P * G)), "hedge/lam": (jnp.float32(lam), jnp.float32(1))}

    def advantages(rewards, rows, see_view, adv):
        return hedged(rows, see_view, adv)

    return Probe("hedge", extend, advantages, options=options, pooling=pooling)
