"""The per-policy learner: ONE jitted pure GRPO update step with probes, micro-batching and a NaN guard.

    optimizer = make_optimizer(1e-5, weight_decay=0.0, max_grad_norm=1.0, warmup_steps=10, total_steps=500)
    update = make_update_step(graphdef, optimizer, make_probe("xgrpo+sgt"), GRPOConfig(), micro_batch_size=16)
    params, opt_state, metrics = update(params, opt_state, batch, see_view, key)

``batch`` (``Batch``) holds the policy's own P x G rollouts; ``see_view`` (``mrl_jax.see.SeeView``) the
peer slots and group stats that SEE gives this consumer for the same P prompts. Inside the step (steps 2-4 are
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
5. optax update; a non-finite loss or gradient leaves params/opt_state unchanged (metrics["skipped"]=1).

Log-probs: ``model.hidden_prefix`` (each prompt computed once for its G own completions; peer rows:
``model.hidden`` on [prompt ++ completion]), then ``grpo.chunked_token_stats`` with ``model.head(h) /
temperature`` over the completion positions (never the full float32 [B, T, V]). The model contract is
``hidden`` / ``hidden_prefix`` / ``head`` (``mrl_jax.models.CausalLM`` has them).
num_iterations mu > 1: call ``update`` mu times on the same batch; own rows keep ``batch.old_logp`` as
pi_old (clipping active); peer rows are re-scored each call. The KL term (beta > 0) covers own rows
only (peer rows have no reference log-probs: their k3 term is zero).
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from mrl_jax import grpo, objective
from mrl_jax.objective import GRPOConfig  # noqa: F401  (public: learner.GRPOConfig)
from mrl_jax.probes import make_probe
from mrl_jax.rows import EMPTY, OWN, PER_ROW, Rows, concat, own_rows, peer_rows


def make_optimizer(lr: float, weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, schedule: str = "constant", b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after clip_by_global_norm (0 = no clipping), with linear warm-up then
    a constant / cosine (to 0) / linear (to 0) schedule over total_steps."""
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
    return optax.chain(*parts)


@struct.dataclass
class Batch:
    """A policy's own rollouts for one update, filled by the trainer. P prompts x G samples, prompt-major.

    prompt_ids int32[P, Tp] (LEFT-padded), prompt_mask bool[P, Tp];
    completion_ids int32[P*G, Tc] (right-padded), completion_mask f32[P*G, Tc] (1 up to and incl. EOS);
    old_logp f32[P*G, Tc] (pi_old; the behaviour log-probs, fixed over num_iterations);
    ref_logp f32[P*G, Tc] (frozen reference log-probs; zeros when beta = 0);
    rewards f32[P*G]; truncated bool[P*G] (hit max_completion_length without EOS).
    """
    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    old_logp: jax.Array
    ref_logp: jax.Array
    rewards: jax.Array
    truncated: jax.Array

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_generations(self) -> int:
        return self.completion_ids.shape[0] // self.prompt_ids.shape[0]


def assemble_rows(batch: Batch, view=None, *, mask_truncated_completions: bool = False,
                  consumer: Union[int, jax.Array] = 0, probe_index: Union[int, jax.Array] = 0,
                  scale_rewards: str = "group", reward_eps: float = 1e-4, loss_type: str = "grpo",
                  max_completion_length: Optional[int] = None) -> Rows:
    """Own rows from ``batch`` followed by the view's peer slots (inactive). view None -> own rows only.

    Own rows: pg_row 1, pg_mask = completion_mask (zeroed on truncated rows when
    mask_truncated_completions), pg_weight 1, advantages 0 (set by the objective).
    """
    cm = batch.completion_mask.astype(jnp.float32)
    pgm = grpo.truncation_mask(cm, batch.truncated) if mask_truncated_completions else cm
    own = own_rows(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, cm, batch.old_logp, batch.ref_logp,
                   batch.rewards, batch.truncated, consumer=consumer if view is None else view.consumer,
                   pg_mask=pgm, scale_rewards=scale_rewards, reward_eps=reward_eps, loss_type=loss_type,
                   max_completion_length=max_completion_length, probe_index=probe_index)
    if view is None:
        return own
    return concat(own, peer_rows(view, batch.prompt_ids, batch.prompt_mask))


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


def _split(rows: Rows, mb: int):
    """Per-row fields reshaped to [n_mb, mb, ...], padding with inactive rows."""
    R = rows.rewards.shape[0]
    n = -(-R // mb)
    pad = n * mb - R
    out = {}
    for f in PER_ROW:
        a = getattr(rows, f)
        if pad:
            # padding rows: inactive (masks 0, kind EMPTY) but with a valid key mask, so the forward is finite
            fill = -1 if f in ("row_kind", "dst_chunk") else (1 if f == "prompt_mask" else 0)
            a = jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)], 0)
        out[f] = a.reshape((n, mb) + a.shape[1:])
    return out


def _mb_rows(fields: dict, rows: Rows) -> Rows:
    return rows.replace(**fields)


def carries_weight(rows: Rows) -> jax.Array:
    """bool[R]: the row enters some loss term — PG tokens (pg_row and pg_mask), an SFT weight or an aux
    weight. A row with none of them adds nothing to any term's sum, gradient or metric (the probes'
    contract), so the learner does not compute it."""
    pg = (rows.pg_row > 0) & jnp.any(rows.pg_mask > 0, axis=1)
    return pg | (rows.sft_weight != 0) | jnp.any(rows.aux_weight != 0, axis=1)


def peer_chunk_rows(num_peer_rows: int, micro_batch_size: int) -> int:
    """Rows per chunk of the compacted peer slots: the micro-batch size, else an eighth of the slots
    (at least 8), so the computed rows follow the used slots in steps of a chunk."""
    if micro_batch_size:
        return min(micro_batch_size, num_peer_rows)
    return min(num_peer_rows, max(8, -(-num_peer_rows // 8)))


def _compacted(rows: Rows, keep: jax.Array, chunk: int):
    """(fields [n, chunk, ...] with the kept rows first (stable order), live bool[n] (chunk holds a kept
    row), order int32[R] (position -> original row))."""
    order = jnp.argsort(~keep, stable=True)
    fields = _split(rows.replace(**{f: getattr(rows, f)[order] for f in PER_ROW}), chunk)
    kept = jnp.pad(keep[order], (0, fields["rewards"].shape[0] * chunk - keep.shape[0]))
    return fields, jnp.any(kept.reshape(-1, chunk), axis=1), order


def _accumulate(add, carry, main: dict, group: int, peers: Rows, chunk: int):
    """(carry, rows computed): ``add(carry, fields, group)`` over the main micro-batches ([n, mb, ...]; one is
    called directly), then over the compacted peer chunks that hold a weighted row (``lax.cond``)."""
    n, mb = main["rewards"].shape[:2]
    if n == 1:   # no loop around a single micro-batch
        carry = add(carry, jax.tree.map(lambda a: a[0], main), group)
    else:
        carry, _ = jax.lax.scan(lambda c, f: (add(c, f, group), None), carry, main)
    computed = jnp.float32(n * mb)
    if peers.num_rows:
        fields, live, _ = _compacted(peers, carries_weight(peers), chunk)
        carry, _ = jax.lax.scan(lambda c, a: (jax.lax.cond(a[1], add, lambda c_, f: c_, c, a[0]), None),
                                carry, (fields, live))
        computed = computed + chunk * jnp.sum(live.astype(jnp.float32))
    return carry, computed


def _tree_where(c, a, b):
    return jax.tree.map(lambda x, y: jnp.where(c, x, y), a, b)


def make_grad_fn(graphdef, probe=None, grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0,
                 *, jit: bool = False):
    """``grads(params, batch, see_view, key) -> (loss, grads, metrics)``: steps 1-4 of the update (see the
    module docstring), without the optimizer. metrics are reduced means (plus the figures of the batch).

    Cost follows the rows that carry weight: own rows run in micro-batches of ``micro_batch_size``; peer
    slots are compacted (rows that ``carries_weight`` first) into chunks of ``peer_chunk_rows`` and a chunk
    without such a row is skipped (``lax.cond``); the no-grad peer pre-pass likewise skips EMPTY slots.
    The gradient equals the padded layout's (every term's denominator comes from the full rows).
    loss_type "bnpo" (a per-micro-batch token mean) keeps the padded layout: own ++ peer rows in
    micro-batches. metrics["rows_computed"]: the rows that ran forward and backward."""
    cfg = GRPOConfig() if grpo_config is None else grpo_config
    probe = make_probe(probe if probe is not None else "none")
    if micro_batch_size < 0:
        raise ValueError(f"micro_batch_size must be >= 0, got {micro_batch_size}")

    def forward(params, r: Rows, frozen=None, group: int = 1):
        """(logp, entropy) of the rows; group G > 1: the rows are whole prompt groups (prompt computed once)."""
        return _rows_stats(_merged(graphdef, params, frozen), r.prompt_ids, r.prompt_mask, r.completion_ids,
                           r.completion_mask, group, cfg)

    def grads_fn(params, batch: Batch, see_view, key, probe_index=0, frozen=None):
        G = batch.num_generations
        if G != cfg.num_generations:
            raise ValueError(f"batch has {G} generations per prompt, GRPOConfig.num_generations="
                             f"{cfg.num_generations}")
        if see_view is None:
            raise ValueError("update needs a see_view (use mrl_jax.see.empty_view(...) when there are no peers)")
        rows = assemble_rows(batch, see_view if probe.needs_peers else None,
                             mask_truncated_completions=cfg.mask_truncated_completions,
                             consumer=see_view.consumer, probe_index=probe_index,
                             scale_rewards=cfg.scale_rewards, reward_eps=cfg.reward_eps, loss_type=cfg.loss_type,
                             max_completion_length=cfg.max_completion_length)
        R, n_own = rows.num_rows, rows.num_own
        padded = cfg.loss_type == "bnpo"
        n_main = R if padded else n_own
        mb = n_main if micro_batch_size == 0 else min(micro_batch_size, n_main)
        pc = peer_chunk_rows(R - n_own, micro_batch_size) if R > n_own else 0

        def peer_logp(peer: Rows):
            fields, live, order = _compacted(peer, peer.row_kind != EMPTY, pc)
            zeros = jnp.zeros((pc,) + peer.completion_ids.shape[1:], jnp.float32)
            lp = jax.lax.map(lambda a: jax.lax.cond(a[1], lambda f: forward(params, _mb_rows(f, peer), frozen)[0],
                                                    lambda f: zeros, a[0]), (fields, live))
            lp = lp.reshape((-1,) + lp.shape[2:])[: peer.num_rows]
            return jnp.zeros_like(lp).at[order].set(lp)

        rows, probe_metrics = objective.prepare(rows, see_view, key, probe, cfg, peer_logp)
        dens = objective.denominators(rows, probe, cfg)
        main = _split(rows.take(0, n_main), mb)
        n_micro = main["rewards"].shape[0]
        group = G if n_main == n_own and mb % G == 0 else 1   # micro-batches of whole own groups

        def loss_fn(p, r: Rows, group: int):
            logp, ent = forward(p, r, frozen, group)
            return objective.loss_terms(logp, ent, r, probe, cfg, dens, n_micro)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def add(carry, f, group=1):
            g_acc, l_acc, m_acc = carry
            (loss, m), g = grad_fn(params, _mb_rows(f, rows), group)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return g_acc, l_acc + loss, jax.tree.map(jnp.add, m_acc, m)

        first = _mb_rows(jax.tree.map(lambda a: a[0], main), rows)
        m_shape = jax.eval_shape(lambda: grad_fn(params, first, 1)[0][1])
        # accumulate in float32 (bf16 params too), hand back grads in the params' dtypes
        carry = (jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params), jnp.float32(0.0),
                 jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape))
        carry, computed = _accumulate(add, carry, main, group, rows.take(n_main), pc)
        grads, loss, msum = carry
        grads = jax.tree.map(lambda g, x: g.astype(x.dtype), grads, params)
        pg_loss = msum.pop("pg_loss")[0]
        metrics = grpo.reduce_metrics(grpo.merge_metrics(msum, probe_metrics))
        metrics.update(_batch_metrics(rows, batch))
        metrics.update({"loss": loss, "pg_loss": pg_loss, "rows_computed": computed})
        metrics.setdefault("kl", jnp.float32(0.0))
        return loss, grads, metrics

    return jax.jit(grads_fn) if jit else grads_fn


def _batch_metrics(rows: Rows, batch: Batch) -> dict:
    """Figures of the batch itself. reward_std as TRL's (mean over prompts of the group std, ddof=1);
    reward_std_batch: std over every own reward."""
    P, G = batch.num_prompts, batch.num_generations
    own_r = batch.rewards.astype(jnp.float32).reshape(P, G)
    std_g = jnp.std(own_r, axis=1, ddof=1) if G > 1 else jnp.zeros((P,), jnp.float32)
    own_row = (rows.row_kind == OWN).astype(jnp.float32)
    return {"reward_mean": jnp.mean(own_r), "reward_std": jnp.mean(std_g), "reward_std_batch": jnp.std(own_r),
            "frac_reward_zero_std": jnp.mean((std_g < 1e-8).astype(jnp.float32)),
            "adv_abs_mean": jnp.sum(jnp.abs(rows.advantages) * own_row) / (P * G),
            "num_tokens": jnp.sum(rows.pg_mask * own_row[:, None]), "pg_rows": jnp.sum(rows.pg_row)}


def make_update_step(graphdef, optimizer: optax.GradientTransformation, probe=None,
                     grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0, *,
                     donate: bool = True, jit: bool = True):
    """Build ``update(params, opt_state, batch, see_view, key, probe_index=0) -> (params, opt_state, metrics)``.

    probe_index (traced) selects the acting chain of a ``probes.switch`` probe, so one compile serves
    several chains (ignored by other probes).
    frozen: params that are used but not trained (a LoRA policy's base: ``graphdef, params, frozen =
    nnx.split(model, nnx.LoRAParam, ...)``); the forward is ``nnx.merge(graphdef, params, frozen)``, gradients
    and the optimizer cover ``params`` only, and ``frozen`` is not donated.
    graphdef from ``nnx.split(model)``; probe: a ``Probe`` or spec string (``make_probe``);
    micro_batch_size: rows per micro-batch (0 = all rows in one); rows are padded up to a multiple.
    Params and opt_state are donated (donate=True): do not reuse the arrays passed in.
    Metrics: loss, pg_loss, kl, entropy, clip_ratio/*, ratio_mean, grad_norm, skipped, reward_mean,
    reward_std, frac_reward_zero_std, adv_abs_mean, num_tokens, pg_rows, plus the probes' figures
    (prp/*, sgt/*, xgrpo/*).
    """
    grads_fn = make_grad_fn(graphdef, probe, grpo_config, micro_batch_size)

    def update(params, opt_state, batch: Batch, see_view, key, probe_index=0, frozen=None):
        loss, grads, metrics = grads_fn(params, batch, see_view, key, probe_index, frozen)
        gnorm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        safe_g = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
        updates, new_opt = optimizer.update(safe_g, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=gnorm, skipped=1.0 - finite.astype(jnp.float32))
        return _tree_where(finite, new_params, params), _tree_where(finite, new_opt, opt_state), metrics

    if not jit:
        return update
    return jax.jit(update, donate_argnums=(0, 1) if donate else ())


def make_logp_fn(graphdef, grpo_config: Optional[GRPOConfig] = None, micro_batch_size: int = 0):
    """Jitted ``logps(params, batch) -> f32[P*G, Tc]``: log-probs of the batch's completions (no grad), for
    the trainer to fill ``ref_logp`` (reference params) or recompute ``old_logp``."""
    cfg = GRPOConfig() if grpo_config is None else grpo_config

    @jax.jit
    def logps(params, batch: Batch, frozen=None):
        rows = assemble_rows(batch)
        R = rows.rewards.shape[0]
        mb = R if micro_batch_size == 0 else min(micro_batch_size, R)
        f = _split(rows, mb)
        model, G = _merged(graphdef, params, frozen), batch.num_generations
        group = G if mb % G == 0 else 1   # micro-batches of whole groups: each prompt computed once
        lp = jax.lax.map(lambda x: _rows_stats(model, x["prompt_ids"], x["prompt_mask"], x["completion_ids"],
                                               x["completion_mask"], group, cfg)[0], f)
        return lp.reshape((-1,) + lp.shape[2:])[:R]

    return logps
