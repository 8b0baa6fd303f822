"""MWRA in ``mrl train``: the plan of a run, each policy's state on its own mesh, steps jitted for that mesh.

At start `make_placement` computes `mwra.plan` from each policy's cost (parameters x tokens per round, or the
policy's ``cost`` override) over ``jax.devices()`` (``mwra.devices``: all, or the first N), honouring the
per-policy ``devices`` overrides. Errors are one line naming the config key. Memory is checked afterwards
against the compiled steps (`mrl_jax.trainer.memory.plan_memory`).

`Placement.place(i, state)` puts policy i's params, optimizer state and reference params (when held) on
its mesh with the sharding rules (``mwra.rules`` before `mwra.DEFAULT_RULES`: FSDP for large leaves,
replicated below ``mwra.min_size`` elements). The sampler is the slot sampler on the mesh (`mesh_generate`;
the round drives it itself); `pin_update` gives the policy (`trainer.policy.build_policy`) its mesh-pinned step:

* ``update(params, opt_state, ref_params, rows, view, key, step)``: the policy's round update (its mu updates
  and reference syncs, `mrl_jax.learner.iterate`) with the state kept as placed (``out_shardings``), params and
  opt state donated; the rows and view are put on the mesh explicitly by the round
  (rows sharded where they divide the data axis, replicated otherwise -- own GRPO rows cannot be padded
  without changing the group statistics, see the module doc of `mrl_jax.trainer.round`).

Everything crossing meshes or host <-> device goes through `mwra.put` / `mwra.to_mesh` (explicit
``device_put``), so a round runs under ``jax.transfer_guard("disallow")``.

Several processes: a mesh may span them. `fetch` reads every step's outputs on every process (replicated over a
spanning mesh, broadcast where a process holds none of it) and `lockstep` launches a spanning mesh's steps
together (docs/multihost.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mrl_jax import mwra
from mrl_jax.configs import ConfigError
from mrl_jax.models import splash
from mrl_jax.mwra import lockstep, owners
from mrl_jax.sampler import drive, launch

def config_rules(rules: Sequence[Sequence[Any]]) -> tuple:
    """``mwra.rules`` from the config (``[[regex, 'fsdp' | 'replicated' | [axes...]], ...]``) followed by the
    defaults, as `mwra.spec_for` takes them."""
    out = []
    for pattern, spec in rules:
        if spec == "fsdp":
            s = mwra.FSDP
        elif spec == "replicated":
            s = mwra.REPLICATED
        else:
            s = PartitionSpec(*[tuple(e) if isinstance(e, (list, tuple)) else e for e in spec])
        out.append((str(pattern), s))
    return tuple(out) + tuple(mwra.DEFAULT_RULES)


def device_memory_bytes(devices: Sequence[Any]) -> Optional[int]:
    """The smallest per-device memory limit the devices report (accelerators), None where none reports."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 -- CPU devices raise or return None
            stats = {}
        if stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def run_devices(mwra_spec, devices: Optional[Sequence[Any]] = None) -> list:
    """The devices a run plans over: ``jax.devices()`` ordered by (process, id), all or the first N."""
    devs = sorted(jax.devices() if devices is None else list(devices),
                  key=lambda d: (getattr(d, "process_index", 0), d.id))
    want = mwra_spec.devices
    if want == "all":
        return devs
    if want > len(devs):
        raise ConfigError(f"config key 'mwra.devices': {want} devices requested but only {len(devs)} exist "
                          f"({devs[0].platform if devs else 'no'} devices); lower it or use 'all'")
    return devs[:want]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A run's plan, one mesh per policy, and the sharding rules."""

    plan: mwra.Plan
    meshes: tuple
    rules: tuple
    min_size: int

    def shardings(self, i: int, state) -> Any:
        """``state``-shaped `NamedSharding` tree for policy i (a ``PolicyState``: params by the rules, opt state
        mirroring them, ref params as params)."""
        mesh = self.meshes[i]
        ps = mwra.param_shardings(state.params, mesh, self.rules, min_size=self.min_size)
        os = mwra.opt_state_shardings(state.opt_state, ps, mesh)
        rs = None if state.ref_params is None else mwra.param_shardings(state.ref_params, mesh, self.rules,
                                                                        min_size=self.min_size)
        return state.replace(params=ps, opt_state=os, ref_params=rs)

    def place(self, i: int, state):
        """Policy i's ``PolicyState`` on its mesh (host values or arrays on any device)."""
        sh = self.shardings(i, state)
        return state.replace(params=mwra.put(state.params, sh.params),
                             opt_state=mwra.put(state.opt_state, sh.opt_state),
                             ref_params=None if state.ref_params is None else mwra.put(state.ref_params,
                                                                                     sh.ref_params))

    def to_dict(self) -> dict:
        return self.plan.to_dict()


def policy_cost(spec, params: int, prompts_per_round: int, num_generations: int, prompt_tokens: float) -> float:
    """Parameters x tokens per round (prompt + completion tokens of the P x G rollouts), or ``spec.cost``."""
    if spec.cost > 0:
        return float(spec.cost)
    tokens = prompts_per_round * num_generations * (float(prompt_tokens) + spec.sampling.max_new_tokens)
    return float(params) * max(tokens, 1.0)


def plan_run(cfg, param_counts: Sequence[int], prompt_tokens: Sequence[float],
             devices: Optional[Sequence[Any]] = None) -> mwra.Plan:
    """The run's `mwra.Plan` (no device touched: fake devices with ``.id`` work); ``ConfigError`` naming the
    key for every infeasible request (overlapping or unknown ids, more devices than exist)."""
    specs = cfg.policies
    names = [s.name for s in specs]
    devs = run_devices(cfg.mwra, devices)
    costs = [policy_cost(s, n, cfg.prompts_per_round, cfg.num_generations, t)
             for s, n, t in zip(specs, param_counts, prompt_tokens)]
    assign = [s.devices for s in specs]
    try:
        p = mwra.plan(costs, devs, [int(n) for n in param_counts], names, time_share=cfg.mwra.time_share,
                      assign=assign if any(a is not None for a in assign) else None)
    except mwra.PlanError as e:
        key = "policies[*].devices" if e.policy is None else f"policies.{names[e.policy]}.devices"
        raise ConfigError(f"config key '{key}': {e}") from e
    return p


def make_placement(cfg, param_counts: Sequence[int], prompt_tokens: Sequence[float],
                   devices: Optional[Sequence[Any]] = None) -> Placement:
    """`plan_run` and the meshes and rules of the run."""
    p = plan_run(cfg, param_counts, prompt_tokens, devices)
    rules = config_rules(cfg.mwra.rules)
    return Placement(plan=p, meshes=tuple(p.meshes()), rules=rules, min_size=cfg.mwra.min_size)


def param_devices(state) -> list[int]:
    """Ids of the devices policy state's params and optimizer state occupy (read from the arrays)."""
    return sorted(mwra.devices_of((state.params, state.opt_state)))


def placement_summary(placement: Placement, states: Sequence[Any]) -> dict:
    """summary.json's per-policy ``placement``: planned device ids and the ids the arrays occupy."""
    out = {}
    for p, s in zip(placement.plan.policies, states):
        out[p.name] = {"devices": list(p.device_ids), "param_devices": param_devices(s)}
        if s.ref_params is not None:
            out[p.name]["ref_devices"] = sorted(mwra.devices_of(s.ref_params))
    return out


def pad_rows(n: int, multiple: int) -> int:
    """Rows after padding ``n`` up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def pad_prompts(ids: np.ndarray, mask: np.ndarray, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """``ids``/``mask`` [P, Tp] padded with copies of the last prompt to a multiple of ``multiple`` rows.

    The padding rows are inactive: the round drops their samples on the host. The sampler's noise of row b is
    drawn from ``fold_in(key, b)`` (`mrl_jax.sampler.row_uniforms`), so the real rows' samples are those
    of an unpadded call."""
    P = ids.shape[0]
    extra = pad_rows(P, multiple) - P
    if not extra:
        return ids, mask
    return (np.concatenate([ids, np.repeat(ids[-1:], extra, 0)]),
            np.concatenate([mask, np.repeat(mask[-1:], extra, 0)]))


def fetch(mesh: Optional[Mesh], tree):
    """``tree``'s arrays as host numpy on *every* process (all processes call it, in the same order).

    One process: ``jax.device_get``. Several (``jax.distributed``): arrays of a mesh spanning processes are
    first replicated over it (one jitted identity, `lockstep`), which hands every process of the mesh the
    whole value; a mesh inside one process is read there. Where some process holds none of the mesh's
    devices, the value is broadcast from the mesh's first process (``multihost_utils.broadcast_one_to_all``).
    So the host work after it (decoding, rewards, THL, SEE) is identical on every process."""
    if jax.process_count() == 1 or mesh is None:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    procs = owners(mesh)
    if len(procs) > 1:
        tree = _replicate(mesh)(tree)
        read = lambda x: np.asarray(x.addressable_data(0))   # noqa: E731 -- the whole value, held locally
    else:
        read = np.asarray
    mine = jax.process_index() in procs
    if len(procs) == jax.process_count():
        return jax.tree.map(read, tree)
    host = jax.tree.map(read if mine else (lambda x: np.zeros(x.shape, x.dtype)), tree)
    return multihost_utils.broadcast_one_to_all(host, is_source=jax.process_index() == procs[0])


_REPLICATE: dict = {}


def _replicate(mesh: Mesh) -> Callable:
    """A jitted identity whose outputs are replicated over ``mesh`` (every process of the mesh holds them)."""
    fn = _REPLICATE.get(mesh)
    if fn is None:
        fn = _REPLICATE[mesh] = lockstep(mesh, jax.jit(lambda t: t, out_shardings=NamedSharding(mesh,
                                                                                               mwra.REPLICATED)))
    return fn


def mesh_generate(policy, params, prompt_ids: np.ndarray, prompt_mask: np.ndarray, key, sampling,
                  num_samples: int = 1):
    """The slot sampler (`mrl_jax.sampler`) of ``policy`` on its mesh from host prompts, fetched to the host on every
    process (see `fetch`): rows padded to the data axis and trimmed again. For evaluation and other off-round
    sampling."""
    mesh = policy.mesh
    P = prompt_ids.shape[0]
    ids, mask = pad_prompts(np.asarray(prompt_ids), np.asarray(prompt_mask), int(mesh.devices.size))
    out, = drive([launch(policy.graphdef, params, ids, mask, key, sampling, num_samples=num_samples,
                         slots=policy.slots, width=max(policy.slot_width, ids.shape[1]), mesh=mesh,
                         shrink=policy.spec.sampling.ladder, ladder=policy.spec.sampling.ladder_shape)])
    return jax.tree.map(lambda x: x[:P * int(num_samples)], fetch(mesh, out))


def pin_update(inner: Callable, mesh: Mesh, state_shardings) -> Callable:
    """``inner(params, opt_state, ref_params, rows, view, key, step)`` (the policy's round update) jitted with the
    state kept as placed (``state_shardings``), params and opt state donated, metrics replicated on ``mesh``."""
    repl = NamedSharding(mesh, mwra.REPLICATED)
    out = (state_shardings.params, state_shardings.opt_state, state_shardings.ref_params, repl)
    return jax.jit(on_mesh(mesh, inner), out_shardings=out, donate_argnums=(0, 1))


def on_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` whose tracing places the model's kernel calls on ``mesh`` (`mrl_jax.models.splash.on_mesh`)."""
    def call(*args):
        with splash.on_mesh(mesh):
            return fn(*args)
    return call


__all__ = ["Placement", "config_rules", "device_memory_bytes", "fetch", "lockstep", "make_placement", "mesh_generate",
           "owners", "pad_prompts", "pad_rows", "param_devices", "pin_update", "placement_summary",
           "plan_run", "policy_cost", "run_devices"]
