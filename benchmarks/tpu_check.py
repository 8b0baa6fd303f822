"""The plan's programs timed on a real TPU: measured seconds over XLA:TPU's estimate, per policy and phase.

    python benchmarks/tpu_check.py --config F [--repeats 5] [--warmup 2] [--out FILE]

Run on a TPU VM: the config is planned on the local devices as ``mrl train`` places it (`Run`, abstract: no
weights loaded); per policy its update and its sampler's round program are lowered on the plan's abstract inputs
and compiled once (`mwra.memory_plan.compiled_memory`: the compile that gives ``StepMemory.time``, the estimate
``mrl plan`` prints), then run on random inputs of those shapes, dtypes and shardings (``--warmup`` calls, then the
median of ``--repeats``). The sampler is also compiled at one new token (its prefill); with the decode steps each
round program reports, the two give the measured prefill and decode step:

  update       measured / estimated seconds of the round's update program
  prefill      t(1 token) - its steps x step          / the sampler's estimate outside its decode loop
  decode step  (t(N) - t(1)) / (steps(N) - steps(1))   / the decode loop's estimated iteration (first rung)
  sampler      t(N)                                    / estimated prefill + steps(N) x estimated decode step

Random weights stop at random tokens: the decode steps are counted, not assumed. Prints one line per phase and
writes JSON to ``--out`` (else ``$OUT/tpu_check.json``, else ``./tpu_check.json``). Off a TPU it says so and
exits 0 (nothing to check: the estimate is XLA:TPU's). The plumbing is tested on the CPU
(tests/test_tpu_check.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


@dataclasses.dataclass
class Program:
    """One jitted program of a policy and its abstract arguments (``ShapeDtypeStruct``s, shardings set).

    ``carry(args, out)``: the next call's arguments (the update donates params and optimizer state: its outputs
    replace them); ``steps(out)``: the decode steps the call ran (0 for the update)."""

    policy: str
    name: str
    fn: Callable
    args: tuple
    carry: Callable = lambda args, out: args
    steps: Callable = lambda out: 0


@dataclasses.dataclass(frozen=True)
class Measured:
    """A compiled program's wall time per call on random inputs: median and every repeat; decode steps per call."""

    median_s: float
    times_s: tuple
    steps: int


def random_inputs(args, seed: int = 0):
    """Concrete arrays of ``args``' shapes, dtypes and shardings, made on their devices: floats normal x 0.02,
    booleans True (every token real), integers 0 (a valid token and index), PRNG keys from ``seed``."""
    leaves, tree = jax.tree.flatten(args)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))

    def make(x, k):
        shape, dt = tuple(x.shape), x.dtype
        if jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            return lambda: jax.random.split(k, shape) if shape else k
        if jnp.issubdtype(dt, jnp.floating):
            return lambda: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dt)
        return lambda: jnp.full(shape, jnp.issubdtype(dt, jnp.bool_), dt)

    out = [jax.jit(make(x, k), out_shardings=getattr(x, "sharding", None))() for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, out)


def measure(compiled, args, carry=lambda a, o: a, steps=lambda o: 0, warmup: int = 2, repeats: int = 5) -> Measured:
    """``compiled(*args)`` timed to completion: ``warmup`` calls, then the median of ``repeats``; each call's
    arguments from the last by ``carry``, ``steps`` read from the last output."""
    out = None
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        args = carry(args, out)
    return Measured(median_s=statistics.median(times), times_s=tuple(times), steps=int(steps(out)))


def _ratio(measured: Optional[float], estimated: Optional[float]) -> Optional[float]:
    return None if measured is None or not estimated else measured / estimated


def _row(policy: str, phase: str, measured: Optional[float], estimated: Optional[float], **extra) -> dict:
    return dict(policy=policy, phase=phase, measured_s=measured, estimated_s=estimated,
                ratio=_ratio(measured, estimated), **extra)


def phase_rows(policy: str, update: tuple, sampler: tuple, prefill: tuple) -> list[dict]:
    """Measured / estimated per phase (module doc) from (Measured, `mwra.cost_model.StepTime` or None) of the
    update, the sampler at its new tokens and the sampler at one; the sampler's own estimate prices prefill and
    decode step."""
    (mu, eu), (ms, es), (mp, _) = update, sampler, prefill
    rows = [_row(policy, "update", mu.median_s, None if eu is None else eu.seconds)]
    est_prefill = est_step = None
    if es is not None:
        est_prefill = es.without_open_loops().seconds
        est_step = es.open_loops[0].per_iteration.seconds if es.open_loops else None
    step = None if ms.steps == mp.steps else (ms.median_s - mp.median_s) / (ms.steps - mp.steps)
    pre = mp.median_s - mp.steps * (step or 0.0)
    rows.append(_row(policy, "prefill", pre, est_prefill))
    rows.append(_row(policy, "decode step", step, est_step, steps=ms.steps))
    est_round = None if est_prefill is None or est_step is None else est_prefill + ms.steps * est_step
    rows.append(_row(policy, "sampler", ms.median_s, est_round, steps=ms.steps))
    return rows


def line(row: dict) -> str:
    """One printed line: ``policy phase: measured X, estimated Y (XLA:TPU), measured / estimated R``."""
    def secs(s):
        return "-" if s is None else f"{s * 1e3:.3f} ms"
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
    steps = f" over {row['steps']} decode steps" if "steps" in row else ""
    return (f"{row['policy']} {row['phase']}{steps}: measured {secs(row['measured_s'])}, estimated "
            f"{secs(row['estimated_s'])} (XLA:TPU), measured / estimated {ratio}")


def compiled_with_estimate(program: Program):
    """(compiled program, its estimate: ``StepMemory.time``, None off TPU) from one compile."""
    from mrl_jax.mwra.memory_plan import compiled_memory

    compiled, mem = compiled_memory(program.fn.lower(*program.args), program.args)
    if compiled is None:
        raise RuntimeError(f"{program.policy} {program.name}: XLA:TPU refused it as over the HBM "
                           f"(temporaries {mem.temp / 2**30:.2f} GiB)")
    return compiled, None if mem is None else mem.time


def _sampler(parts, i: int, new_tokens: int) -> Program:
    """Policy i's sampler round program at ``new_tokens`` as the memory plan compiles it, on abstract prompts, at
    ``sampling.slots`` (unset: a slot per row; where that does not fit, set it to the S ``mrl plan`` chose); its
    second output's first count is the decode steps."""
    from jax.sharding import NamedSharding

    from mrl_jax import mwra, sampler
    from mrl_jax.trainer.memory import _key, padded_prompts

    pol, mesh = parts.policies[i], parts.placement.meshes[i]
    params = parts.policy_template(i).params
    d, Tp = int(mesh.devices.size), parts.widths[i]
    P, G = padded_prompts(parts, d), pol.num_generations
    cfg = dataclasses.replace(pol.sampling, max_new_tokens=new_tokens)
    S = sampler.slot_count(P * G, pol.spec.sampling.slots, d)
    rungs = sampler.rungs(pol.graphdef, params, S, new_tokens, d, pol.spec.sampling.ladder,
                          ragged=sampler.ragged(cfg.eos_ids, S, P * G), ladder=pol.spec.sampling.ladder_shape)
    admit = sampler.admit_count(S) if S < P * G else 0
    fn = sampler.round_program(pol.graphdef, cfg, G, rungs, Tp, admit, mwra.row_sharding(mesh))
    repl = NamedSharding(mesh, mwra.REPLICATED)
    ids, mask = (jax.ShapeDtypeStruct((P, Tp), dt, sharding=repl) for dt in (jnp.int32, jnp.bool_))
    return Program(pol.name, f"sampler at {new_tokens} tokens", fn, (params, ids, mask, _key(mesh)),
                   steps=lambda out: jax.device_get(out[1])[0])


def policy_programs(parts, i: int) -> tuple:
    """(update, sampler, prefill) `Program`s of policy i of ``parts`` (a run's abstract `trainer.parts.Parts` on
    the local devices)."""
    from mrl_jax.trainer.memory import _update_inputs

    pol, mesh = parts.policies[i], parts.placement.meshes[i]
    state = parts.policy_template(i)
    inputs = _update_inputs(parts, pol, mesh, parts.widths[i])
    update = Program(pol.name, "update", pol.update, (state.params, state.opt_state, state.ref_params, *inputs),
                     carry=lambda args, out: (out[0], out[1], *args[2:]))
    return update, _sampler(parts, i, pol.sampling.max_new_tokens), _sampler(parts, i, 1)


def check(parts, warmup: int = 2, repeats: int = 5, estimate: Optional[Callable] = None) -> list[dict]:
    """Every policy's phases, measured and estimated (`phase_rows`); ``estimate(program, compiled)`` replaces
    the compile's own estimate (the CPU tests give one)."""
    rows = []
    for i in range(len(parts.policies)):
        timed = []
        for program in policy_programs(parts, i):
            compiled, est = compiled_with_estimate(program)
            est = est if estimate is None else estimate(program, compiled)
            m = measure(compiled, random_inputs(program.args, seed=i), program.carry, program.steps, warmup, repeats)
            timed.append((m, est))
            print(f"[tpu_check] {program.policy} {program.name}: {m.median_s * 1e3:.3f} ms median of {repeats}"
                  f"{'' if not m.steps else f', {m.steps} decode steps'}", flush=True)
        rows.extend(phase_rows(parts.policies[i].name, *timed))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="run config YAML (as mrl plan / mrl train take)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per program (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per program first")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/tpu_check.json or ./tpu_check.json)")
    args = p.parse_args(argv)
    platform = jax.devices()[0].platform
    if platform != "tpu":
        print(f"tpu_check: skipped: no TPU here (jax.devices()[0].platform is {platform!r}); run it on a TPU VM, "
              "where the plan's programs run and XLA:TPU's estimate is checked", flush=True)
        return 0
    from mrl_jax.trainer.config import load_run_config
    from mrl_jax.trainer.parts import build_parts

    parts = build_parts(load_run_config(args.config), devices=jax.devices(), abstract=True)
    rows = check(parts, args.warmup, args.repeats)
    for row in rows:
        print(line(row), flush=True)
    out = args.out or os.path.join(os.environ.get("OUT") or ".", "tpu_check.json")
    Path(out).write_text(json.dumps({"device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
                                     "config": args.config, "phases": rows}, indent=2))
    print(f"[tpu_check] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
