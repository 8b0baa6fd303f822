"""The ``Probe`` type (a named tuple of pure functions), its identities, ``none``, ``chain``, and ``RunOptions``:
the options a probe takes from the run, bound when the probe is built."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.probes._pooling import Pooling, chain_pooling, with_pooled


def _id_extend(rows, see_view, key):
    return rows, {}


def _id_advantages(rewards, rows, see_view, adv):
    return adv


def _id_loss_terms(logp, rows):
    z = jnp.zeros((0,), jnp.float32)
    return z, z, {}


class RunOptions(NamedTuple):
    """The run's options a probe's terms follow, bound when the probe is built (``make_probe(spec, options)``):
    advantage scale and eps (``grpo.scale_rewards`` / ``reward_eps``), the PG aggregation (``loss_type``,
    ``max_completion_length``; None = the completion width) and the SEE success threshold ``tau``."""
    scale_rewards: str = "group"
    reward_eps: float = 1e-4
    loss_type: str = "grpo"
    max_completion_length: Optional[int] = None
    tau: float = 1.0

    @classmethod
    def of(cls, grpo_config, tau: float = 1.0) -> "RunOptions":
        """The options of a ``GRPOConfig`` (and the SEE success threshold)."""
        return cls(grpo.normalize_scale(grpo_config.scale_rewards), float(grpo_config.reward_eps),
                   grpo_config.loss_type, int(grpo_config.max_completion_length), float(tau))

    def mismatch(self, grpo_config) -> list[str]:
        """``key: probe value vs config value`` wherever a probe built with these options disagrees with
        ``grpo_config`` (max_completion_length None agrees with any)."""
        other = RunOptions.of(grpo_config, self.tau)
        return [f"{k}: {getattr(self, k)!r} vs {getattr(other, k)!r}"
                for k in ("scale_rewards", "reward_eps", "loss_type", "max_completion_length")
                if getattr(self, k) not in (getattr(other, k), None)]


OPTION_KEYS = {"scale": "scale_rewards", "eps": "reward_eps", "tau": "tau"}   # probe option -> RunOptions field
RUN_KEYS = {"scale_rewards": "grpo.scale_rewards", "reward_eps": "grpo.reward_eps", "tau": "see.success_threshold"}


def bind(probe: str, options: Optional[RunOptions], **explicit) -> RunOptions:
    """A probe's options: the run's (``options``) where the probe's own option is None. An explicit probe option
    must agree with the run's when a run gave ``options`` (one source of truth), and replaces the default when
    none did (library use: ``sgt(tau=0.5)``)."""
    out = {}
    for option, value in explicit.items():
        if value is None:
            continue
        key = OPTION_KEYS[option]
        value = grpo.normalize_scale(value) if option == "scale" else float(value)
        if options is not None and value != getattr(options, key):
            raise ValueError(f"probe option {probe}:{option}={value!r} contradicts the run's {RUN_KEYS[key]}="
                             f"{getattr(options, key)!r}; drop the probe option (probes take it from the run) or "
                             f"change {RUN_KEYS[key]}")
        out[key] = value
    return (RunOptions() if options is None else options)._replace(**out)


class Probe(NamedTuple):
    """A sharing probe: named tuple of pure functions (identities by default), see :mod:`mrl_jax.probes`.

    needs_peers: the objective appends the view's peer slots to the rows (else own rows only).
    needs_peer_logp: the objective fills old_logp of peer rows with a no-grad forward before ``extend``.
    Both are layout facts (static shapes and the pre-pass); behaviour is carried by the rows a probe writes.
    options: the run options the probe was built with (the learner checks them against its ``GRPOConfig``).
    pooling: how the probe pools group baselines (``Pooling``), None when it does not: it then reads
    ``rows.pooled_advantages`` (``with_pooled``), which a chain computes once for all its members.
    """
    name: str = "none"
    extend: Callable = _id_extend
    advantages: Callable = _id_advantages
    loss_terms: Callable = _id_loss_terms
    needs_peers: bool = False
    needs_peer_logp: bool = False
    options: RunOptions = RunOptions()
    pooling: Optional[Pooling] = None


def none(*, options: Optional[RunOptions] = None) -> Probe:
    """Independent GRPO."""
    return Probe("none", options=RunOptions() if options is None else options)


def chain(*probes: Probe) -> Probe:
    """Compose probes: extends in order (key folded with the index; metrics merged), advantages composed
    (each transforms the previous result), loss terms concatenated. The members' pooled-group advantages are
    computed once, first (``chain_pooling``: capability-weighted when any member asks)."""
    acting = tuple(p for p in probes if p.name != "none")
    if len({p.options._replace(tau=None) for p in acting}) > 1:   # each probe keeps its own tau
        raise ValueError(f"chain: the probes were built with different run options {[p.options for p in acting]}")
    options = (acting or probes or (none(),))[0].options
    probes = acting or (none(options=options),)
    if len(probes) == 1:
        return probes[0]

    pooling = chain_pooling([p.pooling for p in probes])

    def extend(rows, see_view, key):
        metrics = {}
        if pooling is not None:
            rows = with_pooled(rows, see_view, pooling)
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
                 any(p.needs_peers for p in probes), any(p.needs_peer_logp for p in probes), options, pooling)
