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
Options that the run defines (advantage scale and eps, PG aggregation, SEE success threshold: ``RunOptions``)
are bound when a probe is built, ``make_probe(spec, RunOptions.of(grpo_config, tau))``: a probe option left
None takes the run's value, an explicit one that contradicts the run is a ValueError. The rows carry data only.

Row layout (``Rows``, one padded layout for every probe, so all probes share one shape):
rows ``[0, P*G)`` are the policy's own rollouts, prompt-major (row = p*G + g); rows ``[P*G, P*G + P*K)``
are K peer slots per batch prompt from the consumer's ``SeeView`` (row = P*G + p*K + k). Own rows are
active in the policy-gradient term; peer slots are inactive (``pg_row = 0``, ``sft_weight = 0``) until
a probe's extend activates them. See ``Rows`` for the fields. Constructors: ``none``, ``xgrpo``, ``prp``,
``sgt``; ``make_probe("xgrpo+sgt")`` parses specs. The small pure helpers (``importance_weights``,
``effective_sample_size``, ``compatibility_score``, ``policy_shaping``, ``sgt_rescue_loss``) are
shared with the bandit lab.

Modules: ``_weights`` (those helpers), ``_pooling`` (the pooled-group baseline, once per chain), ``_probe`` (the
type, ``none``, ``chain``, ``RunOptions``), ``_kinds`` (the probes), ``_specs`` (the registry, spec strings,
``switch``).
"""

from mrl_jax.grpo import policy_shaping
from mrl_jax.probes._kinds import PRP_LEVELS, SGT_GATES, SGT_NORMALIZE, prp, replay, sgt, xgrpo
from mrl_jax.probes._pooling import Pooling, pooled_row_advantages, with_pooled
from mrl_jax.probes._probe import Probe, RunOptions, chain, none
from mrl_jax.probes._specs import REGISTRY, make_probe, switch
from mrl_jax.probes._weights import (WEIGHT_MODES, compatibility_gate, compatibility_score, effective_sample_size,
                                     importance_weights, peer_compatibility, sgt_rescue_loss, weight_variance)
from mrl_jax.rows import ARCHIVE, EMPTY, OWN, OWN_ARCHIVE, PEER, PER_ROW, Rows, chunk_gather, chunk_sums

__all__ = [
    "ARCHIVE", "EMPTY", "OWN", "OWN_ARCHIVE", "PEER", "PER_ROW", "PRP_LEVELS", "REGISTRY", "SGT_GATES",
    "SGT_NORMALIZE", "WEIGHT_MODES", "Pooling", "Probe", "Rows", "RunOptions", "chain", "chunk_gather", "chunk_sums", "compatibility_gate",
    "compatibility_score", "effective_sample_size", "importance_weights", "make_probe", "none", "peer_compatibility",
    "policy_shaping", "pooled_row_advantages", "prp", "replay", "sgt", "sgt_rescue_loss",
    "switch", "weight_variance", "with_pooled", "xgrpo",
]
