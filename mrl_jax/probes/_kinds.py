"""The sharing probes: XGRPO (pooled advantages), PRP (peer rollouts with importance weights), SGT (rescue by a
peer's verified success) and replay (the policy's own archived successes)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.probes._pooling import Pooling, with_pooled
from mrl_jax.probes._probe import Probe, RunOptions, _id_advantages, _id_loss_terms, bind
from mrl_jax.probes._weights import (WEIGHT_MODES, compatibility_gate, effective_sample_size, importance_weights,
                                     peer_compatibility, sgt_rescue_loss, weight_variance)
from mrl_jax.rows import ARCHIVE, OWN, OWN_ARCHIVE, PEER, Rows, chunk_gather, chunk_sums


# ----------------------------------------------------------------------------- XGRPO / PRP advantages

def xgrpo(scale=None, capability_weighted: bool = False, eps: Optional[float] = None, *,
          options: Optional[RunOptions] = None) -> Probe:
    """XGRPO: own samples' advantages use a baseline/scale pooled over all policies' groups for the prompt.
    Only own rows are trained. scale/eps: None = the run's grpo.scale_rewards / reward_eps (``options``; a
    different explicit value is an error). capability_weighted (HACPO) turns on capability weights for the chain's
    one pooled baseline (``Pooling``, computed once per chain), so ``xgrpo(capability_weighted=True) + prp`` and
    ``prp + xgrpo(capability_weighted=True)`` give the same advantages: pooling probes commute.
    Metrics: xgrpo/adv_on_peer_solved, xgrpo/peer_solved_frac."""
    options = bind("xgrpo", options, scale=scale, eps=eps)
    pooling = Pooling(options.scale_rewards, options.reward_eps, options.tau, capability_weighted)

    def advantages(rewards, rows, see_view, adv):
        pooled = with_pooled(rows, see_view, pooling).pooled_advantages
        return jnp.where(rows.row_kind == OWN, pooled, adv)

    def extend(rows, see_view, key):
        rows = with_pooled(rows, see_view, pooling)
        pooled = rows.pooled_advantages
        solved = jnp.sum(see_view.peer_stats[..., grpo.STAT_SUCCESSES], -1) > 0          # [P]
        sel = ((rows.row_kind == OWN) & solved[rows.prompt_slot]).astype(jnp.float32)
        return rows, {"xgrpo/adv_on_peer_solved": (jnp.sum(pooled * sel), jnp.sum(sel)),
                      "xgrpo/peer_solved_frac": (jnp.sum(solved.astype(jnp.float32)), jnp.float32(solved.shape[0]))}

    return Probe("xgrpo", extend, advantages, _id_loss_terms, options=options, pooling=pooling)


# ----------------------------------------------------------------------------- PRP

PRP_LEVELS = ("chunk", "sequence")


def _prp_weights(rows: Rows, cand, level: str, truncate: float, mode: str, gamma: float):
    """(token weights f32[R, Tc], tokens trained f32[R, Tc], metrics) of PRP's importance weights."""
    C = rows.src_chunk_logp.shape[1]
    cm = rows.completion_mask
    valid = rows.chunk_valid.astype(jnp.float32)
    tok_valid = chunk_gather(valid, rows.dst_chunk) * cm
    log_r = (chunk_sums(rows.old_logp * cm, rows.dst_chunk, C) - rows.src_chunk_logp) * valid     # [R, C]
    seq_log_r = jnp.sum(log_r, -1)                                                            # [R]
    seq_w = importance_weights(seq_log_r, 0.0, truncate=truncate, mode="none" if mode == "shaping" else mode,
                               gamma=gamma)
    cf = cand.astype(jnp.float32)
    if mode == "shaping":      # LUFFY: each chunk's shaped term spread evenly over its tokens
        ntok = chunk_sums(cm, rows.dst_chunk, C)
        tok_w = chunk_gather(valid / jnp.maximum(ntok, 1.0), rows.dst_chunk)
        w, wm = importance_weights(log_r, 0.0, mode="shaping", gamma=gamma), valid * cf[:, None]
    elif level == "chunk":
        w = importance_weights(log_r, 0.0, truncate=truncate, mode=mode, gamma=gamma)
        tok_w, wm = chunk_gather(w * valid, rows.dst_chunk), valid * cf[:, None]
    else:
        w, wm = seq_w, cf
        tok_w = seq_w[:, None] * tok_valid
    metrics = {"prp/ess": (effective_sample_size(w, wm), jnp.float32(1.0)),
               "prp/ess_sequence": (effective_sample_size(seq_w, cf), jnp.float32(1.0)),
               "prp/weight_var": (weight_variance(w, wm), jnp.float32(1.0)),
               "prp/weight_mean": (jnp.sum(w * wm), jnp.sum(wm))}
    return tok_w, tok_valid, metrics


def prp(truncate: float = 1.0, mode: str = "truncate", gamma: float = 0.1, compat_gate: bool = False,
        delta: float = 0.8, scale=None, eps: Optional[float] = None, capability_weighted: bool = False,
        level: str = "chunk", *, options: Optional[RunOptions] = None) -> Probe:
    """PRP: train on peers' current-round rollouts for the same prompt (retokenized by THL) with pooled-group
    advantages (own rows too; pooling as ``xgrpo``) and importance weights w = pi_i / pi_j.

    Estimator: peer rows are scored against pi_theta at update time (their PG ratio is 1), so a peer row
    contributes w * A * grad log pi_theta(y) with w stop-gradient:
    - level="chunk": one weight per THL chunk, w_c = exp(logp_i(c) - logp_j(c)) (the token-level analogue of
      truncated IS: each weight ignores the rest of the sequence — biased, low variance);
    - level="sequence": w = exp(sum_c logp_i(c) - logp_j(c)) = pi_i(y) / pi_j(y) on every token, exact when
      every chunk is valid (THL residual chunks are left out of the sum and of the PG term).
    mode transforms w (``importance_weights``: truncate / clip / none); mode="shaping" (LUFFY, chunk level):
    f(rho_c) = rho_c / (rho_c + gamma) with rho_c = pi_theta(c) / pi_j(c) replaces the clipped ratio.
    compat_gate (GRAFT): admit a peer row iff s > delta, weight min(s, 1). logp_j is the source's behaviour
    log-prob as stored in SEE (the sampler's tempered distribution; with top-k/top-p filtering the sampled
    distribution differs by the log of the kept mass per token — see ``mrl_jax.trainer.round``).
    Metrics: prp/ess (normalised Kish ESS at the level used), prp/ess_sequence, prp/weight_var,
    prp/weight_mean, prp/rows, prp/tokens, prp/residual_frac."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"prp mode must be one of {WEIGHT_MODES}, got {mode!r}")
    if mode == "clip" and truncate < 1:
        raise ValueError(f"prp mode='clip' needs truncate >= 1, got {truncate}")
    if level not in PRP_LEVELS:
        raise ValueError(f"prp level must be one of {PRP_LEVELS}, got {level!r}")
    if mode == "shaping" and level != "chunk":
        raise ValueError("prp mode='shaping' (LUFFY) shapes per chunk; use level='chunk'")
    options = bind("prp", options, scale=scale, eps=eps)
    pooling = Pooling(options.scale_rewards, options.reward_eps, options.tau, capability_weighted)

    def extend(rows, see_view, key):
        rows = with_pooled(rows, see_view, pooling)
        cm = rows.completion_mask
        cand = ((rows.row_kind == PEER) & ~rows.truncated & (rows.source != rows.consumer)
                & (jnp.sum(cm, -1) > 0))
        rw = jnp.ones_like(rows.rewards)
        if compat_gate:
            admit, rw = compatibility_gate(peer_compatibility(rows), delta)
            cand = cand & admit
        tok_w, tok_valid, metrics = _prp_weights(rows, cand, level, truncate, mode, gamma)
        c = cand[:, None]
        w = tok_w * rw[:, None]
        shaped = mode == "shaping"      # LUFFY rows: PRP's own term below; they stay in the PG denominator
        rows = rows.replace(
            pg_row=jnp.where(cand, 1.0, rows.pg_row),
            pg_mask=jnp.where(c, tok_valid, rows.pg_mask),
            pg_weight=jnp.where(c, 0.0 if shaped else w, rows.pg_weight),
            aux_weight=jnp.where(c, w, rows.aux_weight) if shaped else rows.aux_weight)
        ntok = jnp.sum(cm * c)
        metrics.update({"prp/rows": (jnp.sum(cand.astype(jnp.float32)), jnp.float32(1.0)),
                        "prp/tokens": (jnp.sum(tok_valid * c), jnp.float32(1.0)),
                        "prp/residual_frac": (ntok - jnp.sum(tok_valid * c), ntok)})
        return rows, metrics

    def advantages(rewards, rows, see_view, adv):
        pooled = with_pooled(rows, see_view, pooling).pooled_advantages
        use = (rows.row_kind == OWN) | ((rows.row_kind == PEER) & (rows.pg_row > 0))
        return jnp.where(use, pooled, adv)

    def shaping_term(logp, rows):
        """LUFFY: -f(rho_c) A w on the shaped rows' tokens (rho_c = pi_theta(chunk) / pi_j(chunk), no clip, w the
        row's ``aux_weight``), aggregated as the PG term and over its denominator (the rows' pg_row / pg_mask)."""
        C = rows.src_chunk_logp.shape[1]
        on = rows.aux_weight > 0
        cl = chunk_sums(logp.astype(jnp.float32) * rows.completion_mask, rows.dst_chunk, C)
        log_rho = jnp.where(on, chunk_gather(cl - rows.src_chunk_logp, rows.dst_chunk), 0.0)
        adv = jax.lax.stop_gradient(rows.advantages)[:, None]
        per_token = jnp.where(on, -(grpo.policy_shaping(jnp.exp(log_rho), gamma) * adv), 0.0)
        per_token = per_token * jax.lax.stop_gradient(rows.aux_weight)
        s, _ = grpo.aggregate(per_token, rows.pg_mask, options.loss_type, options.max_completion_length,
                              jnp.any(on, -1))
        _, d = grpo.aggregate(jnp.zeros_like(per_token), rows.pg_mask, options.loss_type,
                              options.max_completion_length, rows.pg_row)
        return s[None], d[None], {}

    return Probe("prp", extend, advantages, shaping_term if mode == "shaping" else _id_loss_terms,
                 needs_peers=True, needs_peer_logp=True, options=options, pooling=pooling)


# ----------------------------------------------------------------------------- SGT

SGT_GATES = ("own_failure", "always")
SGT_NORMALIZE = ("rescues", "prompts")


def _own_failed(rows: Rows, tau) -> jax.Array:
    """bool[P]: prompts on which no own sample reached tau."""
    own_max = jax.ops.segment_max(jnp.where(rows.row_kind == OWN, rows.rewards, -jnp.inf), rows.prompt_slot,
                                  num_segments=rows.num_prompts)
    return own_max < tau


def sgt(lam: float = 0.1, tau: Optional[float] = None, gate: str = "own_failure", rescues_per_prompt: int = 1,
        length_normalize: bool = True, compat_gate: bool = False, delta: float = 0.8,
        normalize: str = "rescues", *, options: Optional[RunOptions] = None) -> Probe:
    """SGT: on prompts where the policy has no own success (max_g r < tau; gate="always": every prompt) and a
    peer has a verified success y* (reward >= tau, not truncated), add
    -lam * (1/D) sum_{y*} (1/|y*|) sum_t log pi_i(y*_t | x, y*_<t) over ``rescues_per_prompt`` successes drawn
    uniformly (without replacement, with the key) per prompt. normalize: D = number of rescues that fired
    ("rescues", default: a mean over rescues, so one rescue in 32 prompts carries the full lam — the
    published re-implementation's auxiliary NLL term, lam = 0.1 on the mean NLL of the rescue examples) or
    D = number of batch prompts ("prompts": the term grows with the share of prompts rescued).
    tau: None = the run's SEE success threshold (``options.tau``). compat_gate (GRAFT): admit y* iff
    s > delta, weight min(s, 1). Metrics: sgt/rows_fired, sgt/prompts_failed, sgt/prompts_rescued, sgt/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"sgt gate must be one of {SGT_GATES}, got {gate!r}")
    if normalize not in SGT_NORMALIZE:
        raise ValueError(f"sgt normalize must be one of {SGT_NORMALIZE}, got {normalize!r}")
    if rescues_per_prompt < 1:
        raise ValueError(f"rescues_per_prompt must be >= 1, got {rescues_per_prompt}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    options = bind("sgt", options, tau=tau)
    t = options.tau

    def extend(rows, see_view, key):
        P = rows.num_prompts
        r, slot = rows.rewards, rows.prompt_slot
        failed = _own_failed(rows, t) if gate == "own_failure" else jnp.ones((P,), bool)
        cand = (((rows.row_kind == PEER) | (rows.row_kind == ARCHIVE)) & (r >= t) & ~rows.truncated
                & (rows.source != rows.consumer) & (jnp.sum(rows.completion_mask, -1) > 0) & failed[slot])
        weight = jnp.ones_like(r)
        if compat_gate:
            admit, weight = compatibility_gate(peer_compatibility(rows), delta)
            cand = cand & admit
        score = jnp.where(cand, jax.random.gumbel(key, r.shape), -jnp.inf)
        same = slot[:, None] == slot[None, :]
        rank = jnp.sum(same & cand[None, :] & (score[None, :] > score[:, None]), axis=1)
        sel = cand & (rank < rescues_per_prompt)
        fired = jax.ops.segment_sum(sel.astype(jnp.float32), slot, num_segments=P) > 0
        rows = rows.replace(sft_weight=jnp.where(sel, weight, rows.sft_weight))
        return rows, {"sgt/rows_fired": (jnp.sum(sel.astype(jnp.float32)), jnp.float32(1.0)),
                      "sgt/prompts_failed": (jnp.sum(failed.astype(jnp.float32)), jnp.float32(P)),
                      "sgt/prompts_rescued": (jnp.sum(fired.astype(jnp.float32)), jnp.float32(1.0))}

    def loss_terms(logp, rows):
        w = jnp.where(rows.row_kind == OWN_ARCHIVE, 0.0, rows.sft_weight)
        s, d, m = sgt_rescue_loss(logp, rows.completion_mask, w, lam=lam, length_normalize=length_normalize)
        if normalize == "prompts":
            d = jnp.float32(rows.num_prompts)
        return s[None], d[None], m

    return Probe("sgt", extend, _id_advantages, loss_terms, needs_peers=True, needs_peer_logp=compat_gate,
                 options=options)


# ----------------------------------------------------------------------------- replay (own-skill anchor)

def replay(lam: float = 0.1, tau: Optional[float] = None, gate: str = "always", *,
           options: Optional[RunOptions] = None) -> Probe:
    """Replay of the policy's OWN verified successes archived in SEE (view slots of kind OWN_ARCHIVE): adds
    -lam * mean (1/|y|) sum_t log pi_i(y_t | x, y_<t) over them, on every batch prompt that has one
    (gate="always") or only where the current own group failed (gate="own_failure"). tau: None = the run's
    SEE success threshold. Not in the paper: an anchor against forgetting the own skill while SGT/PRP pull
    toward a peer's (DESIGN.md, demo). Metrics: replay/rows, replay/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"replay gate must be one of {SGT_GATES}, got {gate!r}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    options = bind("replay", options, tau=tau)
    t = options.tau

    def extend(rows, see_view, key):
        open_ = _own_failed(rows, t) if gate == "own_failure" else jnp.ones((rows.num_prompts,), bool)
        sel = ((rows.row_kind == OWN_ARCHIVE) & (rows.rewards >= t) & ~rows.truncated
               & (jnp.sum(rows.completion_mask, -1) > 0) & open_[rows.prompt_slot])
        rows = rows.replace(sft_weight=jnp.where(sel, 1.0, rows.sft_weight))
        return rows, {"replay/rows": (jnp.sum(sel.astype(jnp.float32)), jnp.float32(1.0))}

    def loss_terms(logp, rows):
        w = jnp.where(rows.row_kind == OWN_ARCHIVE, rows.sft_weight, 0.0)
        s, d, m = sgt_rescue_loss(logp, rows.completion_mask, w, lam=lam)
        return s[None], d[None], {"replay/nll": m["sgt/nll"]}

    return Probe("replay", extend, _id_advantages, loss_terms, needs_peers=True, options=options)
