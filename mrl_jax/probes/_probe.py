"""The ``Probe`` type (a named tuple of pure functions), its identities, ``none``, ``chain``, and the run options
a probe takes from the run."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.rows import Rows


def _id_extend(rows, see_view, key):
    return rows, {}


def _id_advantages(rewards, rows, see_view, adv):
    return adv


def _id_loss_terms(logp, rows):
    z = jnp.zeros((0,), jnp.float32)
    return z, z, {}


class Probe(NamedTuple):
    """A sharing probe: named tuple of pure functions (identities by default), see :mod:`mrl_jax.probes`.

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
