"""The memory plan of ``mrl train`` (mrl_jax.mwra.memory_plan, mrl_jax.trainer.memory): figures from XLA's
compiled memory analysis of each policy's steps, a stop before any RL work with the computed fixes."""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from hypothesis import given, settings
from hypothesis import strategies as st

import support
from mrl_jax import mwra
from mrl_jax.configs import ConfigError
from mrl_jax.mwra.memory_plan import (PolicyMemory, StepMemory, device_use, devices_needed, largest_fitting,
                                      over_limit, tree_bytes)
from mrl_jax.sampler import SHORT, graph_token
from mrl_jax.sampler import rounds
from mrl_jax.trainer import memory
from mrl_jax.trainer.run import Run

GIB = 1 << 30
pytestmark = pytest.mark.usefixtures("jax_compile_cache")


def one_policy(**overrides):
    cfg = support.tiny_config(**overrides)
    cfg["policies"] = cfg["policies"][:1]
    cfg["policies"][0]["probes"] = "none"
    return cfg


class _PlanLines(logging.Handler):
    """The memory plan's compile lines (logger ``mrl_jax.plan``) while in a ``with`` block."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.got: list[str] = []

    def emit(self, record):
        self.got.append(record.getMessage())

    def __enter__(self):
        self.logger = logging.getLogger("mrl_jax.plan")
        self.level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def test_plan_progress_lines_on_the_cli_stream():
    import contextlib
    import io

    from mrl_jax.cli import show_plan_progress

    logger = logging.getLogger("mrl_jax.plan")
    before = (list(logger.handlers), logger.level, logger.propagate)
    try:
        logger.handlers = []
        out = io.StringIO()
        show_plan_progress(out)
        show_plan_progress(out)   # once per process
        logger.info("%s: compiling the update", "a")
        assert out.getvalue() == "mrl plan: [0:00] a: compiling the update\n"
        logger.handlers = []
        show_plan_progress()    # stderr: the one of each line's time (a test's capture replaces it per test)
        for _ in range(2):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                logger.info("b")
            assert err.getvalue() == "mrl plan: [0:00] b\n"
    finally:
        logger.handlers, logger.level, logger.propagate = before


def _width(run, pol) -> int:
    """The slot width of ``pol``: `parts.prompt_width` of the train prompts as the round draws them."""
    from mrl_jax.trainer.parts import prompt_width

    return prompt_width(run.parts.prompts.drawn_texts(), pol.tokenizer, pol.prompt_format, pol.prompt_limit)


@pytest.fixture(scope="module")
def planned():
    run = Run(support.to_run_config(one_policy(mwra={"memory_gb": 64.0})))
    return run, run.memory


def test_plan_figures_are_the_compiled_update_on_real_arrays(planned):
    run, plan = planned
    pol, f = run.policies[0], plan.figures[0]
    state = run.initial_state().policies[0]
    P, G, Tc = run.cfg.prompts_per_round, pol.num_generations, pol.max_completion_length
    Tp = _width(run, pol)
    shapes = memory.abstract_rows(P, G, Tp, Tc)
    mesh = run.placement.meshes[0]
    batch = mwra.shard_rows(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), mesh, strict=False)
    view = mwra.to_mesh(memory.see_lib.empty_view(P, pol.view_shape.slots, Tc, Tc, 1), mesh)
    key = jax.random.key(0)
    mem = pol.update.lower(state.params, state.opt_state, state.ref_params, batch, view, key,
                           np.int32(0)).compile().memory_analysis()
    assert f.update.temp == mem.temp_size_in_bytes > 0
    assert f.update.args == mem.argument_size_in_bytes and f.update.alias == mem.alias_size_in_bytes
    assert f.params == sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert f.optimizer == sum(x.nbytes for x in jax.tree.leaves(state.opt_state)) and f.reference == 0
    assert f.total == f.state + f.transient and f.total <= plan.limit
    assert "update temporaries" in str(plan) and "llama_bpe" in str(plan)


def test_a_plan_that_cannot_fit_stops_with_the_micro_batch_that_does(planned, tmp_path):
    run, plan = planned
    pol, full = run.policies[0], plan.figures[0]
    G = pol.num_generations
    rows = run.cfg.prompts_per_round * G
    limit = full.total - 1   # the run's own micro-batch (all rows) misses by one byte
    limit_gb = limit / GIB
    from mrl_jax.trainer.loop import train

    lines = _PlanLines()
    with lines, pytest.raises(ConfigError) as e:   # stops at start: nothing is written past the plan
        train(support.to_run_config(one_policy(mwra={"memory_gb": limit_gb})), tmp_path / "run", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "'policies.llama_bpe'" in msg and "lora.rank: 16" in msg, msg
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    m = int(re.search(r"optimizer\.micro_batch_size: (\d+)", msg).group(1))
    assert G <= m < rows and m in memory.micro_batch_candidates(rows, G)
    n = int(re.search(r"(\d+) device\(s\) for it", msg).group(1))
    assert n >= 1
    # each compile announced before it runs (a real-shape plan compiles for minutes)
    assert lines.got[0] == f"llama_bpe: compiling the sampler at S = {rows} slots"
    assert "llama_bpe: compiling the update (every row in one micro-batch)" in lines.got
    assert f"llama_bpe: fix search: compiling the update at micro_batch_size {m}" in lines.got
    assert lines.got[-1] == "llama_bpe: fix search: compiling the update with lora.rank 16"
    # the fix, applied, passes the same check
    rerun = Run(support.to_run_config(one_policy(mwra={"memory_gb": limit_gb},
                                              **{"policies.0.optimizer": {"learning_rate": 1e-3,
                                                                          "micro_batch_size": m}})))
    fixed = rerun.memory
    assert fixed.figures[0].total <= int(limit_gb * GIB) < full.total and fixed.limit == int(limit_gb * GIB)


def test_cpu_without_memory_gb_compiles_nothing():
    run = Run(support.to_run_config(one_policy()))
    assert run.memory is None and memory.plan_memory(run.parts) is None
    # the sampler is sized at build all the same: one slot width (the widest train prompt) for every round
    pol = run.policies[0]
    assert pol.slot_width == _width(run, pol) > 0 and pol.slots is None


LONG = {"max_new_tokens": 40}   # past sampler.SHORT: a round long enough for the ladder


@pytest.mark.parametrize("overrides, line", [
    ({}, "S = 16 decode slots for 16 rows a round (every row); rungs 16"),   # 6 new tokens: a short round
    ({"policies.0.sampling": LONG}, "S = 16 decode slots for 16 rows a round (every row); rungs 16, 8"),
    ({"prompts_per_round": 32, "policies.0.sampling": LONG},
     "S = 128 decode slots for 128 rows a round (every row); rungs 128, 96, 64, 48, 32, 16, 8"),
    ({"policies.0.sampling": {**LONG, "slots": 5}}, "S = 5 decode slots for 16 rows a round (sampling.slots 5); rungs 5"),
    ({"prompts_per_round": 32, "policies.0.sampling": {**LONG, "slots": 200}},
     "S = 128 decode slots for 128 rows a round (sampling.slots 200); rungs 128, 96, 64, 48, 32, 16, 8"),
    ({"policies.0.sampling": {**LONG, "ladder": False}}, "S = 16 decode slots for 16 rows a round (every row); rungs 16"),
    ({"policies.0.sampling": {**LONG, "ladder_ratio": 0.7, "ladder_floor": 2}},
     "S = 16 decode slots for 16 rows a round (every row); rungs 16, 11, 7, 4, 2"),
])
def test_the_start_of_run_plan_says_each_samplers_slots_and_rungs(overrides, line, tmp_path):
    """Without a memory plan (CPU, no ``mwra.memory_gb``) the printed plan still names each sampler's S (the
    config's, at most the rows; unset: every row) and the rungs a round's tail moves down; plan.txt and plan.json
    carry the same lines."""
    from mrl_jax.trainer.loop import _write_plan

    run = Run(support.to_run_config(one_policy(**overrides)))
    assert run.memory is None and run.sampler_lines() == [f"sampler {run.policies[0].name}: " + line]
    _write_plan(tmp_path, run, progress=False)
    assert (tmp_path / "plan.txt").read_text().splitlines()[-1] == run.sampler_lines()[0]
    assert json.loads((tmp_path / "plan.json").read_text())["samplers"] == run.sampler_lines()


def test_a_planned_run_is_built_with_the_plans_slots(planned):
    """``Run`` builds its policies with the sampler the plan compiled: its S and the widest train prompt."""
    run, plan = planned
    pol = run.policies[0]
    assert pol.slots == plan.figures[0].slots == run.cfg.prompts_per_round * pol.num_generations
    assert pol.slot_width == _width(run, pol)
    assert f"S = {pol.slots} decode slots for {pol.slots} rows a round (every row)" in run.sampler_lines()[0]


# ---------------------------------------------------------------------------------- pure parts
def _fig(name, state, transient):
    upd = StepMemory(args=state, out=0, temp=transient, alias=0)
    return PolicyMemory(name=name, params=state, optimizer=0, reference=0, update=upd)


def test_time_shared_devices_add_states_and_keep_the_largest_transient():
    a, b = _fig("a", 10, 5), _fig("b", 20, 7)
    assert a.total == 15 and b.total == 27
    use = device_use([(0,), (0, 1)], [a, b])
    assert use == {0: 10 + 20 + 7, 1: 27}
    assert over_limit([(0,), (0, 1)], [a, b], 36) == [0, 1]
    assert over_limit([(0,), (1,)], [a, b], 27) == []


@pytest.mark.parametrize("update_gb, named", [(0.5, "slots"), (3.0, "fixes")])
def test_sampling_slots_is_named_only_when_the_state_and_update_fit(monkeypatch, update_gb, named):
    """No S fits beside the state (`SamplerMisfit`): the plan's line names ``sampling.slots`` when the state and
    the update fit the device, else it is the update's fixes (`fix_line`). Figures faked: nothing compiled."""
    from mrl_jax.trainer.parts import build_parts

    parts = build_parts(support.to_run_config(one_policy()), abstract=True)
    slots = "config key 'policies.llama_bpe.sampling.slots': the sampler does not fit at any S (faked)"

    def sampler(parts, pol, mesh, params, Tp, room):
        raise memory.SamplerMisfit(slots, StepMemory(args=tree_bytes(params), out=0, temp=2 * GIB, alias=0), 1)

    def figure(pol, state, update, inputs, sampler):
        return PolicyMemory(name=pol.name, params=tree_bytes(state.params), optimizer=tree_bytes(state.opt_state),
                            reference=0, update=StepMemory(args=tree_bytes(state), out=0, temp=int(update_gb * GIB),
                                                           alias=0), sampler=sampler)

    monkeypatch.setattr(memory, "_sampler", sampler)
    monkeypatch.setattr(memory, "_figure", figure)
    monkeypatch.setattr(memory, "fix_line", lambda *a: "fixes")
    plan = memory.compile_plan(parts, GIB, "faked")
    assert len(plan.misfits) == 1 and plan.misfits[0].startswith(slots if named == "slots" else "fixes"), plan.misfits
    if named == "slots":
        assert plan.misfits[0].endswith("of 1 GiB, faked)") and "the state and the update fit" in plan.misfits[0]


def test_largest_fitting_bisects_a_monotone_predicate():
    calls = []

    def fits(m):
        calls.append(m)
        return m <= 6

    assert largest_fitting([1, 2, 4, 6, 8, 12], fits) == 6 and len(calls) <= 3
    assert largest_fitting([4, 8], lambda m: False) is None
    assert memory.micro_batch_candidates(16, 4) == [1, 2, 4, 8]
    assert memory.micro_batch_candidates(12, 4) == [1, 2, 4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=40, unique=True), st.integers(0, 700),
       st.one_of(st.none(), st.integers(-5, 700)))
def test_largest_fitting_with_a_guess_is_exact_and_a_right_guess_costs_two_calls(cands, threshold, guess):
    calls = []

    def fits(m):
        calls.append(m)
        return m <= threshold

    fitting = [c for c in cands if c <= threshold]
    want = max(fitting) if fitting else None
    assert largest_fitting(cands, fits, guess) == want
    assert len(calls) == len(set(calls))   # nothing compiled twice
    if guess is not None and want is not None and want == guess:
        assert len(calls) <= 2


def test_devices_needed_shards_the_state():
    assert devices_needed(state=30, devices=1, transient=5, limit=15) == 3      # 30/3 + 5 <= 15, 30/2 + 5 > 15
    assert devices_needed(state=10, devices=2, transient=5, limit=15) == 2
    assert devices_needed(state=10, devices=1, transient=15, limit=15) is None


def test_tree_bytes_counts_a_shard_per_device():
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("data",))
    sd = jax.ShapeDtypeStruct((8, 3), np.float32, sharding=NamedSharding(mesh, PartitionSpec("data")))
    assert tree_bytes({"a": sd, "b": jax.ShapeDtypeStruct((5,), np.int8)}) == 8 * 3 * 4 + 5


def test_sampler_figure_is_the_slot_sampler_at_the_chosen_slots(planned):
    """The plan compiles the slot sampler at every row (P x G) when it fits and prints S; with less room the
    largest S that fits (its figure within the room, KV bytes growing with S); with none, one ConfigError naming
    ``sampling.slots`` and the figure. (40 new tokens past a 16-token prompt for the smaller rooms: at every row the
    slots share their prompts' entries, so with 6 new tokens one slot holding its prompt's copy takes more than
    16 sharing them.)"""
    run, plan = planned
    pol, f = run.policies[0], plan.figures[0]
    rows = run.cfg.prompts_per_round * pol.num_generations
    assert f.slots == rows and f"sampler at S = {rows} slots" in str(plan) and plan.to_dict()["policies"][
        pol.name]["sampler_slots"] == rows
    mesh, params = run.placement.meshes[0], run.state_template().policies[0].params
    Tp = _width(run, pol)
    full, s = memory._sampler(run, pol, mesh, params, Tp)
    assert s == rows and full == f.sampler
    run = Run(support.to_run_config(one_policy(**{"policies.0.sampling": LONG})))
    pol, mesh, params = run.policies[0], run.placement.meshes[0], run.state_template().policies[0].params
    full, s = memory._sampler(run, pol, mesh, params, Tp)
    assert s == rows
    need = full.peak - tree_bytes(params)
    small, s = memory._sampler(run, pol, mesh, params, Tp, need - 1)
    assert 1 <= s < rows and small.peak - tree_bytes(params) <= need - 1 and small.peak < full.peak
    d = int(mesh.devices.size)
    P = run.cfg.prompts_per_round + (-run.cfg.prompts_per_round) % d
    above = memory._slot_memory(pol, mesh, params, P, Tp, s + d) if s + d < rows else full
    assert above.peak - tree_bytes(params) > need - 1   # the largest: one more step of slots does not fit
    with pytest.raises(ConfigError, match=r"policies\.llama_bpe\.sampling\.slots': the sampler does not fit at any S"):
        memory._sampler(run, pol, mesh, params, Tp, 0)


@pytest.mark.parametrize("overlong", ["truncate", "reject"])
def test_prompt_width_is_that_of_the_prompts_the_round_draws(tmp_path, overlong):
    """Train prompts longer than max_prompt_length: the plan's and the slot sampler's prompt width is the width
    of the round's prompts (truncated, or the overlong ones never drawn), not of the raw longest prompt (which
    sized every slot's KV cache, and the plan's update, ~12x too wide on a 3000-word task)."""
    import json

    path = tmp_path / "long.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    rows += [{"prompt": " ".join(["seven plus one"] * 200) + f" {i}+1=", "answer": str(i + 1)} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = one_policy(task={"name": "jsonl", "path": str(path), "seed": 0}, overlong_prompts=overlong,
                     **{"policies.0.max_prompt_length": 48})
    run = Run(support.to_run_config(cfg))
    pol = run.policies[0]
    width = _width(run, pol)
    raw = max(len(s) for s in pol.prompt_format.encode(pol.tokenizer, [p.text for p in run.train_prompts]))
    assert raw > 400 and width <= 48
    drawn = run.round_inputs(0).prompts
    widest = max(len(s) for s in pol.prompt_format.encode(pol.tokenizer, [p.text for p in drawn]))
    assert widest <= width


@pytest.mark.parametrize("new,part", [(6, 1), (40, 1), (40, 2)], ids=["one_rung", "ladder", "queue"])
def test_the_samplers_figure_is_the_program_it_runs(planned, new, part):
    """The round is one program, so the plan's sampler figure is the memory of the very program the sampler runs
    (found in its memo after a real round on the mesh, compiled for the same inputs): a short round at one rung,
    a long one moving down the ladder (both rungs' caches live at a move), fewer slots than rows (a queue)."""
    run, _ = planned
    pol, mesh = run.policies[0], run.placement.meshes[0]
    pol = dataclasses.replace(pol, sampling=dataclasses.replace(pol.sampling, max_new_tokens=new))
    params = run.initial_state().policies[0].params
    d, G = int(mesh.devices.size), pol.num_generations
    P, Tp = 4 * d, 8
    S = P * G // part
    ids = np.ones((P, Tp), np.int32)
    rounds.generate_slots(pol.graphdef, params, ids, ids > 0, jax.random.key(0), pol.sampling,
                                        num_samples=G, slots=S, mesh=mesh, shrink=pol.spec.sampling.ladder)
    (key,) = [k for k in rounds._PROGRAMS   # equal GraphDefs share a token: the round's width and mesh
              if k[0] == graph_token(pol.graphdef) and k[1:3] == (pol.sampling, G) and k[3][0] == S and k[4] == Tp
              and k[6] == mwra.row_sharding(mesh)]
    assert (len(key[3]) > 1) == (new > SHORT and part == 1) and (key[5] > 0) == (part > 1), key[3:6]   # rungs, admit
    repl = NamedSharding(mesh, mwra.REPLICATED)
    ids, mask = (jax.ShapeDtypeStruct((P, Tp), dt, sharding=repl) for dt in (np.int32, np.bool_))
    mem = rounds._PROGRAMS[key].lower(params, ids, mask, memory._key(mesh)).compile().memory_analysis()
    fig = memory._slot_memory(pol, mesh, params, P, Tp, S)
    assert (fig.args, fig.out, fig.temp) == (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                                             mem.temp_size_in_bytes), fig
