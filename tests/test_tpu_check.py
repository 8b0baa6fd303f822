"""benchmarks/tpu_check.py, run the first day a TPU is lent: its plumbing on the CPU backend -- random inputs of the
plan's abstract arguments, timing with donated buffers carried, the measured / estimated arithmetic per phase on a
fake estimate, the whole check on a tiny run's real programs -- and its refusal off a TPU."""
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mrl_jax.mwra.cost_model import LoopTime, StepTime

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tpu_check.py"


@pytest.fixture(scope="module")
def tpu_check():
    spec = importlib.util.spec_from_file_location("tpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tpu_check"] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("tpu_check", None)


def _sampler_estimate(prefill: float, step: float) -> StepTime:
    """A sampler's estimate: ``prefill`` seconds outside its decode loop, ``step`` per iteration (counted once)."""
    body = StepTime(fusion=step)
    return StepTime(fusion=prefill + step, open_loops=(LoopTime("while.7", body),))


def test_phase_rows_and_lines(tpu_check):
    """Measured 100 decode steps in 1.3 s, 1 step in 0.31 s: a step of 10 ms and a prefill of 0.30 s, each equal to
    the estimate; the update measured at twice its estimate."""
    M = tpu_check.Measured
    rows = tpu_check.phase_rows("a", (M(1.0, (1.0,), 0), StepTime(matmul=0.5)),
                                (M(1.3, (1.3,), 100), _sampler_estimate(0.3, 0.01)), (M(0.31, (0.31,), 1), None))
    assert [r["phase"] for r in rows] == ["update", "prefill", "decode step", "sampler"]
    assert [r["ratio"] for r in rows] == pytest.approx([2.0, 1.0, 1.0, 1.0])
    assert rows[2]["measured_s"] == pytest.approx(0.01) and rows[3]["estimated_s"] == pytest.approx(1.3)
    assert tpu_check.line(rows[0]) == ("a update: measured 1000.000 ms, estimated 500.000 ms (XLA:TPU), "
                                       "measured / estimated 2.00")
    assert tpu_check.line(rows[2]).startswith("a decode step over 100 decode steps: measured 10.000 ms")


def test_phase_rows_without_an_estimate_or_a_step(tpu_check):
    """No estimate (off TPU) and no decode step between the two sampler runs: the ratios are None, printed '-'."""
    M = tpu_check.Measured
    rows = tpu_check.phase_rows("b", (M(1.0, (1.0,), 0), None), (M(0.2, (0.2,), 1), None), (M(0.2, (0.2,), 1), None))
    assert [r["ratio"] for r in rows] == [None] * 4 and rows[2]["measured_s"] is None
    assert tpu_check.line(rows[2]) == ("b decode step over 1 decode steps: measured -, estimated - (XLA:TPU), "
                                       "measured / estimated -")


def test_random_inputs_follow_the_abstract_arguments(tpu_check):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = {"w": jax.ShapeDtypeStruct((3, 5), jnp.bfloat16, sharding=sharding),
            "ids": jax.ShapeDtypeStruct((2, 7), jnp.int32), "mask": jax.ShapeDtypeStruct((2, 7), jnp.bool_),
            "key": jax.ShapeDtypeStruct(key.shape, key.dtype)}
    got = tpu_check.random_inputs(args)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in args.items()}
    assert np.all(np.asarray(got["mask"])) and not np.any(np.asarray(got["ids"]))
    w = np.asarray(got["w"], np.float32)
    assert 0 < np.abs(w).max() < 0.2 and got["w"].sharding == sharding


def test_measure_carries_donated_buffers(tpu_check):
    """A program donating its first argument runs warm-up + repeats times on the outputs it returns."""
    f = jax.jit(lambda x, n: (x + 1, n), donate_argnums=0)
    compiled = f.lower(jnp.zeros(4), jnp.ones(())).compile()
    m = tpu_check.measure(compiled, (jnp.zeros(4), jnp.ones(())), carry=lambda a, o: (o[0], a[1]),
                          steps=lambda o: o[0][0], warmup=2, repeats=3)
    assert len(m.times_s) == 3 and m.median_s == sorted(m.times_s)[1] and m.steps == 5


def test_check_runs_a_tiny_runs_programs_on_the_cpu(tpu_check, capsys):
    """The update, the sampler at 6 tokens and at 1 of a tiny one-policy run compiled, run and timed on the CPU, the
    estimate faked: every phase measured, the decode steps counted (at most 6 with random weights' early stops)."""
    from support import tiny_config, to_run_config

    from mrl_jax.trainer.parts import build_parts

    cfg = tiny_config()
    cfg["policies"] = cfg["policies"][:1]
    parts = build_parts(to_run_config(cfg), devices=jax.devices()[:1], abstract=True)

    def fake(program, compiled):
        return StepTime(fusion=0.001) if program.name == "update" else _sampler_estimate(0.001, 0.0001)
    rows = tpu_check.check(parts, warmup=1, repeats=2, estimate=fake)
    assert [r["phase"] for r in rows] == ["update", "prefill", "decode step", "sampler"]
    assert all(r["policy"] == "llama_bpe" for r in rows)
    assert rows[0]["measured_s"] > 0 and rows[0]["ratio"] == pytest.approx(rows[0]["measured_s"] / 0.001)
    assert 1 <= rows[3]["steps"] <= 6 and rows[3]["estimated_s"] == pytest.approx(0.001 + rows[3]["steps"] * 1e-4)
    printed = capsys.readouterr().out
    assert "[tpu_check] llama_bpe update: " in printed and "[tpu_check] llama_bpe sampler at 1 tokens: " in printed


def test_off_a_tpu_it_says_so(tpu_check, capsys):
    assert tpu_check.main(["--config", "unused.yaml"]) == 0
    assert capsys.readouterr().out == (
        "tpu_check: skipped: no TPU here (jax.devices()[0].platform is 'cpu'); run it on a TPU VM, where the plan's "
        "programs run and XLA:TPU's estimate is checked\n")
