"""The per-policy learner: ONE jitted pure GRPO update step with probes, micro-batching and a NaN guard.

    optimizer = make_optimizer(1e-5, weight_decay=0.0, max_grad_norm=1.0, warmup_steps=10, total_steps=500)
    update = make_update_step(graphdef, optimizer, make_probe("xgrpo+sgt"), GRPOConfig(), micro_batch_size=16)
    params, opt_state, metrics = update(params, opt_state, rows, see_view, key)

``rows`` (``mrl_jax.rows.Rows``, built by ``rows.own_rows``) hold the policy's own P x G rollouts; ``see_view``
(``mrl_jax.see.SeeView``) the peer slots and group stats that SEE gives this consumer for the same P prompts. Inside the step (steps 2-4 are
``mrl_jax.objective``, the objective shared with the bandit lab):

1. rows = own rows (P*G, prompt-major) ++ the view's P*K peer slots (only when the probe chain
   ``needs_peers``), laid out as ``mrl_jax.rows.Rows`` — the one layout every probe shares;
2. peer rows' ``old_logp`` = the current policy's log-probs (no-grad pre-pass) when a probe needs them
   (PRP weights, compatibility gate): peer rows are scored against pi_theta at update time;
3. ``probe.extend`` activates rows; advantages = GRPO group advantages of own rows (``scale_rewards``),
   then ``probe.advantages``;
4. denominators of every loss term from the full rows (they never depend on log-probs); a ``lax.scan``
   over micro-batches accumulates the gradient of ``pg_sum / pg_den + sum_k term_sum_k / term_den_k``,
   so the accumulated gradient equals the full-batch one exactly (bnpo: TRL's per-micro-batch token mean);
5. optax update through ``skip_non_finite`` (``optax.apply_if_finite``): a non-finite loss or gradient leaves
   params and the inner optimizer state unchanged (metrics["skipped"]=1); the skips are counted in the
   optimizer state (metrics["skipped_in_a_row"]), so the count is checkpointed and survives a resume.

Log-probs: ``model.hidden_prefix`` (each prompt computed once for its G own completions; peer rows:
``model.hidden`` on [prompt ++ completion]), then ``grpo.chunked_token_stats`` with ``model.head(h) /
temperature`` over the completion positions (never the full float32 [B, T, V]). The model contract is
``hidden`` / ``hidden_prefix`` / ``head`` (``mrl_jax.models.CausalLM`` has them).
num_iterations mu > 1: ``iterate(update, mu)`` runs the mu updates on the same rows inside one function (a
``lax.scan``); own rows keep their ``old_logp`` as pi_old (clipping active); peer rows are re-scored each
iteration. The KL term (beta > 0) covers own rows
only (peer rows have no reference log-probs: their k3 term is zero).
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mrl_jax import grpo, objective
from mrl_jax.objective import GRPOConfig  # noqa: F401  (public: learner.GRPOConfig)
from mrl_jax.probes import RunOptions, make_probe
from mrl_jax.rows import Rows, concat, peer_rows


def make_optimizer(lr: float, weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, schedule: str = "constant", b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after clip_by_global_norm (0 = no clipping), with linear warm-up then
    a constant / cosine (to 0) / linear (to 0) schedule over total_steps, inside ``skip_non_finite``."""
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"schedule must be constant|cosine|linear, got {schedule!r}")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(f"schedule {schedule!r} needs total_steps > warmup_steps, got {total_steps}")
    w = max(int(warmup_steps), 0)
    if schedule == "constant":
        decay = optax.constant_schedule(lr)
    elif schedule == "cosine":
        decay = optax.cosine_decay_schedule(lr, total_steps - w)
    else:
        decay = optax.linear_schedule(lr, 0.0, total_steps - w)
    sched = optax.join_schedules([optax.linear_schedule(0.0, lr, w), decay], [w]) if w > 0 else decay
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return skip_non_finite(optax.chain(*parts))


NEVER = 2 ** 31 - 1   # non-finite updates in a row after which apply_if_finite would apply one anyway


def skip_non_finite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied to finite gradients only: ``optax.apply_if_finite`` that never gives in (a non-finite
    gradient leaves params and ``inner``'s state as they were). Its state counts the skips (``notfinite_count``
    in a row, ``total_notfinite``), the counter a run's stop condition reads; ``make_update_step`` needs it."""
    return optax.apply_if_finite(inner, max_consecutive_errors=NEVER)


def assemble_rows(rows: Rows, view=None, probe_index: Union[int, jax.Array] = 0) -> Rows:
    """The policy's own rows (``rows.own_rows``) followed by the view's peer slots (inactive), the acting chain
    of a ``switch`` probe set; view None -> own rows only."""
    rows = rows.replace(probe_index=jnp.asarray(probe_index, jnp.int32))
    if view is None:
        return rows
    G = rows.num_generations
    return concat(rows, peer_rows(view, rows.prompt_ids[::G], rows.prompt_mask[::G]))


# ----------------------------------------------------------------------------- log-probs and loss

def _scaled_head(model, temperature: float):
    return model.head if temperature == 1.0 else (lambda x: model.head(x) / temperature)


def rows_logp(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature: float = 1.0,
              chunk_size: int = 128):
    """(logp, entropy) f32[B, Tc] of the completion tokens under ``model`` (.hidden/.head)."""
    Tp = prompt_ids.shape[1]
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask.astype(bool), completion_mask > 0], axis=1)
    h = model.hidden(ids, attention_mask=mask)
    return grpo.chunked_token_stats(h[:, Tp - 1: ids.shape[1] - 1], _scaled_head(model, temperature),
                                    completion_ids.astype(jnp.int32), chunk_size)


def grouped_logp(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature: float = 1.0,
                 chunk_size: int = 128):
    """``rows_logp`` of P prompts x G completions with each prompt computed once (``model.hidden_prefix``):
    prompt_ids int32[P, Tp], completion_* [P*G, Tc] (prompt-major). Equal to ``rows_logp`` on the repeated
    prompts; prompt tokens cost 1/G."""
    G = completion_ids.shape[0] // prompt_ids.shape[0]
    h_last, hc = model.hidden_prefix(prompt_ids, prompt_mask, completion_ids, completion_mask)
    h = jnp.concatenate([jnp.repeat(h_last, G, axis=0)[:, None], hc[:, :-1]], axis=1)
    return grpo.chunked_token_stats(h, _scaled_head(model, temperature), completion_ids.astype(jnp.int32),
                                    chunk_size)


def _rows_stats(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group: int, cfg: GRPOConfig):
    """(logp, entropy) f32[B, Tc] of B rows; group G > 1: the rows are whole prompt groups of G (prompt-major),
    each prompt computed once (``grouped_logp``), else every row on its own (``rows_logp``)."""
    opts = dict(temperature=cfg.temperature, chunk_size=cfg.logprob_chunk_size)
    if group > 1:
        return grouped_logp(model, prompt_ids[::group], prompt_mask[::group], completion_ids, completion_mask, **opts)
    return rows_logp(model, prompt_ids, prompt_mask, completion_ids, completion_mask, **opts)


def _merged(graphdef, params, frozen=None):
    return nnx.merge(graphdef, params) if frozen is None else nnx.merge(graphdef, params, frozen)


def make_grad_fn(graphdef, probe=None, grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0,
                 *, jit: bool = False):
    """``grads(params, rows, see_view, key, probe_index=0, frozen=None) -> (loss, grads, metrics)``: steps
    1-4 of the update (see the module docstring), without the optimizer: the own rows and the view's peer rows
    through ``objective.value_and_grad`` (micro-batches, compacted peer chunks, float32 accumulation).
    metrics are reduced means, the batch's figures and ``rows_computed``."""
    cfg = GRPOConfig() if grpo_config is None else grpo_config
    probe = make_probe(probe if probe is not None else "none", RunOptions.of(cfg))
    if probe.options.mismatch(cfg):
        raise ValueError(f"probe {probe.name!r} was built with other run options than the GRPOConfig ("
                         f"{'; '.join(probe.options.mismatch(cfg))}); build it with "
                         "make_probe(spec, RunOptions.of(grpo_config, tau)) or pass the spec string")
    if micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 0, got {micro_batch_size}")

    def grads_fn(params, rows: Rows, see_view, key, probe_index=0, frozen=None):
        if rows.num_generations != cfg.num_generations:
            raise ValueError(f"the rows have {rows.num_generations} generations per prompt, "
                             f"GRPOConfig.num_generations={cfg.num_generations}")
        if see_view is None:
            raise ValueError("update needs a see_view (use mrl_jax.see.empty_view(...) when there are no peers)")
        rows = assemble_rows(rows, see_view if probe.needs_peers else None, probe_index)

        def forward(p, r: Rows, group: int):
            return _rows_stats(_merged(graphdef, p, frozen), r.prompt_ids, r.prompt_mask, r.completion_ids,
                               r.completion_mask, group, cfg)

        return objective.value_and_grad(forward, params, rows, see_view, key, probe, cfg, micro_batch_size)

    return jax.jit(grads_fn) if jit else grads_fn


def make_update_step(graphdef, optimizer: optax.GradientTransformation, probe=None,
                     grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0, *,
                     donate: bool = True, jit: bool = True):
    """Build ``update(params, opt_state, rows, see_view, key, probe_index=0) -> (params, opt_state, metrics)``.

    probe_index (traced) selects the acting chain of a ``probes.switch`` probe, so one compile serves
    several chains (ignored by other probes).
    frozen: params that are used but not trained (a LoRA policy's base: ``graphdef, params, frozen =
    nnx.split(model, nnx.LoRAParam, ...)``); the forward is ``nnx.merge(graphdef, params, frozen)``, gradients
    and the optimizer cover ``params`` only, and ``frozen`` is not donated.
    graphdef from ``nnx.split(model)``; probe: a ``Probe`` or spec string (``make_probe``);
    optimizer: one whose state counts skipped updates (``skip_non_finite(...)``; ``make_optimizer``'s is);
    micro_batch_size: rows per micro-batch (0 = all rows in one); rows are padded up to a multiple.
    Params and opt_state are donated (donate=True): do not reuse the arrays passed in.
    Metrics: loss, pg_loss, kl, entropy, clip_ratio/*, ratio_mean, grad_norm, skipped, skipped_in_a_row,
    reward_mean, reward_std, frac_reward_zero_std, adv_abs_mean, num_tokens, pg_rows, plus the probes' figures
    (prp/*, sgt/*, xgrpo/*).
    """
    grads_fn = make_grad_fn(graphdef, probe, grpo_config, micro_batch_size)

    def update(params, opt_state, rows: Rows, see_view, key, probe_index=0, frozen=None):
        if not isinstance(opt_state, optax.ApplyIfFiniteState):
            raise TypeError("make_update_step: the optimizer must skip non-finite updates and count them; wrap it "
                            "in learner.skip_non_finite (make_optimizer's optimizer is)")
        loss, grads, metrics = grads_fn(params, rows, see_view, key, probe_index, frozen)
        gnorm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)   # a non-finite loss skips as a non-finite gradient does
        grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.nan), grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = dict(metrics, grad_norm=gnorm, skipped=1.0 - finite.astype(jnp.float32),
                       skipped_in_a_row=opt_state.notfinite_count.astype(jnp.float32))
        return optax.apply_updates(params, updates), opt_state, metrics

    if not jit:
        return update
    return jax.jit(update, donate_argnums=(0, 1) if donate else ())


def iterate(update, num_iterations: int, sync=None, reference=None):
    """The round's ``num_iterations`` (mu) updates on the same rows as one pure function (jit it once), a function
    transformer in the way micro-batching is one:

        epochs = iterate(make_update_step(..., jit=False), mu, sync, reference)
        params, opt_state, ref, metrics = epochs(params, opt_state, ref, rows, see_view, key, step)

    ``reference(params, ref, rows) -> rows`` (beta > 0) fills the rows' ``ref_logp`` once, before the first
    update, as TRL scores its reference once per generated batch. Iteration ``it`` updates with
    ``fold_in(key, it)``; then ``ref = sync(params, ref, step + it + 1)`` when ``sync`` is given (TRL's reference
    sync; ``step`` i32[]: updates done before this call), else ``ref`` passes through (None when no reference is
    held). Metrics: the last iteration's, ``skipped`` summed over the iterations. mu = 1 is the update itself
    (no loop)."""
    def one(params, opt_state, ref, rows, see_view, key, step, it):
        params, opt_state, metrics = update(params, opt_state, rows, see_view, jax.random.fold_in(key, it))
        if sync is not None:
            ref = sync(params, ref, step + it + 1)
        return params, opt_state, ref, metrics

    def epochs(params, opt_state, ref, rows, see_view, key, step):
        if reference is not None:
            rows = reference(params, ref, rows)
        if num_iterations == 1:
            return one(params, opt_state, ref, rows, see_view, key, step, 0)

        def body(carry, it):
            params, opt_state, ref, skipped = carry
            params, opt_state, ref, metrics = one(params, opt_state, ref, rows, see_view, key, step, it)
            return (params, opt_state, ref, skipped + metrics["skipped"]), metrics

        (params, opt_state, ref, skipped), stacked = jax.lax.scan(
            body, (params, opt_state, ref, jnp.zeros((), jnp.float32)), jnp.arange(num_iterations))
        metrics = dict(jax.tree.map(lambda x: x[-1], stacked), skipped=skipped)
        return params, opt_state, ref, metrics

    return epochs


def make_logp_fn(graphdef, grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0):
    """Jitted ``logps(params, rows) -> f32[P*G, Tc]``: log-probs of the own rows' completions (no grad), for
    the trainer to fill ``ref_logp`` (reference params) or recompute ``old_logp``."""
    cfg = GRPOConfig() if grpo_config is None else grpo_config

    @jax.jit
    def logps(params, rows: Rows, frozen=None):
        R = rows.rewards.shape[0]
        mb = R if micro_batch_size == 0 else min(micro_batch_size, R)
        f = objective.split_rows(rows, mb)
        model, G = _merged(graphdef, params, frozen), rows.num_generations
        group = G if mb % G == 0 else 1   # micro-batches of whole groups: each prompt computed once
        lp = jax.lax.map(lambda x: _rows_stats(model, x["prompt_ids"], x["prompt_mask"], x["completion_ids"],
                                               x["completion_mask"], group, cfg)[0], f)
        return lp.reshape((-1,) + lp.shape[2:])[:R]

    return logps
