"""The round's time from priced programs (`mrl_jax.trainer.time_plan`) and MWRA by estimated time
(`mrl_jax.mwra.allocations_by_time`): analytic values on hand-made `StepTime`s, no compile."""
import pytest

from mrl_jax.mwra.allocation import allocations_by_time
from mrl_jax.mwra.cost_model import CHIPS, LoopTime, StepTime
from mrl_jax.trainer.time_plan import PolicyTime, RoundShape, model_flops, round_time, scaled_round_seconds

CHIP = CHIPS["v5e"]


def shape(**kw) -> RoundShape:
    base = dict(name="p", devices=2, rows=64, prompt_width=100, completion_length=100, slots=16, micro_batches=4,
                iterations=2, reference_forward=True, matmul_params=10 ** 9, layers=10, heads=8, head_dim=64,
                kv_bytes_per_token=40960, weight_bytes=10 ** 9)
    return RoundShape(**{**base, **kw})


def policy(update=2.0, prefill=0.5, step=0.01, collective=0.0, **kw) -> PolicyTime:
    decode = StepTime(fusion=step)
    sampler = StepTime(fusion=prefill + step, open_loops=(LoopTime("while.1", decode),))
    return PolicyTime(shape=shape(**kw), chip=CHIP, update=StepTime(matmul=update - collective, collective=collective),
                      sampler=sampler)


def test_the_sampler_splits_into_prefill_and_decode_steps():
    p = policy()
    assert p.prefill.seconds == pytest.approx(0.5) and p.decode_step.seconds == pytest.approx(0.01)
    # 64 rows in 16 slots: at full length the rows queue (64 x 99 / 16 steps), at a short mean the longest row sets it
    assert p.decode_steps() == 396 and p.decode_steps(10) == 99 and p.decode_steps(1000) == 396
    assert p.round_seconds() == pytest.approx(2.0 + 0.5 + 396 * 0.01)
    assert policy(slots=64).decode_steps() == 99          # a slot per row: the completion length sets it
    assert p.micro_batch_seconds == pytest.approx(2.0 / 8)


def test_mfu_counts_model_flops_not_recompute():
    s = shape()
    t = 200
    per_pass = 2.0 * 1e9 * t * 64 + 2.0 * 10 * 8 * 64 * t * t * 64
    assert model_flops(s) == pytest.approx(2 * 3 * per_pass + per_pass)
    assert model_flops(shape(reference_forward=False, iterations=1)) == pytest.approx(3 * per_pass)
    p = policy()
    assert p.mfu() == pytest.approx(model_flops(s) / (2.0 * CHIP.peak_flops * 2))


def test_decode_roofline_fraction_is_weights_and_cache_over_the_step():
    p = policy()
    cache = 16 * (100 + 50) * 40960 / 2
    assert p.decode_roofline_fraction() == pytest.approx((1e9 + cache) / CHIP.hbm_bytes_per_s / 0.01)


def test_idle_fraction_per_sub_mesh_and_time_shared_devices():
    slow, fast = policy(update=3.0, name="a"), policy(update=1.0, name="b")
    r = round_time([slow, fast], [(0, 1), (2, 3)])
    assert r.seconds == pytest.approx(slow.round_seconds())
    assert r.idle()[0] == 0.0
    assert r.idle()[1] == pytest.approx(1 - fast.round_seconds() / slow.round_seconds())
    shared = round_time([slow, fast], [(0, 1), (0, 1)])      # one after the other on the same devices
    assert shared.seconds == pytest.approx(slow.round_seconds() + fast.round_seconds())
    assert shared.idle() == (0.0, 0.0)
    d = r.to_dict()
    assert d["estimate"] == "XLA:TPU cost model" and set(d["policies"]) == {"a", "b"}
    assert d["policies"]["b"]["idle_fraction"] == pytest.approx(r.idle()[1])


def test_scaled_round_splits_compute_and_rescales_collectives():
    p = policy(collective=0.4)                             # compiled on 2 devices
    steps = p.decode_steps()
    compute = 2.0 - 0.4 + 0.5 + steps * 0.01
    assert scaled_round_seconds(p, 2) == pytest.approx(p.round_seconds())
    assert scaled_round_seconds(p, 4) == pytest.approx(compute / 2 + 0.4 * (3 / 4) / (1 / 2))
    one = policy(devices=1)                                # from one device: the FSDP gathers n > 1 adds
    assert scaled_round_seconds(one, 4) == pytest.approx(
        (2.0 + 0.5 + steps * 0.01) / 4 + (3 + steps) * 1e9 * 3 / 4 / CHIP.ici_bytes_per_s)


def test_allocations_by_time_minimise_the_slowest_and_respect_memory():
    work = [3.0, 1.0]
    found = allocations_by_time(lambda i, n: work[i] / n, 2, 8)
    assert found[0].sizes == (4, 2) and found[0].round_seconds == 0.75   # ties (4, 4): fewer devices first
    assert found[1].sizes == (4, 4)
    assert all(sum(a.sizes) <= 8 and all(8 % n == 0 for n in a.sizes) for a in found)
    assert [a.round_seconds for a in found] == sorted(a.round_seconds for a in found)
    # policy 0 does not fit below 4 devices: no allocation gives it fewer
    fit = allocations_by_time(lambda i, n: None if i == 0 and n < 4 else work[i] / n, 2, 8)
    assert all(a.sizes[0] >= 4 for a in fit)
    # a slice of 6: sizes divide 6 (1, 2, 3, 6), never 4
    six = allocations_by_time(lambda i, n: work[i] / n, 2, 6)
    assert six[0].sizes == (3, 1) and six[1].sizes == (3, 2) and all(6 % n == 0 for a in six for n in a.sizes)
    assert allocations_by_time(lambda i, n: None, 2, 8) == []
