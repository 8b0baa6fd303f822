"""Sharing probes as composable transforms of a policy's GRPO inputs (the optax idea).

A ``Probe`` is a named tuple of pure functions, each the identity by default:

    extend(rows, see_view, key) -> rows          data level: activate peer rows (weights, masks)
    advantages(rewards, rows, see_view, adv) -> adv   value level: transform the incoming advantages
    loss_terms(logp, rows) -> (sums f32[K], denominators f32[K], metrics)   outcome level: extra terms

``chain(p1, p2, ...)`` applies the extends in order, composes the advantages (each gets the previous
result; the first gets GRPO's group advantages) and concatenates the loss terms; the learner adds
``sum_k sums[k] / denominators[k]`` to the policy-gradient term. Denominators depend only on ``rows``
(never on ``logp``), so micro-batch accumulation is exact. Metrics are ``name -> (sum, count)``.

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
from flax import struct

from mrl_jax import grpo
from mrl_jax.grpo import policy_shaping  # noqa: F401  (re-exported helper)

OWN, PEER, ARCHIVE, OWN_ARCHIVE, EMPTY = 0, 1, 2, 3, -1
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


# ----------------------------------------------------------------------------- the row layout

@struct.dataclass
class Rows:
    """The padded row layout every probe reads and writes (R = P*G own rows + P*K peer slots).

    Inputs: prompt_ids int32[R, Tp], prompt_mask bool[R, Tp], completion_ids int32[R, Tc],
    completion_mask f32[R, Tc], old_logp f32[R, Tc] (peer rows: the consumer's current log-probs,
    filled by the learner's no-grad pre-pass when a probe needs them), ref_logp f32[R, Tc],
    rewards f32[R], truncated bool[R], row_kind int32[R] (OWN=0, PEER=1 current-round peer rollout,
    ARCHIVE=2 archived verified peer success, OWN_ARCHIVE=3 own archived success (replay), EMPTY=-1), prompt_slot int32[R] (0..P-1), source int32[R]
    (generating policy), dst_chunk int32[R, Tc] (THL chunk of each completion token, -1 pad; own rows -1),
    src_chunk_logp f32[R, C] (source behaviour log-prob summed per chunk), chunk_valid bool[R, C]
    (False = THL residual chunk).
    Probe-controlled: pg_row f32[R] (row counts in the policy-gradient term), pg_mask f32[R, Tc] (tokens
    of the PG term), pg_weight f32[R, Tc] (stop-gradient per-token weight, e.g. PRP importance weights),
    shaping bool[R] (PG term uses LUFFY policy shaping on this row), sft_weight f32[R] (SGT rescue weight),
    advantages f32[R]. metrics: dict of full-batch probe figures name -> (sum, count) (not per row).
    consumer int32[] / num_prompts / num_generations describe the layout; probe_index int32[] selects the
    acting chain of a ``switch`` probe (the update's ``probe_index`` argument).
    """
    prompt_ids: jax.Array
    prompt_mask: jax.Array
    completion_ids: jax.Array
    completion_mask: jax.Array
    old_logp: jax.Array
    ref_logp: jax.Array
    rewards: jax.Array
    truncated: jax.Array
    row_kind: jax.Array
    prompt_slot: jax.Array
    source: jax.Array
    dst_chunk: jax.Array
    src_chunk_logp: jax.Array
    chunk_valid: jax.Array
    pg_row: jax.Array
    pg_mask: jax.Array
    pg_weight: jax.Array
    shaping: jax.Array
    sft_weight: jax.Array
    advantages: jax.Array
    consumer: jax.Array
    probe_index: jax.Array
    metrics: dict = struct.field(default_factory=dict)
    num_prompts: int = struct.field(pytree_node=False, default=0)
    num_generations: int = struct.field(pytree_node=False, default=0)

    PER_ROW = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "old_logp", "ref_logp",
               "rewards", "truncated", "row_kind", "prompt_slot", "source", "dst_chunk", "src_chunk_logp",
               "chunk_valid", "pg_row", "pg_mask", "pg_weight", "shaping", "sft_weight", "advantages")

    @property
    def num_own(self) -> int:
        return self.num_prompts * self.num_generations


def add_metrics(rows: Rows, new: dict) -> Rows:
    return rows.replace(metrics=grpo.merge_metrics(rows.metrics, new))


def chunk_sums(x: jax.Array, dst_chunk: jax.Array, num_chunks: int) -> jax.Array:
    """Per-row chunk sums: x f32[R, T], dst_chunk int32[R, T] (-1 ignored) -> f32[R, C]."""
    onehot = (dst_chunk[..., None] == jnp.arange(num_chunks)[None, None, :]).astype(jnp.float32)
    return jnp.einsum("rt,rtc->rc", x.astype(jnp.float32), onehot)


def chunk_gather(v: jax.Array, dst_chunk: jax.Array) -> jax.Array:
    """Per-token value of its chunk: v f32[R, C], dst_chunk int32[R, T] -> f32[R, T] (0 where -1)."""
    g = jnp.take_along_axis(v, jnp.maximum(dst_chunk, 0), axis=1)
    return jnp.where(dst_chunk >= 0, g, 0.0)


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
    return rows


def _id_advantages(rewards, rows, see_view, adv):
    return adv


def _id_loss_terms(logp, rows):
    z = jnp.zeros((0,), jnp.float32)
    return z, z, {}


class Probe(NamedTuple):
    """A sharing probe: named tuple of pure functions (identities by default), see the module docstring.

    needs_peers: the learner appends the view's peer slots to the rows (else own rows only).
    needs_peer_logp: the learner fills old_logp of peer rows with a no-grad forward before ``extend``.
    uses_shaping: the PG term computes LUFFY shaping on rows flagged ``shaping`` (PRP mode="shaping").
    shaping_gamma: gamma of LUFFY's f(rho) = rho / (rho + gamma) used by that term.
    """
    name: str = "none"
    extend: Callable = _id_extend
    advantages: Callable = _id_advantages
    loss_terms: Callable = _id_loss_terms
    needs_peers: bool = False
    needs_peer_logp: bool = False
    uses_shaping: bool = False
    shaping_gamma: float = 0.1


def _shaping_gamma(probes) -> float:
    gammas = {p.shaping_gamma for p in probes if p.uses_shaping}
    if len(gammas) > 1:
        raise ValueError(f"probes in one chain use different policy-shaping gammas {sorted(gammas)}")
    return gammas.pop() if gammas else 0.1


def none() -> Probe:
    """Independent GRPO."""
    return Probe("none")


def chain(*probes: Probe) -> Probe:
    """Compose probes: extends in order (key folded with the index), advantages composed, loss terms
    concatenated, metrics merged."""
    probes = tuple(p for p in probes if p.name != "none") or (none(),)
    if len(probes) == 1:
        return probes[0]

    def extend(rows, see_view, key):
        for i, p in enumerate(probes):
            rows = p.extend(rows, see_view, jax.random.fold_in(key, i))
        return rows

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
                 any(p.needs_peers for p in probes), any(p.needs_peer_logp for p in probes),
                 any(p.uses_shaping for p in probes), _shaping_gamma(probes))


def switch(*choices) -> Probe:
    """One compiled update for several probe chains: ``rows.probe_index`` (the update's ``probe_index``
    argument, a traced int) picks the chain that acts; the others run but are masked out. Costs the union
    of the chains' rows (peer slots are always assembled). E.g. ``switch("none", "xgrpo", "prp", "sgt")``."""
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
        upd = {f: pick(idx, [getattr(o, f) for o in outs]) for f in Rows.PER_ROW}
        new = [{k: v for k, v in o.metrics.items() if k not in rows.metrics} for o in outs]
        return rows.replace(**upd, metrics=grpo.merge_metrics(rows.metrics, masked(idx, new)))

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
                 needs_peer_logp=any(c.needs_peer_logp for c in choices),
                 uses_shaping=any(c.uses_shaping for c in choices), shaping_gamma=_shaping_gamma(choices))


# ----------------------------------------------------------------------------- XGRPO / PRP advantages

def pooled_row_advantages(rows: Rows, see_view, scale="group", eps: float = 1e-4,
                          capability_weighted: bool = False) -> jax.Array:
    """A_r = (r - b(x)) / (s(x) + eps) with b, s pooled over own rows and every peer's group stats for the
    row's prompt (``grpo.pooled_advantages_from_stats``; equals grpo.pooled_advantages)."""
    return grpo.pooled_advantages_from_stats(rows.rewards, rows.prompt_slot, rows.row_kind == OWN,
                                             see_view.peer_stats, scale=scale, eps=eps,
                                             capability_weighted=capability_weighted, tau=see_view.tau)


def xgrpo(scale="group", capability_weighted: bool = False, eps: float = 1e-4) -> Probe:
    """XGRPO: own samples' advantages use a baseline/scale pooled over all policies' groups for the prompt
    (HACPO capability weights when capability_weighted). Only own rows are trained."""
    grpo._norm_scale(scale)

    def advantages(rewards, rows, see_view, adv):
        pooled = pooled_row_advantages(rows, see_view, scale, eps, capability_weighted)
        own = rows.row_kind == OWN
        return jnp.where(own, pooled, adv)

    def extend(rows, see_view, key):
        # metric: own advantage on prompts a peer solved (computed in advantages' terms, recorded here)
        pooled = pooled_row_advantages(rows, see_view, scale, eps, capability_weighted)
        solved = jnp.sum(see_view.peer_stats[..., 3], -1) > 0          # [P]
        sel = ((rows.row_kind == OWN) & solved[rows.prompt_slot]).astype(jnp.float32)
        return add_metrics(rows, {"xgrpo/adv_on_peer_solved": (jnp.sum(pooled * sel), jnp.sum(sel)),
                                  "xgrpo/peer_solved_frac": (jnp.sum(solved.astype(jnp.float32)),
                                                             jnp.float32(solved.shape[0]))})

    return Probe("xgrpo", extend, advantages, _id_loss_terms)



# ----------------------------------------------------------------------------- PRP

def prp(truncate: float = 1.0, mode: str = "truncate", gamma: float = 0.1, compat_gate: bool = False,
        delta: float = 0.8, scale="group", eps: float = 1e-4, capability_weighted: bool = False) -> Probe:
    """PRP: train on peers' current-round rollouts for the same prompt (retokenized by THL) with pooled-group
    advantages (own rows too) and per-chunk importance weights w = exp(chunk logp_i - chunk logp_j)
    (stop-gradient; ``importance_weights`` with truncate/mode). Residual chunks (chunk_valid False) are
    masked out of the PG term. mode="shaping" (LUFFY): peer tokens use f(rho_c) = rho_c/(rho_c + gamma)
    with rho_c = pi_theta(chunk)/pi_j(chunk) in place of the clipped ratio (each chunk's term spread
    evenly over its tokens). compat_gate (GRAFT): admit a peer row iff s > delta, weight min(s, 1).
    Metrics: prp/ess (normalised Kish ESS of the chunk weights), prp/weight_var, prp/weight_mean,
    prp/rows, prp/residual_frac."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"prp mode must be one of {WEIGHT_MODES}, got {mode!r}")
    if mode == "clip" and truncate < 1:
        raise ValueError(f"prp mode='clip' needs truncate >= 1, got {truncate}")
    grpo._norm_scale(scale)

    def extend(rows, see_view, key):
        C = rows.src_chunk_logp.shape[1]
        cm = rows.completion_mask
        cand = ((rows.row_kind == PEER) & ~rows.truncated & (rows.source != rows.consumer)
                & (jnp.sum(cm, -1) > 0))
        valid = rows.chunk_valid.astype(jnp.float32)
        dst = chunk_sums(rows.old_logp * cm, rows.dst_chunk, C)
        w = importance_weights(dst, rows.src_chunk_logp, truncate=truncate, mode=mode, gamma=gamma)
        tok_valid = chunk_gather(valid, rows.dst_chunk) * cm
        if mode == "shaping":
            ntok = chunk_sums(cm, rows.dst_chunk, C)
            tok_w = chunk_gather(valid / jnp.maximum(ntok, 1.0), rows.dst_chunk)
        else:
            tok_w = chunk_gather(w * valid, rows.dst_chunk)
        rw = jnp.ones_like(rows.rewards)
        if compat_gate:
            admit, rw = compatibility_gate(peer_compatibility(rows), delta)
            cand = cand & admit
        c = cand[:, None]
        rows = rows.replace(
            pg_row=jnp.where(cand, 1.0, rows.pg_row),
            pg_mask=jnp.where(c, tok_valid, rows.pg_mask),
            pg_weight=jnp.where(c, tok_w * rw[:, None], rows.pg_weight),
            shaping=rows.shaping | cand if mode == "shaping" else rows.shaping)
        wm = valid * c
        ntok = jnp.sum(cm * c)
        return add_metrics(rows, {
            "prp/ess": (effective_sample_size(w, wm), jnp.float32(1.0)),
            "prp/weight_var": (weight_variance(w, wm), jnp.float32(1.0)),
            "prp/weight_mean": (jnp.sum(w * wm), jnp.sum(wm)),
            "prp/rows": (jnp.sum(cand.astype(jnp.float32)), jnp.float32(1.0)),
            "prp/residual_frac": (ntok - jnp.sum(tok_valid * c), ntok)})

    def advantages(rewards, rows, see_view, adv):
        pooled = pooled_row_advantages(rows, see_view, scale, eps, capability_weighted)
        use = (rows.row_kind == OWN) | ((rows.row_kind == PEER) & (rows.pg_row > 0))
        return jnp.where(use, pooled, adv)

    return Probe("prp", extend, advantages, _id_loss_terms, needs_peers=True, needs_peer_logp=True,
                 uses_shaping=mode == "shaping", shaping_gamma=gamma)


# ----------------------------------------------------------------------------- SGT

SGT_GATES = ("own_failure", "always")


def sgt(lam: float = 0.1, tau: float = 1.0, gate: str = "own_failure", rescues_per_prompt: int = 1,
        length_normalize: bool = True, compat_gate: bool = False, delta: float = 0.8) -> Probe:
    """SGT: on prompts where the policy has no own success (max_g r < tau; gate="always": every prompt) and a
    peer has a verified success y* (reward >= tau, not truncated), add
    -lam * mean_{y*} (1/|y*|) sum_t log pi_i(y*_t | x, y*_<t) over ``rescues_per_prompt`` successes drawn
    uniformly (without replacement, with the key) per prompt. compat_gate (GRAFT): admit y* iff s > delta,
    weight min(s, 1). Metrics: sgt/rows_fired, sgt/prompts_failed, sgt/prompts_rescued, sgt/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"sgt gate must be one of {SGT_GATES}, got {gate!r}")
    if rescues_per_prompt < 1:
        raise ValueError(f"rescues_per_prompt must be >= 1, got {rescues_per_prompt}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")

    def extend(rows, see_view, key):
        P = rows.num_prompts
        r, slot = rows.rewards, rows.prompt_slot
        own = rows.row_kind == OWN
        own_max = jax.ops.segment_max(jnp.where(own, r, -jnp.inf), slot, num_segments=P)
        failed = own_max < tau if gate == "own_failure" else jnp.ones((P,), bool)
        cand = (((rows.row_kind == PEER) | (rows.row_kind == ARCHIVE)) & (r >= tau) & ~rows.truncated
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
        return add_metrics(rows, {
            "sgt/rows_fired": (jnp.sum(sel.astype(jnp.float32)), jnp.float32(1.0)),
            "sgt/prompts_failed": (jnp.sum(failed.astype(jnp.float32)), jnp.float32(P)),
            "sgt/prompts_rescued": (jnp.sum(fired.astype(jnp.float32)), jnp.float32(1.0))})

    def loss_terms(logp, rows):
        w = jnp.where(rows.row_kind == OWN_ARCHIVE, 0.0, rows.sft_weight)
        s, d, m = sgt_rescue_loss(logp, rows.completion_mask, w, lam=lam, length_normalize=length_normalize)
        return s[None], d[None], m

    return Probe("sgt", extend, _id_advantages, loss_terms, needs_peers=True, needs_peer_logp=compat_gate)


# ----------------------------------------------------------------------------- replay (own-skill anchor)

def replay(lam: float = 0.1, tau: float = 1.0, gate: str = "always") -> Probe:
    """Replay of the policy's OWN verified successes archived in SEE (view slots of kind OWN_ARCHIVE): adds
    -lam * mean (1/|y|) sum_t log pi_i(y_t | x, y_<t) over them, on every batch prompt that has one
    (gate="always") or only where the current own group failed (gate="own_failure"). Not in the paper:
    an anchor against forgetting the own skill while SGT/PRP pull toward a peer's (DESIGN.md, demo).
    Metrics: replay/rows, replay/nll."""
    if gate not in SGT_GATES:
        raise ValueError(f"replay gate must be one of {SGT_GATES}, got {gate!r}")
    if lam < 0:
        raise ValueError(f"lam must be >= 0, got {lam}")

    def extend(rows, see_view, key):
        r, slot = rows.rewards, rows.prompt_slot
        own_max = jax.ops.segment_max(jnp.where(rows.row_kind == OWN, r, -jnp.inf), slot,
                                      num_segments=rows.num_prompts)
        open_ = own_max < tau if gate == "own_failure" else jnp.ones_like(own_max, bool)
        sel = ((rows.row_kind == OWN_ARCHIVE) & (r >= tau) & ~rows.truncated
               & (jnp.sum(rows.completion_mask, -1) > 0) & open_[slot])
        rows = rows.replace(sft_weight=jnp.where(sel, 1.0, rows.sft_weight))
        return add_metrics(rows, {"replay/rows": (jnp.sum(sel.astype(jnp.float32)), jnp.float32(1.0))})

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
