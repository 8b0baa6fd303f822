"""Sharing probes as composable transforms of a policy's GRPO inputs (the optax idea).

A ``Probe`` is a named tuple of pure functions, each the identity by default:

    extend(rows, see_view, key) -> (rows, metrics)   data level: activate peer rows (weights, masks)
    advantages(rewards, rows, see_view, adv) -> adv   value level: transform the incoming advantages
    loss_terms(logp, rows) -> (sums f32[K], denominators f32[K], metrics)   outcome level: extra terms

``chain(p1, p2, ...)`` applies the extends in order, composes the advantages (each gets the previous
result; the first gets GRPO's group advantages) and concatenates the loss terms; the objective
(``mrl_jax.objective``, shared by the learner and the bandit lab) adds ``sum_k sums[k] / denominators[k]``
to the policy-gradient term. Denominators depend only on ``rows`` (never on ``logp``), so micro-batch
accumulation is exact. Metrics are ``name -> (sum, count)``, returned beside the data.
Options that the run defines (advantage scale and eps: ``rows.scale_rewards`` / ``rows.reward_eps``;
success threshold: ``see_view.tau``) are taken from the run when a probe option is None; an explicit
probe option that contradicts the run is an error (``run_option_conflicts`` checks a spec up front).

Row layout (``Rows``, one padded layout for every probe, so all probes share one shape):
rows ``[0, P*G)`` are the policy's own rollouts, prompt-major (row = p*G + g); rows ``[P*G, P*G + P*K)``
are K peer slots per batch prompt from the consumer's ``SeeView`` (row = P*G + p*K + k). Own rows are
active in the policy-gradient term; peer slots are inactive (``pg_row = 0``, ``sft_weight = 0``) until
a probe's extend activates them. See ``Rows`` for the fields. Constructors: ``none``, ``xgrpo``, ``prp``,
``sgt``; ``make_probe("xgrpo+sgt")`` parses specs. The small pure helpers (``importance_weights``,
``effective_sample_size``, ``compatibility_score``, ``policy_shaping``, ``sgt_rescue_loss``) are
shared with the bandit lab.
"""

from __future__ import annotations

import ast
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.grpo import policy_shaping  # noqa: F401  (re-exported helper)
from mrl_jax.rows import (ARCHIVE, EMPTY, OWN, OWN_ARCHIVE, PEER, PER_ROW, Rows, chunk_gather,  # noqa: F401
                          chunk_sums)
WEIGHT_MODES = ("truncate", "clip", "shaping", "none")
_MAX_LOG = 80.0


# ----------------------------------------------------------------------------- pure helpers

def importance_weights(logp_dst: jax.Array, logp_src: jax.Array, *, truncate: float = 1.0,
                       mode: str = "truncate", gamma: float = 0.1, stop_gradient: bool = True) -> jax.Array:
    """Importance weights w = pi_dst / pi_src = exp(logp_dst - logp_src), transformed by ``mode``.

    truncate: min(w, truncate) (truncated IS); clip: clip(w, 1/truncate, truncate) (needs truncate >= 1);
    shaping: LUFFY f(w) = w / (w + gamma); none: w. Computed stably in log space; stop-gradient by default.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"mode must be one of {WEIGHT_MODES}, got {mode!r}")
    d = jnp.asarray(logp_dst, jnp.float32) - jnp.asarray(logp_src, jnp.float32)
    if mode == "truncate":
        if truncate <= 0:
            raise ValueError(f"truncate must be > 0, got {truncate}")
        w = jnp.exp(jnp.minimum(d, jnp.log(truncate)))
    elif mode == "clip":
        if truncate < 1:
            raise ValueError(f"mode='clip' clips to [1/truncate, truncate] and needs truncate >= 1, got {truncate}")
        lc = math.log(truncate)
        w = jnp.exp(jnp.clip(d, -lc, lc))
    elif mode == "shaping":
        w = jax.nn.sigmoid(d - jnp.log(gamma))            # = rho / (rho + gamma)
    else:
        w = jnp.exp(jnp.minimum(d, _MAX_LOG))
    return jax.lax.stop_gradient(w) if stop_gradient else w


def effective_sample_size(w: jax.Array, mask: Optional[jax.Array] = None, normalize: bool = True) -> jax.Array:
    """Kish effective sample size (sum w)^2 / sum w^2 over the masked entries; normalize=True divides by
    the count, giving a fraction in (0, 1] (1 = uniform weights). Empty -> 0."""
    w = jnp.asarray(w, jnp.float32)
    m = jnp.ones_like(w) if mask is None else jnp.asarray(mask, jnp.float32)
    s1, s2, n = jnp.sum(w * m), jnp.sum(w * w * m), jnp.sum(m)
    ess = jnp.where(s2 > 0, s1 * s1 / jnp.maximum(s2, 1e-30), 0.0)
    return jnp.where(n > 0, ess / jnp.maximum(n, 1.0), 0.0) if normalize else ess


def weight_variance(w: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Variance of the masked weights (population)."""
    w = jnp.asarray(w, jnp.float32)
    m = jnp.ones_like(w) if mask is None else jnp.asarray(mask, jnp.float32)
    n = jnp.maximum(jnp.sum(m), 1.0)
    mu = jnp.sum(w * m) / n
    return jnp.sum(m * (w - mu) ** 2) / n


def compatibility_score(mean_logp_i: jax.Array, mean_logp_j: jax.Array) -> jax.Array:
    """GRAFT compatibility s = exp(mean log pi_i - mean log pi_j) of a peer response (means over its chunks)."""
    return jnp.exp(jnp.minimum(jnp.asarray(mean_logp_i, jnp.float32) - jnp.asarray(mean_logp_j, jnp.float32),
                               _MAX_LOG))


def compatibility_gate(score: jax.Array, delta: float = 0.8) -> tuple[jax.Array, jax.Array]:
    """(admit = s > delta, weight = admit * min(s, 1))."""
    admit = score > delta
    return admit, jnp.where(admit, jnp.minimum(score, 1.0), 0.0)


def sgt_rescue_loss(logp: jax.Array, mask: jax.Array, row_weight: jax.Array, *, lam: float = 0.1,
                    length_normalize: bool = True) -> tuple[jax.Array, jax.Array, dict]:
    """SGT rescue term as (sum, denominator, metrics).

    logp f32[R, T] log pi_i of the rescue tokens y*, mask [R, T], row_weight f32[R] (0 = not a rescue row;
    e.g. the compatibility weight). sum = -lam * sum_r w_r * l_r with l_r = (1/|y*_r|) sum_t log pi
    (length_normalize) or sum_t log pi; denominator = number of rows with w_r > 0, so sum/denominator
    = -lam * mean over rescues.
    """
    m = jnp.asarray(mask, jnp.float32)
    w = jax.lax.stop_gradient(jnp.asarray(row_weight, jnp.float32))
    tok = jnp.sum(jnp.where(m > 0, logp.astype(jnp.float32), 0.0) * m, -1)
    ell = tok / jnp.maximum(jnp.sum(m, -1), 1.0) if length_normalize else tok
    s = -lam * jnp.sum(w * ell)
    d = jnp.sum((w > 0).astype(jnp.float32))
    nll = (-jax.lax.stop_gradient(jnp.sum(w * ell)), jnp.sum(w))
    return s, d, {"sgt/nll": nll}


def peer_compatibility(rows: Rows) -> jax.Array:
    """GRAFT score per row from old_logp (consumer) and src_chunk_logp (source), means over valid chunks."""
    C = rows.src_chunk_logp.shape[1]
    valid = rows.chunk_valid.astype(jnp.float32)
    dst = chunk_sums(rows.old_logp * rows.completion_mask, rows.dst_chunk, C)
    n = jnp.maximum(jnp.sum(valid, -1), 1.0)
    # NB: a row with no valid chunk scores exp(0) = 1 (no evidence either way); PRP masks such rows anyway.
    return compatibility_score(jnp.sum(dst * valid, -1) / n, jnp.sum(rows.src_chunk_logp * valid, -1) / n)


# ----------------------------------------------------------------------------- the Probe type

def _id_extend(rows, see_view, key):
    return rows, {}


def _id_advantages(rewards, rows, see_view, adv):
    return adv


def _id_loss_terms(logp, rows):
    z = jnp.zeros((0,), jnp.float32)
    return z, z, {}


class Probe(NamedTuple):
    """A sharing probe: named tuple of pure functions (identities by default), see the module docstring.

    needs_peers: the objective appends the view's peer slots to the rows (else own rows only).
    needs_peer_logp: the objective fills old_logp of peer rows with a no-grad forward before ``extend``.
    Both are layout facts (static shapes and the pre-pass); behaviour is carried by the rows a probe writes.
    """
    name: str = "none"
    extend: Callable = _id_extend
    advantages: Callable = _id_advantages
    loss_terms: Callable = _id_loss_terms
    needs_peers: bool = False
    needs_peer_logp: bool = False


def none() -> Probe:
    """Independent GRPO."""
    return Probe("none")


def chain(*probes: Probe) -> Probe:
    """Compose probes: extends in order (key folded with the index; metrics merged), advantages composed
    (each transforms the previous result), loss terms concatenated."""
    probes = tuple(p for p in probes if p.name != "none") or (none(),)
    if len(probes) == 1:
        return probes[0]

    def extend(rows, see_view, key):
        metrics = {}
        for i, p in enumerate(probes):
            rows, m = p.extend(rows, see_view, jax.random.fold_in(key, i))
            metrics = grpo.merge_metrics(metrics, m)
        return rows, metrics

    def advantages(rewards, rows, see_view, adv):
        for p in probes:
            adv = p.advantages(rewards, rows, see_view, adv)
        return adv

    def loss_terms(logp, rows):
        ss, ds, ms = [], [], {}
        for p in probes:
            s, d, m = p.loss_terms(logp, rows)
            ss.append(jnp.atleast_1d(s))
            ds.append(jnp.atleast_1d(d))
            ms = grpo.merge_metrics(ms, m)
        return jnp.concatenate(ss), jnp.concatenate(ds), ms

    return Probe("+".join(p.name for p in probes), extend, advantages, loss_terms,
                 any(p.needs_peers for p in probes), any(p.needs_peer_logp for p in probes))


def switch(*choices) -> Probe:
    """One compiled update for several probe chains: ``rows.probe_index`` (the update's ``probe_index``
    argument, a traced int) picks the chain that acts; the others run but are masked out. Costs the union
    of the chains' rows (peer slots are always assembled). E.g. ``switch("none", "xgrpo", "prp", "sgt")``.
    For library use (one compile over several chains); a run config names one chain per policy."""
    choices = tuple(make_probe(c) for c in choices)
    if not choices:
        raise ValueError("switch needs at least one probe")

    def pick(idx, xs):
        return jnp.stack(xs)[jnp.clip(idx, 0, len(xs) - 1)]

    def masked(idx, ms):
        out = {}
        for i, m in enumerate(ms):
            on = (idx == i).astype(jnp.float32)
            out = grpo.merge_metrics(out, {k: (v[0] * on, v[1] * on) for k, v in m.items()})
        return out

    def extend(rows, see_view, key):
        outs = [c.extend(rows, see_view, key) for c in choices]
        idx = rows.probe_index
        upd = {f: pick(idx, [getattr(o, f) for o, _ in outs]) for f in PER_ROW + ("pool_weighted",)}
        return rows.replace(**upd), masked(idx, [m for _, m in outs])

    def advantages(rewards, rows, see_view, adv):
        return pick(rows.probe_index, [c.advantages(rewards, rows, see_view, adv) for c in choices])

    def loss_terms(logp, rows):
        ss, ds, ms = [], [], []
        for i, c in enumerate(choices):
            s, d, m = c.loss_terms(logp, rows)
            ss.append(jnp.atleast_1d(s) * (rows.probe_index == i))
            ds.append(jnp.atleast_1d(d))
            ms.append(m)
        return jnp.concatenate(ss), jnp.concatenate(ds), masked(rows.probe_index, ms)

    return Probe("switch(" + ",".join(c.name for c in choices) + ")", extend, advantages, loss_terms,
                 needs_peers=any(c.needs_peers for c in choices),
                 needs_peer_logp=any(c.needs_peer_logp for c in choices))


# ----------------------------------------------------------------------------- run options

def _run_option(name: str, value, run_value, run_key: str):
    """A probe option: None = the run's value; an explicit value must agree with the run (one source of truth)."""
    if value is None:
        return run_value
    if value != run_value:
        raise ValueError(f"probe option {name}={value!r} contradicts the run's {run_key}={run_value!r}; drop the "
                         f"probe option (probes take it from the run) or change {run_key}")
    return value


def _scale_eps(rows: Rows, name: str, scale, eps):
    s = _run_option(f"{name}.scale", None if scale is None else grpo._norm_scale(scale), rows.scale_rewards,
                    "grpo.scale_rewards")
    return s, _run_option(f"{name}.eps", eps, rows.reward_eps, "grpo.reward_eps")


# ----------------------------------------------------------------------------- XGRPO / PRP advantages

def pooled_row_advantages(rows: Rows, see_view, scale="group", eps: float = 1e-4) -> jax.Array:
    """A_r = (r - b(x)) / (s(x) + eps) with b, s pooled over own rows and every peer's group stats for the
    row's prompt (``grpo.pooled_advantages_from_stats``; equals grpo.pooled_advantages); HACPO capability
    weights where ``rows.pool_weighted`` (any pooling probe of the chain asked for them)."""
    kw = dict(scale=scale, eps=eps, tau=see_view.tau)
    args = (rows.rewards, rows.prompt_slot, rows.row_kind == OWN, see_view.peer_stats)
    plain = grpo.pooled_advantages_from_stats(*args, capability_weighted=False, **kw)
    weighted = grpo.pooled_advantages_from_stats(*args, capability_weighted=True, **kw)
    return jnp.where(rows.pool_weighted, weighted, plain)


def _pooling(rows: Rows, capability_weighted: bool) -> Rows:
    return rows.replace(pool_weighted=rows.pool_weighted | capability_weighted) if capability_weighted else rows


def xgrpo(scale=None, capability_weighted: bool = False, eps: Optional[float] = None) -> Probe:
    """XGRPO: own samples' advantages use a baseline/scale pooled over all policies' groups for the prompt.
    Only own rows are trained. scale/eps: None = the run's grpo.scale_rewards / reward_eps (a different
    explicit value is an error). capability_weighted (HACPO) turns on capability weights for every pooling
    probe of the chain (``rows.pool_weighted``), so ``xgrpo(capability_weighted=True) + prp`` and
    ``prp + xgrpo(capability_weighted=True)`` give the same advantages: pooling probes commute.
    Metrics: xgrpo/adv_on_peer_solved, xgrpo/peer_solved_frac."""
    if scale is not None:
        grpo._norm_scale(scale)

    def advantages(rewards, rows, see_view, adv):
        pooled = pooled_row_advantages(rows, see_view, *_scale_eps(rows, "xgrpo", scale, eps))
        return jnp.where(rows.row_kind == OWN, pooled, adv)

    def extend(rows, see_view, key):
        rows = _pooling(rows, capability_weighted)
        pooled = pooled_row_advantages(rows, see_view, *_scale_eps(rows, "xgrpo", scale, eps))
        solved = jnp.sum(see_view.peer_stats[..., 3], -1) > 0          # [P]
        sel = ((rows.row_kind == OWN) & solved[rows.prompt_slot]).astype(jnp.float32)
        return rows, {"xgrpo/adv_on_peer_solved": (jnp.sum(pooled * sel), jnp.sum(sel)),
                      "xgrpo/peer_solved_frac": (jnp.sum(solved.astype(jnp.float32)), jnp.float32(solved.shape[0]))}

    return Probe("xgrpo", extend, advantages, _id_loss_terms)


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
        level: str = "chunk") -> Probe:
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
    if scale is not None:
        grpo._norm_scale(scale)

    def extend(rows, see_view, key):
        rows = _pooling(rows, capability_weighted)
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
        pooled = pooled_row_advantages(rows, see_view, *_scale_eps(rows, "prp", scale, eps))
        use = (rows.row_kind == OWN) | ((rows.row_kind == PEER) & (rows.pg_row > 0))
        return jnp.where(use, pooled, adv)

    def shaping_term(logp, rows):
        """LUFFY: -f(rho_c) A on the shaped rows' tokens (rho_c = pi_theta(chunk) / pi_j(chunk), no clip),
        aggregated as the PG term and over its denominator (the rows' pg_row / pg_mask)."""
        C = rows.src_chunk_logp.shape[1]
        on = rows.aux_weight > 0
        cl = chunk_sums(logp * rows.completion_mask, rows.dst_chunk, C)
        s, _, _ = grpo.policy_loss(logp, jax.lax.stop_gradient(logp), rows.advantages, rows.pg_mask,
                                   loss_type=rows.loss_type, max_completion_length=rows.max_completion_length,
                                   weights=rows.aux_weight, row_valid=jnp.any(on, -1), shaping_mask=on,
                                   shaping_logratio=chunk_gather(cl - rows.src_chunk_logp, rows.dst_chunk),
                                   shaping_gamma=gamma)
        _, d = grpo.aggregate(jnp.zeros_like(logp), rows.pg_mask, rows.loss_type, rows.max_completion_length,
                              rows.pg_row)
        return s[None], d[None], {}

    return Probe("prp", extend, advantages, shaping_term if mode == "shaping" else _id_loss_terms,
                 needs_peers=True, needs_peer_logp=True)


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
        normalize: str = "rescues") -> Probe:
    """SGT: on prompts where the policy has no own success (max_g r < tau; gate="always": every prompt) and a
    peer has a verified success y* (reward >= tau, not truncated), add
    -lam * (1/D) sum_{y*} (1/|y*|) sum_t log pi_i(y*_t | x, y*_<t) over ``rescues_per_prompt`` successes drawn
    uniformly (without replacement, with the key) per prompt. normalize: D = number of rescues that fired
    ("rescues", default: a mean over rescues, so one rescue in 32 prompts carries the full lam — the
    published re-implementation's auxiliary NLL term, lam = 0.1 on the mean NLL of the rescue examples) or
    D = number of batch prompts ("prompts": the term grows with the share of prompts rescued).
    tau: None = the run's SEE success threshold (``see_view.tau``). compat_gate (GRAFT): admit y* iff
    s > delta, weight min(s, 1). Metrics: sgt/rows_fired, sgt/prompts_failed, sgt/prompts_rescued, sgt/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"sgt gate must be one of {SGT_GATES}, got {gate!r}")
    if normalize not in SGT_NORMALIZE:
        raise ValueError(f"sgt normalize must be one of {SGT_NORMALIZE}, got {normalize!r}")
    if rescues_per_prompt < 1:
        raise ValueError(f"rescues_per_prompt must be >= 1, got {rescues_per_prompt}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")

    def extend(rows, see_view, key):
        P = rows.num_prompts
        t = see_view.tau if tau is None else tau
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

    return Probe("sgt", extend, _id_advantages, loss_terms, needs_peers=True, needs_peer_logp=compat_gate)


# ----------------------------------------------------------------------------- replay (own-skill anchor)

def replay(lam: float = 0.1, tau: Optional[float] = None, gate: str = "always") -> Probe:
    """Replay of the policy's OWN verified successes archived in SEE (view slots of kind OWN_ARCHIVE): adds
    -lam * mean (1/|y|) sum_t log pi_i(y_t | x, y_<t) over them, on every batch prompt that has one
    (gate="always") or only where the current own group failed (gate="own_failure"). tau: None = the run's
    SEE success threshold. Not in the paper: an anchor against forgetting the own skill while SGT/PRP pull
    toward a peer's (DESIGN.md, demo). Metrics: replay/rows, replay/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"replay gate must be one of {SGT_GATES}, got {gate!r}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")

    def extend(rows, see_view, key):
        t = see_view.tau if tau is None else tau
        open_ = _own_failed(rows, t) if gate == "own_failure" else jnp.ones((rows.num_prompts,), bool)
        sel = ((rows.row_kind == OWN_ARCHIVE) & (rows.rewards >= t) & ~rows.truncated
               & (jnp.sum(rows.completion_mask, -1) > 0) & open_[rows.prompt_slot])
        rows = rows.replace(sft_weight=jnp.where(sel, 1.0, rows.sft_weight))
        return rows, {"replay/rows": (jnp.sum(sel.astype(jnp.float32)), jnp.float32(1.0))}

    def loss_terms(logp, rows):
        w = jnp.where(rows.row_kind == OWN_ARCHIVE, rows.sft_weight, 0.0)
        s, d, m = sgt_rescue_loss(logp, rows.completion_mask, w, lam=lam)
        return s[None], d[None], {"replay/nll": m["sgt/nll"]}

    return Probe("replay", extend, _id_advantages, loss_terms, needs_peers=True)


# ----------------------------------------------------------------------------- registry

REGISTRY: dict[str, Callable[..., Probe]] = {"none": none, "xgrpo": xgrpo, "prp": prp, "sgt": sgt, "replay": replay}


def _parse_one(spec: str) -> Probe:
    name, _, args = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in REGISTRY:
        raise ValueError(f"unknown probe {name!r}; known: {sorted(REGISTRY)} (combine with '+', "
                         f"options as 'sgt:lam=0.3,tau=1.0')")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"probe option {item!r} in {spec!r} must be key=value")
        try:
            kwargs[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            kwargs[k.strip()] = v.strip()
    try:
        return REGISTRY[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for probe {name!r}: {e}") from None


def _spec_options(spec: str) -> list[tuple[str, dict]]:
    """[(probe name, explicit options)] of a '+'-joined spec string."""
    out = []
    for part in filter(str.strip, spec.split("+")):
        name, _, args = part.strip().partition(":")
        kw = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            k, _, v = item.partition("=")
            try:
                kw[k.strip()] = ast.literal_eval(v.strip())
            except (ValueError, SyntaxError):
                kw[k.strip()] = v.strip()
        out.append((name.strip().lower(), kw))
    return out


def run_option_conflicts(spec: str, *, scale_rewards: str, reward_eps: float, tau: float) -> list[str]:
    """Explicit probe options of ``spec`` that contradict the run (scale / eps vs the GRPO options, tau vs the
    SEE success threshold), as messages; [] when the spec agrees (options left out are taken from the run)."""
    run = {"scale": (scale_rewards, "grpo.scale_rewards"), "eps": (reward_eps, "grpo.reward_eps"),
           "tau": (tau, "see.success_threshold")}
    bad = []
    for name, kw in _spec_options(spec):
        for key, (value, run_key) in run.items():
            if key in kw:
                v = grpo._norm_scale(kw[key]) if key == "scale" else kw[key]
                if v != value:
                    bad.append(f"{name}:{key}={kw[key]!r} contradicts {run_key}={value!r} (drop the probe option: "
                               "probes take it from the run)")
    return bad


def make_probe(spec: Union[str, Probe, Sequence[Union[str, Probe]], None]) -> Probe:
    """Build a probe chain from "none" | "xgrpo" | "prp" | "sgt" | "xgrpo+sgt" | "sgt:lam=0.3" | a list |
    a Probe; "none|xgrpo|prp|sgt" builds a ``switch`` (one compile, chain picked by probe_index)."""
    if spec is None:
        return none()
    if isinstance(spec, Probe):
        return spec
    if isinstance(spec, str) and "|" in spec:
        return switch(*[p for p in spec.split("|") if p.strip()])
    if isinstance(spec, str):
        parts = [p for p in spec.split("+") if p.strip()]
        if not parts:
            raise ValueError("empty probe spec; use 'none'")
        return chain(*[_parse_one(p) for p in parts])
    return chain(*[make_probe(s) for s in spec])
