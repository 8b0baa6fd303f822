"""Sub-mesh allocation: which policy gets which devices (pure logic + `jax.sharding.Mesh` construction).

Cost model. A policy's cost is ``parameters x tokens per round`` (the FLOPs of its rollout + update scale
with it). With ``D >= N`` devices for ``N`` policies each policy gets a *disjoint*, contiguous slice of the
devices whose size is proportional to its cost, rounded by the largest-remainder (Hamilton) method with a
floor of one device each. Devices are ordered by ``(process_index, id)`` first, so a slice stays inside one
host whenever its size allows.

Time-sharing (``D < N``). Two modes, chosen by ``time_share``:

* ``"pack"`` (default): every policy gets a **1-device mesh**; policies are packed onto devices greedily by
  cost (largest cost first onto the least-loaded device, ties to the lower device index). With equal costs
  this is round-robin: policy ``i`` -> device ``i % D``. Policies on the same device run one after the other
  (the device's stream serialises them); policies on different devices still run concurrently.
* ``"full"``: every policy gets the **whole** mesh of ``D`` devices; all policies time-share all devices.
  Use it when a policy's parameters + optimizer state do not fit on one device.

Memory estimate (per device, bytes), used by `Plan` and by the ``memory_bytes`` check:
``(params + grads + AdamW mu + AdamW nu) = 16 B/param in fp32``, plus ``activation_bytes`` when given (none
otherwise: the state alone), all divided by the mesh size (FSDP shards parameters/optimizer state and the
batch over the data axis). Policies that time-share a device add up. ``mrl train`` does not use this
estimate: it checks the compiled steps' own figures (`mrl_jax.mwra.memory_plan`, `mrl_jax.trainer.memory`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

BYTES_PER_PARAM_TRAINING = 16  # fp32 params + fp32 grads + AdamW mu + nu
TIME_SHARE_MODES = ("pack", "full")
_GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class PolicyPlan:
    """One policy's share: devices, mesh shape and expected memory."""

    index: int
    name: str
    cost: float
    device_ids: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    param_count: int | None
    memory_bytes_per_device: int | None  # this policy alone, per device of its mesh
    shares_with: tuple[str, ...]  # names of the policies that time-share (some of) these devices

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The allocation of devices to policies. ``str(plan)`` is a table; ``plan.to_dict()`` goes to summary.json."""

    policies: tuple[PolicyPlan, ...]
    axis_names: tuple[str, ...]
    mode: str  # "disjoint" | "time_share:pack" | "time_share:full"
    num_devices: int
    platform: str
    memory_limit_bytes: int | None
    device_memory_bytes: dict[int, int] | None  # device id -> all policies resident on it
    _devices: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def meshes(self) -> list:
        """One `jax.sharding.Mesh` per policy, in policy order (devices first on axis ``axis_names[0]``)."""
        from jax.sharding import Mesh

        by_id = {d.id: d for d in self._devices}
        out = []
        for p in self.policies:
            devs = np.array([by_id[i] for i in p.device_ids], dtype=object).reshape(p.mesh_shape)
            out.append(Mesh(devs, self.axis_names))
        return out

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "num_devices": self.num_devices,
            "platform": self.platform,
            "axis_names": list(self.axis_names),
            "memory_limit_bytes": self.memory_limit_bytes,
            "device_memory_bytes": (
                None if self.device_memory_bytes is None
                else {str(k): v for k, v in self.device_memory_bytes.items()}
            ),
            "policies": [
                {
                    "name": p.name,
                    "cost": p.cost,
                    "cost_share": p.cost / sum(q.cost for q in self.policies),
                    "device_ids": list(p.device_ids),
                    "mesh_shape": list(p.mesh_shape),
                    "param_count": p.param_count,
                    "memory_bytes_per_device": p.memory_bytes_per_device,
                    "shares_with": list(p.shares_with),
                }
                for p in self.policies
            ],
        }

    def __str__(self) -> str:
        total = sum(p.cost for p in self.policies)
        head = ("policy", "cost share", "devices", "mesh", "params", "mem/device", "time-shares with")
        rows = []
        for p in self.policies:
            rows.append((
                p.name,
                f"{p.cost / total:.1%}",
                _ids(p.device_ids),
                "x".join(map(str, p.mesh_shape)) + f" ({','.join(self.axis_names)})",
                "-" if p.param_count is None else _human(p.param_count),
                "-" if p.memory_bytes_per_device is None else _bytes(p.memory_bytes_per_device),
                ", ".join(p.shares_with) or "-",
            ))
        widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        lim = "" if self.memory_limit_bytes is None else f", limit {_bytes(self.memory_limit_bytes)}/device"
        out = [f"MWRA plan: {len(self.policies)} policies on {self.num_devices} {self.platform} device(s), "
               f"mode={self.mode}{lim}", line(head), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        return "\n".join(out)


def _ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _bytes(b: float) -> str:
    for div, suf in ((_GIB, "GiB"), (float(1 << 20), "MiB"), (1024.0, "KiB")):
        if b >= div:
            return f"{b / div:.2f} {suf}"
    return f"{int(b)} B"


def _human(n: int) -> str:
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suf}"
    return str(n)


def _validate_costs(costs: Sequence[float]) -> list[float]:
    try:
        costs = [float(c) for c in costs]
    except (TypeError, ValueError) as e:
        raise ValueError(f"costs must be a sequence of numbers (parameters x tokens per round), got {costs!r}") from e
    if not costs:
        raise ValueError("costs is empty: pass one cost (parameters x tokens per round) per policy")
    for i, c in enumerate(costs):
        if not math.isfinite(c) or c <= 0:
            raise ValueError(
                f"cost of policy {i} is {c!r}: every cost must be a finite number > 0 "
                "(use parameters x tokens per round, e.g. 0.5e9 * 4096)")
    return costs


class PlanError(ValueError):
    """A plan the devices cannot hold; ``policy``: the index of the policy it names (None: the request as a
    whole), so a caller maps it to its own config key without reading the message."""

    def __init__(self, message: str, *, policy: Optional[int] = None):
        super().__init__(message)
        self.policy = policy


def proportional_split(costs: Sequence[float], num_devices: int) -> list[int]:
    """Device counts proportional to ``costs`` summing to ``num_devices`` (>= 1 each; needs devices >= policies).

    Largest-remainder rounding of the quotas ``D * c_i / sum(c)`` with a floor of 1; when the floor
    over-allocates, devices are taken back from the policies furthest above their quota. Deterministic:
    ties go to the lower policy index.
    """
    costs = _validate_costs(costs)
    n = len(costs)
    if num_devices < n:
        raise ValueError(f"proportional_split needs at least one device per policy ({num_devices} < {n})")
    total = sum(costs)
    quota = [num_devices * c / total for c in costs]
    alloc = [max(1, int(math.floor(q + 1e-9))) for q in quota]
    while sum(alloc) < num_devices:  # give to the largest remainder
        i = max(range(n), key=lambda k: (quota[k] - alloc[k], -k))
        alloc[i] += 1
    while sum(alloc) > num_devices:  # take from the one furthest above quota (never below 1)
        cand = [k for k in range(n) if alloc[k] > 1]
        i = min(cand, key=lambda k: (quota[k] - alloc[k], -k))
        alloc[i] -= 1
    return alloc


def _sort_devices(devices: Sequence[Any]) -> list[Any]:
    return sorted(devices, key=lambda d: (getattr(d, "process_index", 0), d.id))


def estimate_memory_bytes(param_count: int, num_devices: int = 1, activation_bytes: int | None = None) -> int:
    """Per-device training memory of one policy sharded (FSDP) over ``num_devices`` (see module doc)."""
    state = BYTES_PER_PARAM_TRAINING * int(param_count)
    act = 0 if activation_bytes is None else int(activation_bytes)
    return int(math.ceil((state + act) / max(1, num_devices)))


def plan(
    costs: Sequence[float],
    devices: Sequence[Any] | None = None,
    param_counts: Sequence[int] | None = None,
    names: Sequence[str] | None = None,
    *,
    axis_names: Sequence[str] = ("data",),
    memory_bytes: int | None = None,
    activation_bytes: Sequence[int] | None = None,
    time_share: str = "pack",
    assign: Sequence[Any] | None = None,
) -> Plan:
    """Decide which devices each policy gets (no device is touched; fake device objects with ``.id`` work).

    Args:
      costs: one positive cost per policy (parameters x tokens per round); only ratios matter.
      devices: defaults to ``jax.devices()`` (global over all processes after `initialize_distributed`).
      param_counts: per-policy parameter counts, for the memory estimate (required with ``memory_bytes``).
      names: per-policy names for the table (default ``policy0, policy1, ...``).
      axis_names: mesh axis names; all devices go on the first axis, the others have size 1.
      memory_bytes: per-device memory limit; when given, a plan whose estimate exceeds it raises.
      activation_bytes: per-policy activation bytes (whole batch) added to the state estimate.
      time_share: "pack" or "full" -- what to do when devices < policies (see module doc).
      assign: per-policy overrides: ``None`` (sized by cost), an int (that many devices) or a sequence of
        device ids (exactly those). Id lists are taken first; counts and cost-sized policies share the
        remaining devices in order (the cost-sized ones proportionally to cost, at least one each).
    Raises:
      ValueError naming the fix for: empty/non-positive/non-finite costs, no devices, mismatched lengths,
      an unknown ``time_share``, or a policy that cannot fit ``memory_bytes``.
    """
    costs = _validate_costs(costs)
    n = len(costs)
    if devices is None:
        import jax

        devices = jax.devices()
    devices = _sort_devices(list(devices))
    axis_names = tuple(axis_names)
    names = [f"policy{i}" for i in range(n)] if names is None else [str(s) for s in names]
    _check_arguments(n, devices, axis_names, time_share, names, param_counts, activation_bytes, memory_bytes)

    ids = [d.id for d in devices]
    mode, groups = _groups(costs, ids, names, time_share, assign, getattr(devices[0], "platform", None) == "tpu")
    mem = dev_mem = None
    if param_counts is not None:
        mem = [estimate_memory_bytes(param_counts[i], len(groups[i]),
                                     None if activation_bytes is None else activation_bytes[i]) for i in range(n)]
        dev_mem = {i: 0 for i in ids}
        for k, g in enumerate(groups):
            for i in g:
                dev_mem[i] += mem[k]

    policies = tuple(PolicyPlan(
        index=k, name=names[k], cost=costs[k], device_ids=tuple(g),
        mesh_shape=(len(g),) + (1,) * (len(axis_names) - 1),
        param_count=None if param_counts is None else int(param_counts[k]),
        memory_bytes_per_device=None if mem is None else mem[k],
        shares_with=tuple(names[m] for m in range(n) if m != k and set(groups[m]) & set(g)))
        for k, g in enumerate(groups))
    if memory_bytes is not None:
        _check_fit(policies, dev_mem, memory_bytes, activation_bytes, mode)
    return Plan(policies=policies, axis_names=axis_names, mode=mode, num_devices=len(devices),
                platform=getattr(devices[0], "platform", "unknown"),
                memory_limit_bytes=None if memory_bytes is None else int(memory_bytes),
                device_memory_bytes=dev_mem, _devices=tuple(devices))


def _check_arguments(n: int, devices: list, axis_names: tuple, time_share: str, names: list, param_counts,
                     activation_bytes, memory_bytes) -> None:
    """`plan`'s argument checks: ValueError naming the argument and the fix."""
    if not devices:
        raise ValueError("no devices to allocate: pass devices=jax.devices() (or check JAX_PLATFORMS / "
                         "that the accelerator is visible)")
    if len({d.id for d in devices}) != len(devices):
        raise ValueError("devices contains duplicates: pass each device once")
    if time_share not in TIME_SHARE_MODES:
        raise ValueError(f"time_share={time_share!r}: use one of {TIME_SHARE_MODES}")
    if not axis_names or len(set(axis_names)) != len(axis_names):
        raise ValueError(f"axis_names={axis_names!r}: give at least one, all distinct (e.g. ('data',))")
    for label, seq in (("names", names), ("param_counts", param_counts), ("activation_bytes", activation_bytes)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{label} has {len(seq)} entries for {n} costs: give one per policy")
    if param_counts is not None:
        for i, pc in enumerate(param_counts):
            if int(pc) <= 0:
                raise ValueError(f"param_counts[{i}]={pc}: parameter counts must be positive integers")
    if memory_bytes is not None:
        if not memory_bytes or memory_bytes <= 0:
            raise ValueError(f"memory_bytes={memory_bytes!r}: give the per-device memory in bytes (> 0)")
        if param_counts is None:
            raise ValueError("memory_bytes needs param_counts (one per policy) to estimate each policy's memory")


def _groups(costs: list, ids: list, names: list, time_share: str, assign, tpu: bool) -> tuple[str, list]:
    """(mode, per-policy device id lists): the assigned groups, disjoint slices sized by cost, or time sharing
    (every policy on all devices, or each on the least loaded one, costliest first) when devices < policies."""
    n, D = len(costs), len(ids)
    if assign is not None and any(a is not None for a in assign):
        if len(assign) != n:
            raise ValueError(f"assign has {len(assign)} entries for {n} costs: give one per policy (None = by cost)")
        return "disjoint", _assigned_groups(assign, ids, costs, names, tpu)
    if D >= n:
        sizes = proportional_split(costs, D)
        sizes = tpu_mesh_sizes(sizes, costs, D) if tpu else sizes
        starts = [sum(sizes[:k]) for k in range(n)]
        return "disjoint", [ids[a:a + s] for a, s in zip(starts, sizes)]
    if time_share == "full":
        return "time_share:full", [list(ids) for _ in range(n)]
    load, groups = [0.0] * D, [None] * n
    for i in sorted(range(n), key=lambda k: (-costs[k], k)):
        j = min(range(D), key=lambda k: (load[k], k))
        load[j] += costs[i]
        groups[i] = [ids[j]]
    return "time_share:pack", groups


def _check_fit(policies: tuple, dev_mem: dict, memory_bytes: int, activation_bytes, mode: str) -> None:
    """PlanError (naming the worst policy and the fixes) when a device's estimate exceeds ``memory_bytes``."""
    for dev_id, used in dev_mem.items():
        if used <= memory_bytes:
            continue
        resident = [p for p in policies if dev_id in p.device_ids]
        worst = max(resident, key=lambda p: p.memory_bytes_per_device)
        need = estimate_memory_bytes(worst.param_count, 1,
                                     None if activation_bytes is None else activation_bytes[worst.index])
        min_devs = int(math.ceil(need / memory_bytes))
        head = (f"policies {[p.name for p in resident]} need ~{_bytes(used)} on device {dev_id} but "
                f"memory_bytes={_bytes(memory_bytes)}. ")
        if len(resident) > 1 and worst.memory_bytes_per_device <= memory_bytes:
            why = "Each fits alone but they do not fit together: "
        else:
            why = (f"'{worst.name}' ({_human(worst.param_count)} params, {BYTES_PER_PARAM_TRAINING} B/param "
                   f"+ activations) needs >= {min_devs} device(s) of this size: ")
        fixes = ["add devices", "raise its cost so it gets more devices"]
        if mode == "time_share:pack":
            fixes.insert(0, "use time_share='full' so every policy is sharded over all devices")
        fixes.append("or shrink the model / micro-batch (activation_bytes)")
        raise PlanError(head + why + ", ".join(fixes) + ".", policy=worst.index)


def tpu_mesh_sizes(sizes: Sequence[int], costs: Sequence[float], total: int) -> list[int]:
    """``sizes`` made divisors of ``total`` (the slice's device count): XLA:TPU lowers a collective over a group
    of devices only when the group size divides the devices it compiles for (libtpu's RET_CHECK
    ``total_device_count % num_participants_per_group == 0``, seen for 6 of 8 v5e chips). Each size is cut to
    the largest divisor at or below it; the devices this frees go, one step up to the next divisor at a time, to
    the policy with the most cost per device that the rest still covers; any left stay idle."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    out = [max(d for d in divisors if d <= max(s, 1)) for s in sizes]
    left = sum(sizes) - sum(out)
    while True:
        steps = {k: min(d for d in divisors if d > s) - s for k, s in enumerate(out) if s < total}
        grow = [k for k, step in steps.items() if step <= left]
        if not grow:
            return out
        k = max(grow, key=lambda j: (costs[j] / out[j], -j))
        out[k], left = out[k] + steps[k], left - steps[k]


class Allocation(NamedTuple):
    """Devices per policy (disjoint sub-meshes, each a divisor of the slice) and the round's seconds there."""

    sizes: tuple
    round_seconds: float


def allocations_by_time(seconds: Callable[[int, int], Optional[float]], policies: int, total: int) -> list:
    """Every allocation of disjoint sub-meshes whose sizes divide ``total`` (and sum to at most it), by the
    synchronous round's time ascending: the slowest policy's ``seconds(policy, size)`` (None: does not fit at that
    size, so no allocation gives it that size). Ties go to the allocation using fewer devices, then the earlier
    sizes in order."""
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    found = []
    for sizes in itertools.product(divisors, repeat=policies):
        if sum(sizes) > total:
            continue
        times = [seconds(i, n) for i, n in enumerate(sizes)]
        if all(t is not None for t in times):
            found.append(Allocation(sizes=tuple(sizes), round_seconds=max(times)))
    return sorted(found, key=lambda a: (a.round_seconds, sum(a.sizes), a.sizes))


def _not_a_divisor_on_tpu(k: int, size: int, total: int, names) -> PlanError:
    fits = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
    return PlanError(f"policy {names[k]!r}: {size} devices on a TPU slice of {total}: XLA:TPU lowers collectives "
                     f"only over groups whose size divides the slice's device count; give it one of {fits}", policy=k)


def _assigned_groups(assign, ids, costs, names, tpu: bool = False) -> list[list[int]]:
    """Device ids per policy under explicit overrides (see `plan`'s ``assign``); errors name the policy. ``tpu``:
    every mesh size divides the device count (given ones are refused, cost-sized ones adjusted by
    `tpu_mesh_sizes`)."""
    n = len(assign)
    groups: list = [None] * n
    claimed: dict[int, str] = {}
    known = set(ids)
    for k, a in enumerate(assign):
        if a is None or isinstance(a, (int, np.integer)):
            continue
        want = [int(i) for i in a]
        if not want:
            raise PlanError(f"policy {names[k]!r}: empty device id list", policy=k)
        for i in want:
            if i not in known:
                raise PlanError(f"policy {names[k]!r}: device id {i} does not exist (devices: {_ids(ids)})", policy=k)
            if i in claimed:
                raise PlanError(f"policy {names[k]!r}: device {i} is also given to policy {claimed[i]!r}; "
                                "sub-meshes must not overlap", policy=k)
            claimed[i] = names[k]
        groups[k] = want
    free = [i for i in ids if i not in claimed]
    counted = {k: int(a) for k, a in enumerate(assign) if isinstance(a, (int, np.integer))}
    auto = [k for k in range(n) if assign[k] is None]
    for k, c in counted.items():
        if c < 1:
            raise PlanError(f"policy {names[k]!r}: device count {c} must be >= 1", policy=k)
    for k, g in enumerate(groups):
        size = counted.get(k, 0 if g is None else len(g))
        if tpu and size and len(ids) % size:
            raise _not_a_divisor_on_tpu(k, size, len(ids), names)
    need = sum(counted.values()) + len(auto)
    if need > len(free):
        raise PlanError(f"the device overrides need {sum(counted.values())} device(s) by count plus one per "
                         f"cost-sized policy ({len(auto)}) but only {len(free)} of {len(ids)} remain after the id "
                         "lists: lower the counts or add devices")
    start = 0
    for k in range(n):
        if k in counted:
            groups[k] = free[start:start + counted[k]]
            start += counted[k]
    rest = free[start:]
    if auto:
        sizes = proportional_split([costs[k] for k in auto], len(rest))
        sizes = tpu_mesh_sizes(sizes, [costs[k] for k in auto], len(ids)) if tpu else sizes
        for k, s in zip(auto, sizes):
            groups[k], rest = rest[:s], rest[s:]
    return groups


def allocate(
    costs: Sequence[float],
    devices: Sequence[Any] | None = None,
    *,
    axis_names: Sequence[str] = ("data",),
    memory_bytes: int | None = None,
    param_counts: Sequence[int] | None = None,
    activation_bytes: Sequence[int] | None = None,
    time_share: str = "pack",
) -> list:
    """One `jax.sharding.Mesh` per policy over disjoint device slices sized by cost (see `plan` for arguments).

    >>> a, b = allocate([1.0, 3.0], jax.devices())   # on 8 devices: a has 2 devices, b has 6
    """
    return plan(costs, devices, param_counts, axis_names=axis_names, memory_bytes=memory_bytes,
                activation_bytes=activation_bytes, time_share=time_share).meshes()
