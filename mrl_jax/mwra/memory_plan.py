"""Memory planned from the compiled programs: XLA's ``memory_analysis()`` of a policy's jitted steps.

A step lowered on abstract inputs (``jax.ShapeDtypeStruct`` with shardings; nothing is allocated) and compiled
reports its per-device bytes: arguments, outputs, temporaries and the outputs aliased to donated arguments
(`step_memory`). A policy's per-device need (`PolicyMemory`) is its resident state (params, optimizer state,
reference params) plus the larger transient of its steps (update: batch, SEE view, gradients, activations;
sampler: prompts, KV cache, logits), both from those figures. Policies that time-share a device keep their
states there together and run their steps one after another (`device_use`).

    mem = step_memory(jax.jit(update, donate_argnums=(0, 1)), params, opt_state, batch, view, key)
    mem.temp, mem.peak        # bytes per device
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import re
from typing import Callable, NamedTuple, Optional, Sequence

import jax

from mrl_jax.mwra import cost_model

_GIB = float(1 << 30)   # GiB, the unit of mwra.memory_gb


class StepMemory(NamedTuple):
    """``compiled.memory_analysis()`` of one step, bytes per device; ``kernels``: the Pallas (Mosaic) TPU kernel
    calls in the compiled program (0 on other backends). XLA:TPU refuses to compile a program whose temporaries
    exceed the chip's HBM: then ``exhausted`` is set, ``temp`` is the figure its error names and ``args`` the
    arguments' bytes. ``time``: XLA:TPU's estimate of the program's time per device (`mwra.cost_model.StepTime`;
    None off TPU or when refused)."""

    args: int
    out: int
    temp: int
    alias: int
    kernels: int = 0
    exhausted: bool = False   # the compiler refused the program (more than the device holds): temp from its error
    time: Optional[object] = None   # mwra.cost_model.StepTime

    def figures(self) -> dict:
        """The bytes (and ``kernels``, ``exhausted``) as a JSON-ready dict; the time is reported apart."""
        return {k: v for k, v in self._asdict().items() if k != "time"}

    @property
    def peak(self) -> int:
        """Arguments + outputs + temporaries - outputs aliased to donated arguments."""
        return self.args + self.out + self.temp - self.alias


def step_memory(fn: Callable, *args) -> Optional[StepMemory]:
    """The compiled memory of jitted ``fn`` on ``args`` (arrays or ``ShapeDtypeStruct``s); None when the
    backend reports no analysis."""
    return compiled_memory(fn.lower(*args), args)[1]


def compiled_memory(lowered, args) -> tuple:
    """(the compiled program or None, its `StepMemory` or None) of ``lowered`` (``fn.lower(*args)``): None and an
    ``exhausted`` figure when XLA:TPU refuses it as over the HBM; a None figure where no analysis is reported."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        temp = exhausted_bytes(str(e), tree_bytes(args))
        if temp is None:
            raise
        return None, StepMemory(args=tree_bytes(args), out=0, temp=temp, alias=0, exhausted=True)
    mem = compiled.memory_analysis()
    if mem is None:
        return compiled, None
    device = _tpu_device(args)
    kernels, time = 0, None
    if device is not None:
        text = compiled.as_text()
        kernels = text.count('custom_call_target="tpu_custom_call"')
        chip = cost_model.for_device(device)
        time = None if chip is None else cost_model.estimate(text, chip)
    return compiled, StepMemory(args=int(mem.argument_size_in_bytes), out=int(mem.output_size_in_bytes),
                                temp=int(mem.temp_size_in_bytes), alias=int(mem.alias_size_in_bytes), kernels=kernels,
                                time=time)


_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED.*?temporaries \(([\d.]+)([KMGT]?)\)", re.S)
_EXHAUSTED_USED = re.compile(r"RESOURCE_EXHAUSTED.*?Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm", re.S)


def _bytes_of(number: str, unit: str) -> int:
    return int(float(number) * 1024 ** " KMGT".index(unit or " "))


def exhausted_bytes(message: str, args: int = 0) -> Optional[int]:
    """The temporaries' bytes in XLA:TPU's refusal of a program over the HBM; None for any other error. Two forms:
    "Ran out of memory on HBM ... HLO temporaries (35.88G)", and "CompileTimeHbmOom ... Used 15.77G of 15.75G hbm"
    (everything the program needs: less the ``args`` bytes, so that args + temporaries is that figure)."""
    m = _EXHAUSTED.search(message)
    if m is not None:
        return _bytes_of(m.group(1), m.group(2))
    m = _EXHAUSTED_USED.search(message)
    if m is not None:
        return max(_bytes_of(m.group(1), m.group(2)) - args, 0)
    return None


def _tpu_device(args):
    """A TPU device ``args`` are placed on, else None."""
    leaf = next((x for x in jax.tree.leaves(args) if getattr(x, "sharding", None) is not None), None)
    device = None if leaf is None else next(iter(leaf.sharding.device_set))
    return device if device is not None and device.platform == "tpu" else None


def tree_bytes(tree) -> int:
    """Bytes per device of a pytree of arrays / ``ShapeDtypeStruct``s: a sharded leaf counts its largest
    shard (``sharding.shard_shape``), an unsharded one its whole size."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = tuple(x.shape)
        sh = getattr(x, "sharding", None)
        if sh is not None and shape:
            shape = tuple(sh.shard_shape(shape))
        total += math.prod(shape) * x.dtype.itemsize
    return int(total)


@dataclasses.dataclass(frozen=True)
class PolicyMemory:
    """One policy's per-device bytes on its mesh: resident state and its steps' compiled figures (``update`` None:
    no step compiled, the state alone did not fit)."""

    name: str
    params: int
    optimizer: int
    reference: int
    update: Optional[StepMemory]
    sampler: Optional[StepMemory] = None
    slots: Optional[int] = None   # the sampler's decode slots S the figure was compiled at

    @property
    def state(self) -> int:
        """Resident between steps: params + optimizer state + reference params."""
        return self.params + self.optimizer + self.reference

    @property
    def transient(self) -> int:
        """What a step adds to the resident state at its peak (the larger of update and sampler; the update's
        arguments hold the whole state, reference included)."""
        upd = 0 if self.update is None else self.update.peak - self.params - self.optimizer - self.reference
        smp = 0 if self.sampler is None else self.sampler.peak - self.params
        return max(upd, smp, 0)

    @property
    def total(self) -> int:
        """This policy alone on a device of its mesh."""
        return self.state + self.transient

    def to_dict(self) -> dict:
        out = {"params_bytes": self.params, "optimizer_bytes": self.optimizer, "reference_bytes": self.reference,
               "update": None if self.update is None else self.update.figures(), "total_bytes": self.total}
        if self.sampler is not None:
            out["sampler"] = self.sampler.figures()
        if self.slots is not None:
            out["sampler_slots"] = self.slots
        return out

    def line(self) -> str:
        """``name: params X + optimizer X + reference X; update temporaries X (peak X); sampler ...; total X``."""
        s = f"{self.name}: params {gb(self.params)} + optimizer {gb(self.optimizer)} + reference {gb(self.reference)}"
        if self.update is None:
            return s + f"; total {gb(self.total)} per device, no step compiled"
        s += f"; update temporaries {gb(self.update.temp)} (step peak {gb(self.update.peak)})"
        if self.sampler is not None:
            at = "" if self.slots is None else f" at S = {self.slots} slots"
            s += f"; sampler{at} temporaries (KV cache included) {gb(self.sampler.temp)}"
        return s + f"; total {gb(self.total)} per device"


def gb(b: float) -> str:
    return f"{b / _GIB:.3g} GiB"


def device_use(groups: Sequence[Sequence[int]], figures: Sequence[PolicyMemory]) -> dict[int, int]:
    """Bytes per device id: the states of every policy on it plus the largest transient among them (steps on
    one device run one after another). ``groups[i]``: policy i's device ids."""
    use: dict[int, list] = {}
    for ids, f in zip(groups, figures):
        for d in ids:
            use.setdefault(d, []).append(f)
    return {d: sum(f.state for f in fs) + max(f.transient for f in fs) for d, fs in use.items()}


def over_limit(groups: Sequence[Sequence[int]], figures: Sequence[PolicyMemory], limit: int) -> list[int]:
    """Indices of the policies on a device whose `device_use` exceeds ``limit`` bytes."""
    use = device_use(groups, figures)
    return [i for i, ids in enumerate(groups) if any(use[d] > limit for d in ids)]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool], guess: Optional[int] = None) -> Optional[int]:
    """The largest ``c`` in ``candidates`` with ``fits(c)`` (``fits`` monotone: a smaller candidate needs no more
    memory); None when none fits. Bisection, or with ``guess`` (a predicted answer) first the candidates at and
    just above it: a right guess costs two calls, a wrong one bisects the side it rules out."""
    cands = sorted(set(int(c) for c in candidates))
    lo, hi, best = 0, len(cands) - 1, None
    if guess is not None and cands:
        g = min(max(bisect.bisect_right(cands, guess) - 1, 0), hi)
        if fits(cands[g]):
            best, lo = cands[g], g + 1
            if lo <= hi:
                if not fits(cands[lo]):
                    return best
                best, lo = cands[lo], lo + 1
        else:
            hi = g - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(cands[mid]):
            best, lo = cands[mid], mid + 1
        else:
            hi = mid - 1
    return best


def devices_needed(state: int, devices: int, transient: int, limit: int) -> Optional[int]:
    """The fewest devices of a data/FSDP mesh on which the state (``state`` bytes per device on ``devices``
    now, sharded evenly) plus ``transient`` fits ``limit``; None when the transient alone does not fit."""
    room = limit - transient
    if room <= 0:
        return None
    return max(1, math.ceil(state * devices / room))


__all__ = ["PolicyMemory", "StepMemory", "compiled_memory", "exhausted_bytes", "device_use", "devices_needed", "gb", "largest_fitting", "over_limit",
           "step_memory", "tree_bytes"]
