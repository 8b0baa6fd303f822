"""The frozen KL reference pi_ref of a policy (only when grpo.beta > 0; with beta = 0 none is held).

The reference is the policy's params at the start of RL (after any warm start; a copy, never an alias of
the donated training buffers) or a separate local checkpoint (``ref_model.path``, same architecture and
shapes). TRL's ``sync_ref_model``: every ``ref_model_sync_steps`` updates the reference moves toward the
policy, ``ref = alpha * params + (1 - alpha) * ref``. It lives in ``PolicyState.ref_params``, so it is part
of every checkpoint and a resumed run continues with the same reference.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from mrl_jax import models
from mrl_jax.configs import ConfigError


def holds_reference(spec) -> bool:
    """Whether a policy (``PolicySpec``) holds reference params: beta > 0 and no LoRA (a LoRA policy's reference
    is its base with the adapters off, scored in the update: no copy)."""
    return spec.grpo.beta != 0.0 and not spec.lora.rank


def initial_reference(spec, params) -> Optional[Any]:
    """Reference params of a policy spec (``PolicySpec``) given its starting params; None when beta = 0."""
    if not holds_reference(spec):
        return None
    path = spec.ref_model.path
    if path is None:
        return jax.tree.map(jnp.copy, params)
    key = f"policies.{spec.name}.ref_model.path"
    try:
        ref = nnx.split(models.from_pretrained(path, dtype=spec.model.dtype, param_dtype=spec.model.dtype))[1]
    except (OSError, ValueError) as e:
        raise ConfigError(f"config key '{key}': {e}") from e
    want = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), ref)
    if jax.tree.structure(want) != jax.tree.structure(got) or jax.tree.leaves(want) != jax.tree.leaves(got):
        raise ConfigError(f"config key '{key}': {path} does not have the policy's architecture and shapes; the "
                          "reference must be a checkpoint of the same model (e.g. the policy's own base).")
    return ref


def mix(params, ref, alpha: float):
    """TRL's reference sync: alpha * params + (1 - alpha) * ref, leaf-wise in the ref's dtype."""
    return jax.tree.map(lambda p, r: (alpha * p.astype(jnp.float32) + (1 - alpha) * r.astype(jnp.float32))
                        .astype(r.dtype), params, ref)


def reference_sync(spec) -> Optional[Callable]:
    """``sync(params, ref, step) -> ref`` of a policy (``PolicySpec``) for `mrl_jax.learner.iterate`: after update
    number ``step`` (1-based over the run, traced) the reference moves toward the policy when TRL would; None when
    the policy holds no reference or does not sync it."""
    r = spec.ref_model
    if not holds_reference(spec) or not r.sync_ref_model:
        return None
    every, alpha = int(r.ref_model_sync_steps), float(r.ref_model_mixup_alpha)

    def sync(params, ref, step):
        return jax.lax.cond(step % every == 0, lambda: mix(params, ref, alpha), lambda: ref)

    return sync
