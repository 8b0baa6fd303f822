"""Pooled-group advantages (XGRPO's baseline), computed once per chain: a pooling probe declares its ``Pooling``
and reads ``rows.pooled_advantages``; ``chain`` fills that field once, with HACPO capability weights when any
member asks, so the pooling probes of a chain share one baseline and commute."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax

from mrl_jax import grpo
from mrl_jax.rows import OWN, Rows


class Pooling(NamedTuple):
    """How a probe pools: the run's advantage scale and eps, the success threshold tau of the capability weights,
    and whether they apply (HACPO)."""
    scale: str = "group"
    eps: float = 1e-4
    tau: float = 1.0
    capability_weighted: bool = False


def pooled_row_advantages(rows: Rows, see_view, scale="group", eps: float = 1e-4, tau: float = 1.0,
                          capability_weighted: bool = False) -> jax.Array:
    """f32[R]: A_r = (r - b(x)) / (s(x) + eps) with b, s pooled over own rows and every peer's group stats for the
    row's prompt (``grpo.pooled_advantages_from_stats``; equals grpo.pooled_advantages); HACPO capability weights
    (successes: reward >= tau) when ``capability_weighted``."""
    return grpo.pooled_advantages_from_stats(rows.rewards, rows.prompt_slot, rows.row_kind == OWN,
                                             see_view.peer_stats, scale=scale, eps=eps, tau=tau,
                                             capability_weighted=capability_weighted)


def with_pooled(rows: Rows, see_view, pooling: Pooling) -> Rows:
    """``rows`` with ``pooled_advantages`` set: computed here unless the chain (or an earlier member) already did."""
    if rows.pooled_advantages is not None:
        return rows
    return rows.replace(pooled_advantages=pooled_row_advantages(rows, see_view, *pooling))


def chain_pooling(poolings: Sequence[Optional[Pooling]]) -> Optional[Pooling]:
    """The one pooling of a chain's members (None: nobody pools): capability-weighted when any member asks."""
    members = [p for p in poolings if p is not None]
    if not members:
        return None
    weighted = any(p.capability_weighted for p in members)
    if weighted and len({p.tau for p in members}) > 1:
        raise ValueError(f"chain: the pooling probes share one capability-weighted baseline, but their success "
                         f"thresholds differ ({sorted({p.tau for p in members})}); give them one tau")
    return members[0]._replace(capability_weighted=weighted)
