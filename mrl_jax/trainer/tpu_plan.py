"""``mrl plan``: a run compiled for a TPU topology from this machine, before any TPU is had.

The run is built abstractly (`Run(abstract=True)`: tiny models from their shapes, checkpoints from their
``config.json``, no weights), MWRA plans it onto the topology's devices (`mrl_jax.mwra.tpu`), and every
policy's update and sampler are lowered on abstract inputs of the round's shapes and compiled by XLA:TPU
(libtpu), whose ``memory_analysis()`` gives the exact bytes per chip. Against the chip's HBM each policy gets a
verdict and, when it does not fit, the memory plan's computed fixes (`mrl_jax.trainer.memory.compile_plan`).

On a TPU topology ``model.attention: auto`` is the Pallas splash kernel (`mrl_jax.models.splash`) for the
update's attention (the prompt-once-per-group layout and causal rows) and the sampler's prefill, and the Pallas
paged attention kernel for the sampler's decode steps (`mrl_jax.models.slot_cache`: layers without a sliding
window whose head dim is a multiple of 128; ours for the rest). The report names each policy's attention.

    report = plan_for_topology(cfg, "v5e-8")
    print(report)          # per policy and chip: params, optimizer, reference, update / sampler peak, HBM, verdict
    report.fits            # False: ``report.memory.misfits`` holds the fixes, one line per policy
"""
from __future__ import annotations

import dataclasses

from mrl_jax.configs import ConfigError
from mrl_jax.models import resolve_attention
from mrl_jax.mwra import tpu
from mrl_jax.mwra.memory_plan import device_use
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.memory import MemoryPlan, compile_plan
from mrl_jax.trainer.run import Run


@dataclasses.dataclass(frozen=True)
class TopologyPlan:
    """The plan of a run on a TPU topology: the topology, the MWRA plan, the compiled memory, and per policy its
    attention path."""

    topology: tpu.Topology
    hbm_per_device: int
    plan: object              # mwra.Plan
    memory: MemoryPlan
    attention: tuple          # per policy: "splash" | "dense" | "blockwise" | "auto"

    @property
    def fits(self) -> bool:
        return not self.memory.misfits

    def _per_device(self) -> dict[int, int]:
        return device_use([p.device_ids for p in self.plan.policies], self.memory.figures)

    def __str__(self) -> str:
        t = self.topology
        lines = [f"TPU plan on {t.name} ({t.topology}: {t.chips} chips, {len(t.devices())} devices, "
                 f"{size(self.hbm_per_device)} HBM per device; compiled by XLA:TPU on this machine, nothing allocated)",
                 str(self.plan), "per policy, per device of its mesh:"]
        for p, f, att, secs in zip(self.plan.policies, self.memory.figures, self.attention,
                                   self.memory.compile_seconds):
            verdict = "fits" if f.total <= self.hbm_per_device else "DOES NOT FIT"
            smp = "-" if f.sampler is None else _peak(f.sampler) + ("" if f.slots is None else f" at S = {f.slots} slots")
            lines.append(f"  {f.name} on devices {list(p.device_ids)}: params {size(f.params)} + optimizer "
                         f"{size(f.optimizer)} + reference {size(f.reference)}; update peak {_peak(f.update)}; "
                         f"sampler peak {smp}; total {size(f.total)} of {size(self.hbm_per_device)}: {verdict}")
            kernels = (f"{f.update.kernels} in the update, {0 if f.sampler is None else f.sampler.kernels} in the "
                       "sampler")
            lines.append(f"    attention: {_attention_line(att)} (Pallas kernel calls compiled: {kernels}); "
                         "compiled in " + ", ".join(f"{k} {v:.1f} s" for k, v in secs.items()))
        use = self._per_device()
        worst = max(use, key=use.get)
        lines.append(f"most loaded device: {worst} with {size(use[worst])} of {size(self.hbm_per_device)}")
        lines.append("verdict: fits" if self.fits else "verdict: does not fit\n" + "\n".join(self.memory.misfits))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"topology": self.topology.to_dict(), "hbm_per_device_bytes": self.hbm_per_device,
                "fits": self.fits, "plan": self.plan.to_dict(), "memory": self.memory.to_dict(),
                "attention": {f.name: a for f, a in zip(self.memory.figures, self.attention)},
                "compile_seconds": {f.name: s for f, s in zip(self.memory.figures, self.memory.compile_seconds)},
                "device_bytes": {str(k): v for k, v in self._per_device().items()}}


def size(b: float) -> str:
    """Bytes in binary units (HBM is sold in GiB): ``16 GiB``, ``251 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{int(b)} B"


def _peak(step) -> str:
    return f">= {size(step.peak)} (XLA:TPU refused it: over the HBM)" if step.exhausted else size(step.peak)


def _attention_line(impl: str) -> str:
    if impl == "splash":
        return ("splash (Pallas TPU kernel) in the update and the prefill; decode steps: the paged attention kernel "
                "(head dims of 128k, no sliding window), ours elsewhere")
    return f"ours ({impl}; model.attention is set) in the update, the prefill and decode"


def resolve_topology(name: str, key: str = "--topology") -> tpu.Topology:
    """`tpu.resolve` of ``name``, its devices laid out by libtpu (`Topology.devices`, cached); an unknown name, a
    layout libtpu refuses or a missing libtpu is a ``ConfigError`` naming ``key``."""
    try:
        topology = tpu.resolve(name)
        topology.devices()
    except tpu.TopologyError as e:
        raise ConfigError(f"{key}: {e}") from None
    return topology


def plan_for_topology(cfg: RunConfig, name: str, key: str = "--topology") -> TopologyPlan:
    """``cfg`` planned and compiled for TPU topology ``name`` (see module doc). ``ConfigError`` naming ``key`` for
    an unknown topology, a layout libtpu refuses or a missing libtpu."""
    topology = resolve_topology(name, key)
    devices = topology.devices()
    run = Run(cfg, devices=devices, abstract=True)
    limit = topology.hbm_per_device
    memory = compile_plan(run, limit, f"{topology.name} HBM")
    if memory is None:   # XLA:TPU always reports; kept explicit
        raise ConfigError(f"{key}: the TPU compiler reported no memory analysis for {topology.name}")
    attention = tuple(resolve_attention(p.spec.model.attention, "tpu") for p in run.policies)
    return TopologyPlan(topology=topology, hbm_per_device=limit, plan=run.placement.plan, memory=memory,
                        attention=attention)


__all__ = ["TopologyPlan", "plan_for_topology", "resolve_topology"]
