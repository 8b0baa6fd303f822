"""``mrl train``'s memory plan: each policy's update and sampler compiled ahead of time on its mesh.

At start (before any warm start or round) `plan_memory` lowers every policy's pinned update and sampler on
abstract inputs of the round's shapes -- P prompts of the widest train prompt (bucketed as the round
buckets it) x G completions of ``max_new_tokens``, the SEE view of its slots -- compiles them, and reads
XLA's ``memory_analysis()`` (`mrl_jax.mwra.memory_plan`). The sampler is the slot sampler
(`mrl_jax.sampler`: its round's one program) at ``sampling.slots`` when set,
else at every row when that fits, else at the largest S that does (the plan prints S; none fitting, while the
state and the update fit, is the misfit line naming ``sampling.slots`` and the figure). With the persistent
compilation cache on, the first round loads these programs instead of compiling them again.

Before any of that, the states (params, optimizer state, reference: abstract shapes, no compile) are checked
against the limit: where they alone do not fit, nothing is compiled and no sampler searched; the plan holds their
figures and one line per such policy with the fixes computed from shapes (`state_fix_line`: the devices the states
need, LoRA's state, the reference dropped).

When it runs: only where a per-device limit is known (``mwra.memory_gb``, else the bytes the devices report;
CPU reports none), so a CPU run without ``memory_gb`` compiles nothing extra. A plan that does not fit
raises ``ConfigError`` with one line per policy: the figure, the device memory and the fixes, each computed
from further compiles: the largest ``optimizer.micro_batch_size`` that fits (bisection over sizes), whether
``model.remat: full`` fits, how many devices the policy needs, whether LoRA (rank 16) fits.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from mrl_jax import mwra
from mrl_jax import sampler as sampler_lib
from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError
from mrl_jax.models import lora as lora_lib
from mrl_jax.models.factory import build_model
from mrl_jax.mwra.memory_plan import (PolicyMemory, compiled_memory, device_use, devices_needed, gb, largest_fitting,
                                      over_limit, step_memory, tree_bytes)
from mrl_jax.rows import Rows, own_rows
from mrl_jax.trainer.placement import device_memory_bytes, pad_rows, pin_update
from mrl_jax.trainer.config import LORA_DEFAULT_TARGETS
from mrl_jax.trainer.policy import PolicyState, add_lora, update_factory

# one INFO line before each compile (a real-shape plan compiles for minutes): `mrl plan` shows them on stderr
log = logging.getLogger("mrl_jax.plan")

LORA_RANK = 16   # the rank the LoRA fix is computed at


def abstract_rows(P: int, G: int, Tp: int, Tc: int) -> Rows:
    """The own ``Rows`` of P prompts of Tp tokens x G completions of Tc tokens, as ShapeDtypeStructs."""
    z = jnp.zeros
    n = P * G
    return jax.eval_shape(lambda: own_rows(z((P, Tp), jnp.int32), z((P, Tp), jnp.bool_), z((n, Tc), jnp.int32),
                                           z((n, Tc), jnp.float32), z((n, Tc), jnp.float32), z((n, Tc), jnp.float32),
                                           z((n,), jnp.float32), z((n,), jnp.bool_)))


def placed(tree, mesh):
    """``tree``'s ShapeDtypeStructs with the round's shardings on ``mesh`` (rows split where they divide)."""
    sh = mwra.row_shardings(tree, mesh, strict=False)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-policy compiled figures, the per-device limit they were checked against (None: not checked), one
    line per policy that does not fit (its figure and the computed fixes) and each compile's seconds
    (``compile_seconds[i]``: {program: s} of policy i)."""

    figures: tuple
    limit: Optional[int]
    source: str
    misfits: tuple = ()
    compile_seconds: tuple = ()

    def __str__(self) -> str:
        lim = "not checked" if self.limit is None else f"limit {gb(self.limit)} per device ({self.source})"
        return "\n".join([f"memory plan (XLA memory_analysis of the compiled steps), {lim}:"]
                         + ["  " + f.line() for f in self.figures])

    def to_dict(self) -> dict:
        return {"limit_bytes": self.limit, "source": self.source,
                "policies": {f.name: f.to_dict() for f in self.figures}, "misfits": list(self.misfits)}


def _key(mesh):
    k = jax.eval_shape(lambda: jax.random.key(0))
    return jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=NamedSharding(mesh, mwra.REPLICATED))


def _update_inputs(parts, pol, mesh, Tp: int):
    P, G, Tc = parts.cfg.prompts_per_round, pol.num_generations, pol.max_completion_length
    view = jax.eval_shape(lambda: see_lib.empty_view(P, pol.view_shape.slots, Tc, Tc, len(parts.policies),
                                                     consumer=pol.index))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, mwra.REPLICATED))
    return placed(abstract_rows(P, G, Tp, Tc), mesh), placed(view, mesh), _key(mesh), step


def _slot_memory(pol, mesh, params, P: int, Tp: int, S: int):
    """The slot sampler's figure at S slots: its round's one program (`sampler.round_program`: the prefill,
    each rung's decode steps and the moves between them) compiled on abstract inputs, with the Pallas kernel
    calls; None where the backend reports none."""
    from mrl_jax.mwra import row_sharding

    G, cfg, rows = pol.num_generations, pol.sampling, row_sharding(mesh)
    repl = NamedSharding(mesh, mwra.REPLICATED)
    ids, mask = (jax.ShapeDtypeStruct((P, Tp), dt, sharding=repl) for dt in (jnp.int32, jnp.bool_))
    rungs = sampler_lib.rungs(pol.graphdef, params, S, cfg.max_new_tokens, int(mesh.devices.size),
                              pol.spec.sampling.ladder, ragged=sampler_lib.ragged(cfg.eos_ids, S, P * G),
                              ladder=pol.spec.sampling.ladder_shape)
    admit = sampler_lib.admit_count(S) if S < P * G else 0   # a slot per row: no queue to refill from
    whole = sampler_lib.round_program(pol.graphdef, cfg, G, rungs, Tp, admit, rows)
    return compiled_memory(whole.lower(params, ids, mask, _key(mesh)), (params, ids, mask))[1]


def padded_prompts(parts, devices: int) -> int:
    """A train round's prompts (``parts.cfg``: a `Parts`' or a `Run`'s) padded to a multiple of the policy's data
    axis (``devices``): its sampler decodes that x G rows."""
    return pad_rows(parts.cfg.prompts_per_round, devices)


class SamplerMisfit(ConfigError):
    """No S fits beside the state: ``figure`` is the sampler's at the smallest S (``slots``)."""

    def __init__(self, message: str, figure, slots: int):
        super().__init__(message)
        self.figure, self.slots = figure, slots


def _sampler(parts, pol, mesh, params, Tp: int, room: Optional[int] = None):
    """(the sampler's figure, S): at ``sampling.slots`` when set, else at every row (P x G) when its transient fits
    in ``room`` bytes (None: unchecked), else at the largest S that does (over multiples of the data axis, starting
    where the peak's line through S = d and S = P x G meets the room); ConfigError naming the figure at the
    smallest S when none does (`SamplerMisfit`)."""
    d = int(mesh.devices.size)
    P = padded_prompts(parts, d)
    B = P * pol.num_generations
    at = {}

    def fig(s):
        if s not in at:
            log.info("%s: compiling the sampler at S = %d slots", pol.name, s)
            at[s] = _slot_memory(pol, mesh, params, P, Tp, s)
        return at[s]

    def fits(s):
        f = fig(s)
        return room is None or f is None or f.peak - tree_bytes(params) <= room

    asked = pol.spec.sampling.slots   # the config's S
    if asked is not None or fits(B):
        s = sampler_lib.slot_count(B, asked, d)
        return fig(s), s
    best = largest_fitting(range(d, B, d), fits, guess=_linear_guess(fig(d), fig(B), d, B, room + tree_bytes(params))
                           if fits(d) else None)
    if best is None:
        raise SamplerMisfit(f"config key 'policies.{pol.name}.sampling.slots': the sampler does not fit at any S "
                            f"(at S = {d}: {gb(fig(d).peak - tree_bytes(params))} beside the state, room "
                            f"{gb(room)} per device)", fig(d), d)
    return fig(best), best


def _linear_guess(small, large, s_small: int, s_large: int, budget: int) -> Optional[int]:
    """The S at which a peak linear in S (through the figures at ``s_small`` and ``s_large`` slots) meets
    ``budget`` bytes: where to start `largest_fitting` (the cache and the decode's activations grow with S)."""
    if small is None or large is None or large.peak <= small.peak:
        return None
    return int(s_small + (budget - small.peak) * (s_large - s_small) / (large.peak - small.peak))


def _figure(pol, state, update, inputs, sampler) -> Optional[PolicyMemory]:
    """``pol``'s figures with ``update`` (pinned) on ``state`` (placed ShapeDtypeStructs)."""
    upd = step_memory(update, state.params, state.opt_state, state.ref_params, *inputs)
    if upd is None:
        return None
    return PolicyMemory(name=pol.name, params=tree_bytes(state.params), optimizer=tree_bytes(state.opt_state),
                        reference=tree_bytes(state.ref_params), update=upd, sampler=sampler)


def plan_memory(parts, devices: Optional[Sequence] = None) -> Optional[MemoryPlan]:
    """The memory plan of a run's built pieces (``parts``: `trainer.parts.Parts`; see module doc); None where no
    limit is known. ``ConfigError`` when it does not fit, one line per policy that does not."""
    cfg, placement = parts.cfg, parts.placement
    if cfg.mwra.memory_gb:
        limit, source = int(cfg.mwra.memory_gb * (1 << 30)), "mwra.memory_gb"
    else:
        devs = devices or [d for m in placement.meshes for d in m.devices.flat]
        limit, source = device_memory_bytes(devs), "reported by the device"
    if not limit:
        return None
    plan = compile_plan(parts, limit, source)
    if plan is not None and plan.misfits:
        raise ConfigError("\n".join(plan.misfits))
    return plan


def compile_plan(parts, limit: int, source: str) -> Optional[MemoryPlan]:
    """Every policy of ``parts`` (`trainer.parts.Parts`) with its update and sampler compiled on its mesh
    (abstract inputs, prompts of its slot width) and checked against ``limit`` bytes per device; the fixes
    computed for each policy that does not fit. First the states alone (params, optimizer, reference: abstract
    shapes, nothing compiled): where they do not fit, the plan is their figures and `state_fix_line`s, no step
    compiled and no sampler searched. ``sampling.slots`` is named only where the state and the update fit and the
    sampler fits at no S. None where the backend reports no memory analysis."""
    template = [parts.policy_template(i) for i in range(len(parts.policies))]
    groups = [p.device_ids for p in parts.placement.plan.policies]
    states = [PolicyMemory(name=pol.name, params=tree_bytes(s.params), optimizer=tree_bytes(s.opt_state),
                           reference=tree_bytes(s.ref_params), update=None)
              for pol, s in zip(parts.policies, template)]
    crowded = over_limit(groups, states, limit)
    if crowded:
        return MemoryPlan(figures=tuple(states), limit=limit, source=source, compile_seconds=tuple({} for _ in states),
                          misfits=tuple(state_fix_line(parts, i, states, limit, source) for i in crowded))
    figures, ctx, seconds, no_slots = [], [], [], []
    for i, pol in enumerate(parts.policies):
        mesh, Tp = parts.placement.meshes[i], parts.widths[i]
        inputs = _update_inputs(parts, pol, mesh, Tp)
        state = template[i]
        t0 = time.perf_counter()
        try:
            sampler, slots = _sampler(parts, pol, mesh, state.params, Tp, limit - tree_bytes(state))
            no_slots.append(None)
        except SamplerMisfit as e:   # reported below: named only if the update fits
            sampler, slots = e.figure, e.slots
            no_slots.append(str(e))
        t1 = time.perf_counter()
        log.info("%s: compiling the update (%s)", pol.name, _micro_batch_text(pol.spec.optimizer.micro_batch_size))
        f = _figure(pol, state, pol.update, inputs, sampler)
        if f is None:
            return None
        seconds.append({"sampler": t1 - t0, "update": time.perf_counter() - t1})
        figures.append(dataclasses.replace(f, slots=slots))
        ctx.append((mesh, inputs, sampler))
    bad = over_limit(groups, figures, limit)
    stepped = over_limit(groups, [dataclasses.replace(f, sampler=None) for f in figures], limit)   # without samplers
    lines = tuple(no_slots[i] + f"; the state and the update fit ({gb(figures[i].state)} + "
                  f"{gb(dataclasses.replace(figures[i], sampler=None).transient)} of {gb(limit)}, {source})"
                  if no_slots[i] and i not in stepped else
                  fix_line(parts, i, figures, groups, limit, source, *ctx[i], template[i]) for i in bad)
    return MemoryPlan(figures=tuple(figures), limit=limit, source=source, misfits=lines,
                      compile_seconds=tuple(seconds))


def _micro_batch_text(m: int) -> str:
    return f"micro_batch_size {m}" if m else "every row in one micro-batch"


def micro_batch_candidates(rows: int, G: int) -> list[int]:
    """Micro-batch sizes below ``rows`` worth compiling: whole groups (multiples of G dividing the rows) and the
    divisors of G."""
    return sorted({m for m in range(1, rows) if (m % G == 0 and rows % m == 0) or G % m == 0})


def fix_line(parts, i: int, figures: Sequence[PolicyMemory], groups, limit: int, source: str, mesh, inputs, sampler,
             state) -> str:
    """One line: policy i's figure, the limit and every computed fix (a micro-batch fits when every device of
    the policy fits with the policies that time-share it)."""
    pol, spec, fig = parts.policies[i], parts.policies[i].spec, figures[i]
    key = f"policies.{pol.name}"
    mb_now = spec.optimizer.micro_batch_size or parts.cfg.prompts_per_round * pol.num_generations
    rows = parts.cfg.prompts_per_round * pol.num_generations
    seen: dict[int, PolicyMemory] = {mb_now: fig}

    def at(m: int) -> Optional[PolicyMemory]:
        if m not in seen:
            log.info("%s: fix search: compiling the update at micro_batch_size %d", pol.name, m)
            try:
                seen[m] = _figure(pol, state, pin_update(pol.update_at(m), mesh, state_shardings(state)), inputs,
                                  sampler)
            except jax.errors.JaxRuntimeError:   # a micro-batch the compiler rejects (e.g. XLA:TPU collectives)
                seen[m] = None
        return seen[m]

    def fits_at(m: int) -> bool:
        f = at(m)
        return f is not None and i not in over_limit(groups, [*figures[:i], f, *figures[i + 1:]], limit)

    upd = fig.update.peak - fig.params - fig.optimizer
    d = int(mesh.devices.size)
    if fig.sampler is not None and fig.sampler.peak - fig.params >= upd and (fig.slots or 0) > d:
        # a smaller micro-batch shrinks the update only
        fixes = [f"the sampler is the peak ({gb(fig.sampler.peak)}): fewer {key}.sampling.slots (now {fig.slots})"]
    else:
        best = largest_fitting([m for m in micro_batch_candidates(rows, pol.num_generations) if m < mb_now], fits_at)
        fixes = [] if fig.sampler is None or fig.sampler.peak - fig.params < upd else [
            f"no smaller S (the sampler at S = {fig.slots}, the smallest, is the peak: {gb(fig.sampler.peak)})"]
        fixes += [f"set {key}.optimizer.micro_batch_size: {best} (compiled: {gb(seen[best].total)})" if best else
                 "no micro_batch_size fits (smallest compiled: "
                 f"{gb(min(f.total for f in seen.values() if f is not None))})"]
    smallest = min((f for f in seen.values() if f is not None), key=lambda f: f.transient)
    n = devices_needed(fig.state, int(mesh.devices.size), smallest.transient, limit)
    fixes.append(f"{n} device(s) for it (has {mesh.devices.size}; policies.{pol.name}.devices or mwra.devices)"
                 if n else "no device count fits (the step's transient alone exceeds the limit)")
    fixes.extend(_model_fixes(parts, i, limit, mesh, inputs, sampler, mb_now))
    return (f"config key '{key}': needs {gb(fig.total)} per device ({fig.line()}) but the device memory is "
            f"{gb(limit)} ({source}); fixes: " + "; ".join(fixes))


def state_fix_line(parts, i: int, states: Sequence[PolicyMemory], limit: int, source: str) -> str:
    """One line: policy i's state alone (``states[i]``: params, optimizer, reference per device, no step compiled)
    over ``limit``, the verdict and the fixes, from abstract shapes (nothing compiled): the chips the states alone
    need at FSDP (a larger share of these devices: ``policies.<p>.devices``; or more chips), LoRA's state, the
    reference dropped; micro-batch, remat and a smaller S shrink the steps only."""
    pol, f, mesh = parts.policies[i], states[i], parts.placement.meshes[i]
    key, n, total = f"policies.{pol.name}", int(mesh.devices.size), parts.placement.plan.num_devices
    need = [devices_needed(s.state, int(m.devices.size), 0, limit) for s, m in zip(states, parts.placement.meshes)]
    if sum(need) <= total:
        fixes = [f"give it {need[i]} or more of the {total} devices (has {n}; {key}.devices; the others' states fit "
                 f"on the rest)"]
    else:
        fixes = [f"more chips: the states alone need {sum(need)} or more devices at FSDP (has {total})"]
    if f.reference:
        fixes.append(f"grpo.beta: 0 drops the reference ({gb(f.state - f.reference)} left)")
    config = getattr(nnx.merge(pol.graphdef, parts.policy_template(i).params), "config", None)
    if not pol.spec.lora.rank and config is not None:
        lora = _rebuilt_state(parts, i, config, True, mesh)[1]
        fixes.append(f"lora.rank: {LORA_RANK}: state {gb(tree_bytes(lora))} per device "
                     f"({'fits' if tree_bytes(lora) <= limit else 'does not fit'}; its steps are compiled once the "
                     "state fits)")
    fixes.append("optimizer.micro_batch_size, model.remat and fewer sampling.slots shrink the steps, not the state: "
                 "not searched")
    use = device_use([p.device_ids for p in parts.placement.plan.policies], states)
    shared = max(use[d] for d in parts.placement.plan.policies[i].device_ids)
    beside = "" if shared == f.state else f"; with the states of the policies time-sharing its devices {gb(shared)}"
    return (f"config key '{key}': does not fit: its state alone needs {gb(f.state)} per device (params "
            f"{gb(f.params)} + optimizer {gb(f.optimizer)} + reference {gb(f.reference)}, on {n} device(s){beside}) "
            f"but the device memory is {gb(limit)} ({source}); no step compiled; fixes: " + "; ".join(fixes))


def state_shardings(state):
    return jax.tree.map(lambda x: x.sharding, state)


def _model_fixes(parts, i: int, limit: int, mesh, inputs, sampler, mb: int) -> list[str]:
    """Whether ``model.remat: full`` (when not set) and LoRA (when not used) fit, compiled at micro-batch ``mb``."""
    pol, spec = parts.policies[i], parts.policies[i].spec
    out = []
    config = getattr(nnx.merge(pol.graphdef, parts.policy_template(i).params), "config", None)
    if config is None:
        return out
    if spec.model.remat != "full":
        log.info("%s: fix search: compiling the update with model.remat full", pol.name)
        f = _rebuilt(parts, i, dataclasses.replace(config, remat="full"), bool(spec.lora.rank), mesh, inputs, sampler,
                     mb)
        out.append(f"model.remat: full {'fits' if f.total <= limit else 'does not fit'} ({gb(f.total)})")
    if not spec.lora.rank:
        log.info("%s: fix search: compiling the update with lora.rank %d", pol.name, LORA_RANK)
        f = _rebuilt(parts, i, config, True, mesh, inputs, sampler, mb)
        out.append(f"lora.rank: {LORA_RANK} {'fits' if f.total <= limit else 'does not fit'} ({gb(f.total)})")
    return out


def _abstract(spec, config, lora: bool):
    """Abstract model of ``config`` with the policy's LoRA adapters (``lora`` and ``spec.lora.rank``) or rank
    `LORA_RANK` ones on the default targets (``lora`` only)."""
    def build():
        model = build_model(config)
        if lora and spec.lora.rank:
            return add_lora(spec, model, 0)
        if lora:
            return lora_lib.apply_lora(model, rank=LORA_RANK, alpha=2.0 * LORA_RANK, targets=LORA_DEFAULT_TARGETS,
                                       strict=False)
        return model
    return nnx.eval_shape(build)


def _rebuilt(parts, i: int, config, lora: bool, mesh, inputs, sampler, mb: int) -> PolicyMemory:
    """Figures of policy i rebuilt abstractly from model ``config`` (with LoRA adapters when ``lora``, see
    `_abstract`), at micro-batch ``mb``: optimizer over the trainable leaves, no reference params for LoRA
    (its reference is the base with adapters off)."""
    pol = parts.policies[i]
    model, state = _rebuilt_state(parts, i, config, lora, mesh)
    make = update_factory(model, lora, pol.optimizer, pol.probe,
                          pol.spec.grpo.resolved(pol.num_generations, pol.max_completion_length,
                                                 pol.sampling.temperature), pol.spec)
    return _figure(pol, state, pin_update(make(mb), mesh, state_shardings(state)), inputs, sampler)


def _rebuilt_state(parts, i: int, config, lora: bool, mesh):
    """(the abstract model, its state placed on ``mesh``) of policy i rebuilt from model ``config`` (`_rebuilt`)."""
    pol = parts.policies[i]
    model = _abstract(pol.spec, config, lora)
    params = nnx.state(model)
    trainable = lora_lib.split_adapters(params)[0] if lora else params
    opt_state = jax.eval_shape(pol.optimizer.init, trainable)
    ps = mwra.param_shardings(params, mesh, parts.placement.rules, min_size=parts.placement.min_size)
    os = mwra.opt_state_shardings(opt_state, ps, mesh)
    put = lambda t, s: jax.tree.map(lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=y), t, s)  # noqa
    ref = None if lora or pol.spec.grpo.beta == 0 else put(params, ps)
    return model, PolicyState(params=put(params, ps), opt_state=put(opt_state, os), ref_params=ref)


__all__ = ["LORA_RANK", "MemoryPlan", "SamplerMisfit", "abstract_rows", "compile_plan", "fix_line",
           "micro_batch_candidates", "placed", "plan_memory", "state_fix_line"]
