"""The cost model of a compiled TPU program (`mrl_jax.mwra.cost_model`) on programs whose cost is known, compiled
by XLA:TPU from this CPU (libtpu, deviceless): a large matmul near the chip's peak, an HBM-bound matvec near its
bandwidth, a scan of k layers k times one iteration reading each layer of its stack once, a Pallas kernel at its
roofline, an all-gather by its bytes, and the physical bound as a property. Compiled in one child process (libtpu
stays out of the pytest worker)."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mrl_jax.mwra import cost_model as cm
from mrl_jax.mwra import tpu

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason=f"libtpu is not installed: {tpu.LIBTPU_INSTALL}")

_CHILD = textwrap.dedent('''
    import json
    import jax, jax.numpy as jnp
    from hypothesis import given, settings, strategies as st, HealthCheck
    from jax.experimental import pallas as pl
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from mrl_jax.mwra import tpu, cost_model as cm

    out = {}
    dev = tpu.resolve("v5e-4").devices()
    chip = cm.for_device(dev[0])
    one = NamedSharding(Mesh(dev[:1], ("d",)), P())
    def spec(shape, dt=jnp.bfloat16, sh=one):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    def est(f, *args):
        c = jax.jit(f).lower(*args).compile()
        return cm.estimate(c, chip), c.cost_analysis()["optimal_seconds"]

    t, _ = est(lambda a, b: a @ b, spec((8192, 8192)), spec((8192, 8192)))
    out["matmul"] = dict(seconds=t.seconds, matmul=t.matmul, flops=t.flops)
    t, _ = est(lambda a, b: a @ b, spec((16, 4096)), spec((4096, 57344)))
    out["matvec"] = dict(seconds=t.seconds, hbm_bytes=t.hbm_bytes)

    def layer(x, w):
        return jnp.tanh(x @ w), None
    out["scan"] = {k: est(lambda x, ws: jax.lax.scan(layer, x, ws)[0], spec((4096, 2048)),
                          spec((k, 2048, 2048)))[0].seconds for k in (2, 4, 8, 16)}
    def matvec_layer(x, w):   # HBM-bound: each iteration reads its layer of the stack and writes its output row
        y = jnp.tanh(x @ w)
        return y, y
    out["stacked"] = {k: est(lambda x, ws: jax.lax.scan(matvec_layer, x, ws), spec((8, 4096)),
                             spec((k, 4096, 4096)))[0].hbm_bytes for k in (4, 16)}
    def open_loop(x, w):   # a data-dependent loop of the same layer: priced once, its iteration listed
        return jax.lax.while_loop(lambda c: jnp.sum(c[1]) < 1e30, lambda c: (layer(c[0], w)[0], c[1] + 1.0),
                                  (x, jnp.zeros((), jnp.float32)))[0]
    t, _ = est(open_loop, spec((4096, 2048)), spec((2048, 2048)))
    out["open_loop"] = dict(seconds=t.seconds, loops=[lp.per_iteration.seconds for lp in t.open_loops])

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2
    def call(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
                              in_specs=[pl.BlockSpec((512, 1024), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((512, 1024), lambda i: (i, 0)),
                              cost_estimate=pl.CostEstimate(flops=3 * 10**12, transcendentals=0,
                                                            bytes_accessed=2 * 4096 * 1024 * 4))(x)
    t, _ = est(call, spec((4096, 1024), jnp.float32))
    out["pallas"] = dict(seconds=t.seconds, pallas=t.pallas, flops=t.flops)

    mesh4 = Mesh(dev, ("d",))
    rows, repl = NamedSharding(mesh4, P("d")), NamedSharding(mesh4, P())
    c = jax.jit(lambda a: a * 2, out_shardings=repl).lower(spec((4096, 8192), sh=rows)).compile()
    t = cm.estimate(c, chip)
    out["all_gather"] = dict(collective=t.collective, collective_bytes=t.collective_bytes)

    bad = []
    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(m=st.sampled_from([8, 128, 384, 1024, 3000]), k=st.sampled_from([128, 640, 2048]),
           n=st.sampled_from([128, 1000, 4096]), steps=st.integers(1, 6), f32=st.booleans(),
           kind=st.sampled_from(["matmul", "elementwise", "reduce", "scan"]))
    def bound(m, k, n, steps, f32, kind):
        dt = jnp.float32 if f32 else jnp.bfloat16
        b = 4 if f32 else 2
        if kind == "matmul":    # (flops, bytes) each program needs at least: its inputs read, its output written
            f, args, need = (lambda a, b: jnp.tanh(a @ b)), (spec((m, k), dt), spec((k, n), dt)), \
                (2 * m * k * n, b * (m * k + k * n + m * n))
        elif kind == "elementwise":
            f, args, need = (lambda a: jnp.exp(a) * 3 + 1), (spec((m, n), dt),), (0, 2 * b * m * n)
        elif kind == "reduce":
            f, args, need = (lambda a: jnp.sum(a * a, axis=-1)), (spec((m, n), dt),), (0, b * (m * n + m))
        else:
            f = lambda x, ws: jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
            args, need = (spec((m, k), dt), spec((steps, k, k), dt)), (2 * m * k * k * steps,
                                                                       b * (steps * k * k + 2 * m * k))
        t, _ = est(f, *args)
        roofline = max(need[0] / chip.peak_flops, need[1] / chip.hbm_bytes_per_s)
        if t.seconds < roofline * (1 - 1e-9) or t.seconds < t.roofline(chip) * (1 - 1e-9) or t.flops < need[0]:
            bad.append(dict(kind=kind, m=m, k=k, n=n, steps=steps, f32=f32, seconds=t.seconds, roofline=roofline,
                            flops=t.flops))
    bound()
    out["below_roofline"] = bad
    out["chip"] = chip._asdict()
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def priced() -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_chip_table_is_per_device_and_sourced():
    assert set(cm.CHIPS) == {"v4", "v5e", "v5p", "v6e"}
    for chip in cm.CHIPS.values():
        assert chip.source.startswith("https://cloud.google.com/tpu/docs/")
        assert chip.peak_flops > 1e14 and chip.hbm_bytes_per_s > 5e11 and chip.ici_bytes_per_s > 1e11
    half = cm.CHIPS["v4"].share(0.5)
    assert half.peak_flops == cm.CHIPS["v4"].peak_flops / 2 and half.clock_hz == cm.CHIPS["v4"].clock_hz


@needs_libtpu
def test_a_large_matmul_is_near_the_peak(priced):
    peak = 2 * 8192 ** 3 / cm.CHIPS["v5e"].peak_flops
    m = priced["matmul"]
    assert m["flops"] == 2 * 8192 ** 3            # counted from the convolution's shapes
    assert m["seconds"] == m["matmul"]
    assert 0.80 <= peak / m["seconds"] <= 1.0     # XLA:TPU: 88 % of peak


@needs_libtpu
def test_a_matvec_is_bound_by_hbm(priced):
    weights = 4096 * 57344 * 2
    t = priced["matvec"]
    assert t["hbm_bytes"] >= weights
    assert 0.6 <= weights / cm.CHIPS["v5e"].hbm_bytes_per_s / t["seconds"] <= 1.0   # XLA:TPU: 74 % of HBM


@needs_libtpu
def test_a_scan_of_k_layers_is_k_iterations(priced):
    scan = {int(k): v for k, v in priced["scan"].items()}
    per_iteration = priced["open_loop"]["loops"][0]
    for k in (4, 8, 16):
        assert scan[k] / scan[k // 2] == pytest.approx(2.0, rel=0.05)
        assert scan[k] == pytest.approx(k * per_iteration, rel=0.05)
    # the data-dependent loop is listed with its iteration and counted once
    assert len(priced["open_loop"]["loops"]) == 1
    assert priced["open_loop"]["seconds"] >= per_iteration


@needs_libtpu
def test_a_scan_reads_each_layer_of_its_stack_once(priced):
    """Each iteration slices its layer out of the stacked weights and writes its row of the stacked outputs in
    place: k layers read, not k times the whole stack."""
    layer = 4096 * 4096 * 2
    for k, nbytes in priced["stacked"].items():
        assert int(k) * layer <= nbytes <= 1.1 * int(k) * layer


@needs_libtpu
def test_a_pallas_kernel_is_priced_at_its_roofline(priced):
    p = priced["pallas"]
    chip = cm.CHIPS["v5e"]
    roofline = max(3e12 / chip.peak_flops, 2 * 4096 * 1024 * 4 / chip.hbm_bytes_per_s)
    assert p["flops"] == 3e12                     # its declared pl.CostEstimate
    assert p["pallas"] >= roofline * (1 - 1e-9) and p["pallas"] > 80 / chip.clock_hz * 100


@needs_libtpu
def test_an_all_gather_is_priced_by_its_bytes(priced):
    full = 4096 * 8192 * 2                        # the gathered array; each of 4 devices receives 3/4 of it
    g = priced["all_gather"]
    assert g["collective_bytes"] == pytest.approx(full * 3 / 4)
    assert g["collective"] == pytest.approx(full * 3 / 4 / cm.CHIPS["v5e"].ici_bytes_per_s)


@needs_libtpu
def test_no_program_is_estimated_below_its_roofline(priced):
    assert priced["below_roofline"] == []


def test_splash_and_paged_kernels_are_priced_from_their_shapes():
    q, k = ("bf16", (2, 8, 256, 128), True), ("bf16", (2, 2, 256, 128), True)
    fwd, nbytes = cm.kernel_cost("splash_mha_fwd_segmented_residuals.3", [None, q, k, k], [q])
    causal_pairs = 256 * 257 / 2
    assert fwd == 2 * (2.0 * 2 * 8 * causal_pairs * 128)
    assert nbytes == 2 * (2 * 8 * 256 * 128 * 2) + 2 * (2 * 2 * 256 * 128 * 2)
    dq, _ = cm.kernel_cost("splash_mha_dq_no_residuals", [q, k, k], [q])
    dkv, _ = cm.kernel_cost("splash_mha_dkv_no_residuals", [q, k, k], [q])
    assert (dq, dkv) == (1.5 * fwd, 2 * fwd)
    # prefix at an offset: 128 queries ending at key 384 see the 256 before them and their own triangle
    q2 = ("bf16", (1, 1, 128, 64), True)
    k2 = ("bf16", (1, 1, 384, 64), True)
    f2, _ = cm.kernel_cost("splash_mha_fwd", [q2, k2, k2], [q2])
    assert f2 == 2 * 2.0 * (128 * 256 + 128 * 129 / 2) * 64
    # paged decode: 16 sequences x 8 heads, each over 4 pages of 16 tokens of 2 kv heads
    qd, pages, table = ("bf16", (16, 8, 128), True), ("bf16", (2, 64, 16, 128), True), ("s32", (16, 4), True)
    fd, bd = cm.kernel_cost("paged_attention.1", [qd, pages, pages, ("s32", (16,), True), table], [qd])
    assert fd == 4.0 * 16 * 8 * 128 * 64
    assert bd == 2 * 2 * 64 * 128 * 2 * 16 + 2 * (16 * 8 * 128 * 2)


def test_a_batched_matmul_written_as_a_dilated_convolution_counts_its_real_taps():
    """XLA:TPU writes a batched dot as a convolution whose batch dimensions are spatial, dilated so that one tap
    of each window meets an input element: bqkgd,bskd->bkgqs of 16 x 14 heads x 512 x 512 over 64 (from the
    update of RESULTS 10a) is 2 * 16 * 14 * 512 * 512 * 64 FLOPs, not 224 times that."""
    attrs = ("window={size=16x2x7 stride=15x1x1 pad=0_0x0_0x6_6 lhs_dilate=16x2x1 rhs_reversal=0x0x1}, "
             "dim_labels=0b1f2_0o12i->01bf2")
    assert cm._window_taps(attrs, (16, 512, 2, 64, 1), "0b1f2", (16, 2, 512, 512, 7), "01bf2") == 16 * 2 * 7
    # a plain convolution: every tap of the window meets the input (3 x 3, stride 1, no padding)
    plain = "window={size=3x3}, dim_labels=b01f_01io->b01f"
    assert cm._window_taps(plain, (1, 10, 10, 4), "b01f", (1, 8, 8, 4), "b01f") == 8 * 8 * 9
    # padding: the taps that fall on the pad meet nothing (1-d, size 3, pad 1 each side, 4 outputs over 4 inputs)
    padded = "window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f"
    assert cm._window_taps(padded, (1, 4, 2), "b0f", (1, 4, 2), "b0f") == 3 * 4 - 2


_SLICED = '''HloModule m

%copy_body (p: f32[8,1024]) -> f32[8,1024] {
  %p = f32[8,1024]{1,0} parameter(0)
  ROOT %c = f32[8,1024]{1,0} copy(%p)
}

%fused (param_0: f32[8,1024], param_1: s32[]) -> f32[1,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %inner = f32[8,1024]{1,0} fusion(%param_0), kind=kLoop, calls=%copy_body
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%inner, %param_1, %z), dynamic_slice_sizes={1,1024}
}

%update (param_0: f32[8,1024], param_1: f32[1,1024], param_2: s32[]) -> f32[8,1024] {
  %param_0 = f32[8,1024]{1,0} parameter(0)
  %param_1 = f32[1,1024]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%param_0, %param_1, %param_2, %z)
}

ENTRY %main (a: f32[8,1024], i: s32[]) -> f32[8,1024] {
  %a = f32[8,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %f = f32[1,1024]{1,0} fusion(%a, %i), kind=kLoop, calls=%fused, backend_config={"window_config":{"estimated_cycles":"10"}}
  ROOT %g = f32[8,1024]{1,0} fusion(%a, %f, %i), kind=kLoop, calls=%update, backend_config={"window_config":{"estimated_cycles":"10"}}
}
'''


def test_a_slice_through_a_copy_reads_the_slice_and_an_in_place_update_writes_the_update():
    row = 1024 * 4
    t = cm.estimate(_SLICED, cm.CHIPS["v5e"])
    # the slice: one row read (through the nested copy), one written, the index; the update: one row read and
    # written, the index (its buffer neither read nor written whole)
    assert t.hbm_bytes == (2 * row + 4) + (2 * row + 4)
