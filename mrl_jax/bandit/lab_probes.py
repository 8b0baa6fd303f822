"""The probes the bandit lab compares, as specs that build the *library's* probes (``mrl_jax.probes``).

A ``LabProbe`` names one configuration and records its options, so the sampled update (``updates``) runs the
very ``Probe`` objects the LLM learner runs, and the exact expectation (``exact``) reads the same options.
Any other probe -- a built-in chain or a researcher's factory by import path (``"pkg.mod:hedge:lam=0.2+sgt"``) --
is a ``LabProbe`` with ``spec`` set (``get``): built by ``make_probe``, measured by Monte Carlo only (no closed
form), at every THL residual level (its use of the density ratio is unknown).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from mrl_jax import probes as P


@dataclasses.dataclass(frozen=True)
class LabProbe:
    """pooled: XGRPO/PRP pooled baseline for own rows; prp: train on peer rows; prp_mode: truncate | clip |
    shaping; truncate: PRP weight truncation; gamma: LUFFY shaping; prp_gate / sgt_gate: GRAFT compatibility
    gate (delta); sgt: add the rescue term with weight lam; sgt_always: rescue on every prompt."""
    name: str
    pooled: bool = False
    prp: bool = False
    prp_mode: str = "truncate"
    truncate: float = 1.0
    gamma: float = 0.1
    prp_gate: bool = False
    sgt: bool = False
    lam: float = 0.1
    sgt_gate: bool = False
    sgt_always: bool = False
    delta: float = 0.8
    spec: Optional[str] = None

    def build(self) -> P.Probe:
        """The library probe chain this spec stands for."""
        if self.spec is not None:
            return P.make_probe(self.spec)
        parts = []
        if self.pooled and not self.prp:
            parts.append(P.xgrpo())
        if self.prp:
            parts.append(P.prp(truncate=self.truncate, mode=self.prp_mode, gamma=self.gamma,
                               compat_gate=self.prp_gate, delta=self.delta))
        if self.sgt:
            parts.append(P.sgt(lam=self.lam, gate="always" if self.sgt_always else "own_failure",
                               compat_gate=self.sgt_gate, delta=self.delta))
        return P.chain(*parts) if parts else P.none()

    @property
    def uses_peers(self) -> bool:
        return self.build().needs_peers if self.spec is not None else self.prp or self.sgt

    @property
    def uses_ratio(self) -> bool:
        """Whether the THL residual (noisy density ratio) can change this probe's update (a ``spec`` probe: assumed)."""
        return self.spec is not None or self.prp or (self.sgt and self.sgt_gate)

    @property
    def exact(self) -> bool:
        """Whether ``exact.expected_coefficients`` gives this probe's expectation in closed form (the
        gated PRP's random row-count denominator couples every peer row, and a ``spec`` probe has none derived:
        both are measured by Monte Carlo)."""
        return self.spec is None and not (self.prp and self.prp_gate)


LAB_PROBES: dict[str, LabProbe] = {
    "none": LabProbe("none"),
    "xgrpo": LabProbe("xgrpo", pooled=True),
    "prp": LabProbe("prp", pooled=True, prp=True),
    "prp_shaping": LabProbe("prp_shaping", pooled=True, prp=True, prp_mode="shaping"),
    "prp_gate": LabProbe("prp_gate", pooled=True, prp=True, prp_gate=True),
    "sgt": LabProbe("sgt", sgt=True),
    "sgt_gate": LabProbe("sgt_gate", sgt=True, sgt_gate=True),
    "xgrpo_sgt": LabProbe("xgrpo_sgt", pooled=True, sgt=True),
    # extra configurations (not in the default comparison; see experiments/bandit/variants.py)
    "prp_raw": LabProbe("prp_raw", pooled=True, prp=True, prp_mode="none"),          # untruncated weights
    "sgt_lam1": LabProbe("sgt_lam1", sgt=True, lam=1.0),
}
DEFAULT_PROBES = ("none", "xgrpo", "prp", "prp_shaping", "prp_gate", "sgt", "sgt_gate", "xgrpo_sgt")


def get(name_or_spec, **overrides) -> LabProbe:
    """A LabProbe by name (``LAB_PROBES``) with optional field overrides, the LabProbe itself, or any other
    ``make_probe`` spec (a chain of built-ins, a factory by import path) as a Monte Carlo ``LabProbe``."""
    spec: Optional[LabProbe] = name_or_spec if isinstance(name_or_spec, LabProbe) else LAB_PROBES.get(name_or_spec)
    if spec is None:
        try:
            P.make_probe(name_or_spec)
        except ValueError as e:
            raise ValueError(f"unknown bandit probe {name_or_spec!r}: not a lab probe ({sorted(LAB_PROBES)}) nor a "
                             f"probe spec ({e})") from None
        spec = LabProbe(str(name_or_spec), spec=str(name_or_spec))
    return dataclasses.replace(spec, **overrides) if overrides else spec
