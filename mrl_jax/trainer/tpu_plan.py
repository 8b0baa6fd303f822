"""``mrl plan``: a run compiled for a TPU topology from this machine, before any TPU is had.

The run's pieces are built abstractly (`trainer.parts.build_parts(abstract=True)`: tiny models from their
shapes, checkpoints from their ``config.json``, no weights), MWRA plans them onto the topology's devices
(`mrl_jax.mwra.tpu`), and every policy's update and sampler are lowered on abstract inputs of the round's shapes
and compiled by XLA:TPU (libtpu), whose ``memory_analysis()`` gives the exact bytes per chip. Against the chip's
HBM each policy gets a verdict and, when it does not fit, the memory plan's computed fixes
(`mrl_jax.trainer.memory.compile_plan`). The same compile prices every program (`mrl_jax.mwra.cost_model`): each
policy's update, prefill and decode step, the round's time at the configured completion length and at a given
mean, MFU and the idle fraction per sub-mesh (`mrl_jax.trainer.time_plan`) -- XLA:TPU's estimate, never a measurement.

On a TPU topology ``model.attention: auto`` is the Pallas splash kernel (`mrl_jax.models.splash`) for the
update's attention (the prompt-once-per-group layout and causal rows) and the sampler's prefill, and the Pallas
paged attention kernel for the sampler's decode steps (`mrl_jax.models.slot_cache`: layers without a sliding
window whose head dim is a multiple of 128; ours for the rest). The report names each policy's attention.

    report = plan_for_topology(cfg, "v5e-8")
    print(report)          # per policy and chip: params, optimizer, reference, update / sampler peak, HBM, verdict
    report.fits            # False: ``report.memory.misfits`` holds the fixes, one line per policy
    report.time.seconds    # the round's estimated seconds (None where a program was refused as over the HBM)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import numpy as np
from flax import nnx

from mrl_jax.configs import ConfigError
from mrl_jax.models import resolve_attention
from mrl_jax.mwra import tpu
from mrl_jax.mwra.allocation import allocations_by_time
from mrl_jax.mwra.memory_plan import device_use, tree_bytes
from mrl_jax.trainer.config import RunConfig
from mrl_jax.mwra.cost_model import for_device
from mrl_jax.trainer.memory import MemoryPlan, compile_plan
from mrl_jax.trainer.parts import Parts, build_parts
from mrl_jax.trainer.time_plan import PolicyTime, RoundShape, RoundTime, round_time, scaled_round_seconds


@dataclasses.dataclass(frozen=True)
class TopologyPlan:
    """The plan of a run on a TPU topology: the topology, the MWRA plan, the compiled memory, and per policy its
    attention path."""

    topology: tpu.Topology
    hbm_per_device: int
    plan: object              # mwra.Plan
    memory: MemoryPlan
    attention: tuple          # per policy: "splash" | "dense" | "blockwise" | "auto"
    time: Optional[RoundTime] = None   # XLA:TPU's estimate; None where a program was refused (over the HBM)
    allocations: tuple = ()   # mwra.Allocation by estimated round time, the chosen first (none searched: ())

    @property
    def fits(self) -> bool:
        return not self.memory.misfits

    def _per_device(self) -> dict[int, int]:
        return device_use([p.device_ids for p in self.plan.policies], self.memory.figures)

    def __str__(self) -> str:
        t = self.topology
        lines = [f"TPU plan on {t.name} ({t.topology}: {t.chips} chips, {len(t.devices())} devices, "
                 f"{size(self.hbm_per_device)} HBM per device; "
                 + ("compiled by XLA:TPU on this machine" if any(f.update is not None for f in self.memory.figures)
                    else "the states checked from their shapes, nothing compiled") + ", nothing allocated)",
                 str(self.plan), "per policy, per device of its mesh:"]
        for p, f, att, secs in zip(self.plan.policies, self.memory.figures, self.attention,
                                   self.memory.compile_seconds):
            verdict = "fits" if f.total <= self.hbm_per_device else "DOES NOT FIT"
            if f.update is None:   # the state alone does not fit: nothing compiled
                lines.append(f"  {f.name} on devices {list(p.device_ids)}: params {size(f.params)} + optimizer "
                             f"{size(f.optimizer)} + reference {size(f.reference)} = {size(f.state)} of "
                             f"{size(self.hbm_per_device)}: {verdict} (state alone; no step compiled)")
                continue
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
        lines.extend(self.time.lines() if self.time is not None else
                     ["time per round: not estimated (a program over the HBM was not compiled)"])
        if self.allocations:
            best, *rest = self.allocations
            lines.append(f"sub-meshes by estimated round time: {_sizes(best.sizes)} (compiled above)"
                         + ("; next best, scaled from the first compile: " + ", ".join(
                             f"{_sizes(a.sizes)} {a.round_seconds:.3g} s" for a in rest[:4]) if rest else ""))
        lines.append("verdict: fits" if self.fits else "verdict: does not fit\n" + "\n".join(self.memory.misfits))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"topology": self.topology.to_dict(), "hbm_per_device_bytes": self.hbm_per_device,
                "fits": self.fits, "plan": self.plan.to_dict(), "memory": self.memory.to_dict(),
                "attention": {f.name: a for f, a in zip(self.memory.figures, self.attention)},
                "compile_seconds": {f.name: s for f, s in zip(self.memory.figures, self.memory.compile_seconds)},
                "device_bytes": {str(k): v for k, v in self._per_device().items()},
                "time": None if self.time is None else self.time.to_dict(),
                "allocations_by_time": [{"devices": dict(zip([f.name for f in self.memory.figures], a.sizes)),
                                         "round_seconds": a.round_seconds} for a in self.allocations]}


def _sizes(sizes) -> str:
    return "devices " + " + ".join(str(n) for n in sizes)


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


def plan_for_topology(cfg: RunConfig, name: str, key: str = "--topology",
                      mean_completion: Optional[float] = None) -> TopologyPlan:
    """``cfg`` planned and compiled for TPU topology ``name`` (see module doc); the round's time also at completions
    of ``mean_completion`` tokens on average. ``ConfigError`` naming ``key`` for an unknown topology, a layout
    libtpu refuses or a missing libtpu."""
    topology = resolve_topology(name, key)
    devices = topology.devices()
    limit = topology.hbm_per_device
    parts, memory = _compiled(cfg, devices, limit, topology.name, key)
    time = _round_time(parts, memory, mean_completion)
    allocations = ()
    if time is not None and len(cfg.policies) > 1 and all(p.devices is None for p in cfg.policies):
        allocations = _by_time(time, memory, limit, len(devices), mean_completion)
        chosen = allocations[0].sizes if allocations else None
        if chosen is not None and chosen != tuple(p.shape.devices for p in time.policies):
            sized = dataclasses.replace(cfg, policies=list(dataclasses.replace(p, devices=n)
                                                            for p, n in zip(cfg.policies, chosen)))
            parts, memory = _compiled(sized, devices, limit, topology.name, key)
            time = _round_time(parts, memory, mean_completion)
    attention = tuple(resolve_attention(p.spec.model.attention, "tpu") for p in parts.policies)
    return TopologyPlan(topology=topology, hbm_per_device=limit, plan=parts.placement.plan, memory=memory,
                        attention=attention, time=time, allocations=allocations)


def _compiled(cfg: RunConfig, devices, limit: int, name: str, key: str) -> tuple:
    """(the run's abstract pieces on ``devices``, their compiled memory plan against ``limit`` bytes per device)."""
    parts = build_parts(cfg, devices=devices, abstract=True)
    memory = compile_plan(parts, limit, f"{name} HBM")
    if memory is None:   # XLA:TPU always reports; kept explicit
        raise ConfigError(f"{key}: the TPU compiler reported no memory analysis for {name}")
    return parts, memory


def _by_time(time: RoundTime, memory: MemoryPlan, limit: int, total: int, mean: Optional[float]) -> tuple:
    """`mwra.allocations_by_time` with each policy's round scaled from its compiled sub-mesh
    (`time_plan.scaled_round_seconds`) and its memory as the compiled figure x n0 / n (FSDP), a hard limit."""
    def seconds(i: int, n: int) -> Optional[float]:
        p, f = time.policies[i], memory.figures[i]
        if f.total * p.shape.devices / n > limit:
            return None
        return scaled_round_seconds(p, n, mean)
    return tuple(allocations_by_time(seconds, len(time.policies), total))


def round_shape(parts: Parts, i: int, slots: Optional[int]) -> RoundShape:
    """Policy i's `RoundShape` from the run's built pieces and the slots S its sampler was compiled at."""
    pol, mesh = parts.policies[i], parts.placement.meshes[i]
    params = parts.policy_template(i).params
    config = nnx.merge(pol.graphdef, params).config
    rows = parts.cfg.prompts_per_round * pol.num_generations
    mb = pol.spec.optimizer.micro_batch_size
    total = int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))
    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * jax.numpy.dtype(config.dtype).itemsize
    return RoundShape(name=pol.name, devices=int(mesh.devices.size), rows=rows, prompt_width=parts.widths[i],
                      completion_length=pol.max_completion_length, slots=slots or rows,
                      micro_batches=math.ceil(rows / mb) if mb else 1, iterations=pol.spec.grpo.num_iterations,
                      reference_forward=pol.spec.grpo.beta > 0, matmul_params=total - lookup,
                      layers=config.num_layers, heads=config.num_heads, head_dim=config.head_dim,
                      kv_bytes_per_token=int(kv), weight_bytes=tree_bytes(params))


def _round_time(parts: Parts, memory: MemoryPlan, mean: Optional[float]) -> Optional[RoundTime]:
    """The round's `RoundTime` from the compiled figures' estimates; None where one is missing."""
    out = []
    for i, f in enumerate(memory.figures):
        if f.update is None or f.update.time is None or f.sampler is None or f.sampler.time is None:
            return None
        chip = for_device(parts.placement.meshes[i].devices.flat[0])
        out.append(PolicyTime(shape=round_shape(parts, i, f.slots), chip=chip, update=f.update.time,
                              sampler=f.sampler.time))
    return round_time(out, [p.device_ids for p in parts.placement.plan.policies], mean)


__all__ = ["TopologyPlan", "plan_for_topology", "resolve_topology"]
