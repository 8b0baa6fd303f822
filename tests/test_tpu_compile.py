"""CI gate for TPU: a tiny two-policy run compiled for a TPU slice from this CPU by XLA:TPU (libtpu, no TPU):
every policy's update and sampler, one policy FSDP over 4 chips, the other on 2, the Pallas splash kernels on. A change that breaks TPU compilation (a kernel that does not lower, a
host callback in a step, a sharding XLA:TPU rejects) fails here."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from mrl_jax.mwra import tpu

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason=f"libtpu is not installed: {tpu.LIBTPU_INSTALL}")

TINY = {
    "seed": 0, "rounds": 1, "prompts_per_round": 4, "num_generations": 4, "eval_prompts": 4,
    "task": {"name": "arith", "seed": 0},
    "see": {"capacity": 64, "per_prompt_cap": 4, "peer_rollouts_per_prompt": 2, "peer_successes_per_prompt": 1},
    "mwra": {"min_size": 64},
    "policies": [
        {"name": "llama", "devices": [0, 1, 2, 3], "probes": "xgrpo+sgt",
         "model": {"family": "llama", "hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1},
         "tokenizer": {"kind": "byte_bpe", "vocab_size": 300}, "sampling": {"max_new_tokens": 6}},
        {"name": "gpt2", "devices": 2, "probes": "prp",
         "model": {"family": "gpt2", "hidden_size": 32, "num_layers": 1, "num_heads": 2},
         "tokenizer": {"kind": "unigram", "vocab_size": 300}, "sampling": {"max_new_tokens": 6}},
    ],
}


def _in_child(code: str, timeout: float = 600) -> dict:
    """``code`` run in a fresh Python process, its last stdout line read as JSON: libtpu is loaded there, never in
    the pytest worker (its runtime threads stay out of the process that goes on to train in other tests)."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_tiny_round_compiles_for_tpu_with_the_kernels():
    code = ("import json, sys\n"
            "from mrl_jax.configs import from_dict\n"
            "from mrl_jax.trainer.config import RunConfig\n"
            "from mrl_jax.trainer.tpu_plan import plan_for_topology\n"
            f"report = plan_for_topology(from_dict(RunConfig, {TINY!r}), 'v5e:2x4')\n"
            "print(json.dumps({'fits': report.fits, 'text': str(report), 'hbm': report.hbm_per_device,\n"
            "    'platform': report.plan.platform, 'devices': [list(p.device_ids) for p in report.plan.policies],\n"
            "    'param_count': [p.param_count for p in report.plan.policies],\n"
            "    'time': json.loads(json.dumps(report.to_dict()['time'])),\n"
            "    'figures': [dict(params=f.params, update_kernels=f.update.kernels, sampler_kernels=f.sampler.kernels,\n"
            "                     update_temp=f.update.temp, sampler_temp=f.sampler.temp, seconds=s)\n"
            "                for f, s in zip(report.memory.figures, report.memory.compile_seconds)]}))\n")
    report = _in_child(code)
    assert report["fits"], report["text"]
    assert report["devices"] == [[0, 1, 2, 3], [4, 5]]
    assert report["hbm"] == 16 << 30 and report["platform"] == "tpu"
    time = report["time"]        # XLA:TPU's estimate of every phase, in the report and in plan.json
    assert time["estimate"] == "XLA:TPU cost model" and time["round_seconds"] > 0
    assert "XLA:TPU's estimate from this machine, not a measurement" in report["text"]
    for name, t in time["policies"].items():
        assert t["update_seconds"] > 0 and t["prefill_seconds"] > 0 and t["decode_step_seconds"] > 0, name
        assert t["round_seconds"] == pytest.approx(t["update_seconds"] + t["prefill_seconds"]
                                                   + t["decode_steps"] * t["decode_step_seconds"])
        assert t["decode_steps"] == 5 and 0 <= t["idle_fraction"] < 1   # 6-token completions, a slot per row
        assert t["update"]["pallas"] > 0                                # the splash kernels priced
    assert min(t["idle_fraction"] for t in time["policies"].values()) == 0.0
    for f in report["figures"]:
        assert f["update_kernels"] > 0 and f["sampler_kernels"] > 0, f"{f}: no Pallas kernel compiled"
        assert f["update_temp"] > 0 and f["sampler_temp"] > 0
        assert f["seconds"]["update"] > 0 and f["seconds"]["sampler"] > 0
    # FSDP: less than the whole f32 model per chip
    assert report["figures"][0]["params"] < 4 * report["param_count"][0]
    text = report["text"]
    assert "verdict: fits" in text and "splash" in text and "GiB" in text


class _Chip:
    process_index = 0

    def __init__(self, i, platform="tpu"):
        self.id, self.platform = i, platform


def test_tpu_mesh_sizes_divide_the_slice():
    """XLA:TPU aborts the process compiling a collective over 6 of 8 v5e chips (libtpu's RET_CHECK
    ``total_device_count % num_participants_per_group == 0``; `test_a_mesh_that_does_not_divide_the_slice_aborts`):
    cost-sized meshes on TPU divide the device count, the freed devices go to the policy with the most cost per
    device, and a count asked for that does not divide is refused naming the policy."""
    from mrl_jax import mwra

    chips = [_Chip(i) for i in range(8)]
    cpus = [_Chip(i, "cpu") for i in range(8)]
    assert [p.num_devices for p in mwra.plan([3.0, 5.0], cpus).policies] == [3, 5]
    assert [p.num_devices for p in mwra.plan([3.0, 5.0], chips).policies] == [4, 4]      # 3 + 5 -> 2 + 4 -> 4 + 4
    # 2 + 6 -> 2 + 4, and the 2 idle devices make the cheap policy's 2 a 4
    assert [list(p.device_ids) for p in mwra.plan([1.0, 3.0], chips).policies] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p.num_devices for p in mwra.plan([1.0, 1.0, 6.0], chips).policies] == [2, 2, 4]   # 6 -> 4, the 2 freed: 1 + 1
    sizes = mwra.allocation.tpu_mesh_sizes
    assert sizes([3, 3, 1, 1], [1.0, 2.0, 3.0, 4.0], 8) == [2, 2, 2, 2]
    assert sizes([5, 2, 1], [1.0, 2.0, 3.0], 8) == [4, 2, 2]
    assert sizes([6, 6, 4], [3.0, 3.0, 2.0], 16) == [8, 4, 4]    # the 4 freed double the first costliest
    assert sizes([1, 1, 1], [1.0, 1.0, 1.0], 4) == [1, 1, 1]
    with pytest.raises(mwra.PlanError, match="'b': 3 devices on a TPU slice of 8.*one of 1, 2, 4, 8"):
        mwra.plan([1.0, 1.0], chips, names=["a", "b"], assign=[None, 3])
    with pytest.raises(mwra.PlanError, match="'a': 6 devices"):
        mwra.plan([1.0, 1.0], chips, names=["a", "b"], assign=[list(range(6)), None])


def test_a_mesh_that_does_not_divide_the_slice_aborts():
    """The libtpu fact the sizes above avoid (a subprocess: the RET_CHECK aborts the compiling process), beside a
    4-of-8 mesh that compiles."""
    code = ("import sys, numpy as np, jax, jax.numpy as jnp\n"
            "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
            "from mrl_jax.mwra import tpu\n"
            "devs = tpu.resolve('v5e-8').devices()[:int(sys.argv[1])]\n"
            "mesh = Mesh(np.array(devs), ('data',))\n"
            "x = jax.ShapeDtypeStruct((48, 128), jnp.float32, sharding=NamedSharding(mesh, P('data')))\n"
            "jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P())).lower(x).compile()\n"
            "print('compiled')\n")
    run = lambda n: subprocess.run([sys.executable, "-c", code, str(n)], capture_output=True, text=True,  # noqa
                                   timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    ok, bad = run(4), run(6)
    assert ok.returncode == 0 and "compiled" in ok.stdout, ok.stderr[-2000:]
    assert bad.returncode != 0 and "num_participants_per_group" in bad.stderr, bad.stderr[-2000:]


def test_unknown_topology_is_one_line(capsys):
    from mrl_jax.cli import main

    assert main(["plan", "--config", "experiments/configs/tiny_two_policy.yaml", "--topology", "v9-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--topology" in err[0] and "v5e-8" in err[0]


SLICES = [("v5e-8", "v5e:2x4", 8, 8), ("v5p-16", "v5p:2x2x2", 8, 8), ("v6e-1", "v6e:1x1", 1, 1),
          ("v4-8", "v4:2x2x1", 4, 8), ("V5LITEPOD-4", "v5e:2x2", 4, 4)]


def test_slice_names():
    code = ("import json\n"
            "from mrl_jax.mwra import tpu\n"
            "out = []\n"
            f"for name in {[n for n, *_ in SLICES]!r}:\n"
            "    t = tpu.resolve(name)\n"
            "    out.append([t.topology, t.chips, len(t.devices()), t.hbm_per_device, t.hbm_per_chip])\n"
            "print(json.dumps(out))\n")
    for (name, topology, chips, devices), (topo, n_chips, n_devices, per_device, per_chip) in zip(
            SLICES, _in_child(code)):
        assert (topo, n_chips, n_devices) == (topology, chips, devices), name
        assert per_device * devices == per_chip * chips, name


def test_no_libtpu_noise_where_no_tpu():
    """With libtpu installed and no TPU, the CLI's backend set-up keeps JAX off the TPU backend: no init errors
    on stderr, the CPU device."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("from mrl_jax.mwra.tpu import quiet_default_backend; quiet_default_backend(); import jax; "
            "print(jax.devices()[0].platform)")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "cpu"
    assert "TPU" not in res.stderr and "E0000" not in res.stderr, res.stderr


def test_a_program_over_the_hbm_is_a_figure_not_a_crash():
    """XLA:TPU refuses to compile a program past the chip's HBM (seen: the sampler of a 1.7B policy, 64 x 8 rows of
    3072 tokens on v5e-8, "temporaries (35.88G) exceeds available HBM (15.75G)"): the step's figure is then the
    error's, marked exhausted, so the plan reports a misfit with its fixes instead of stopping."""
    import jax
    import jax.numpy as jnp

    from mrl_jax.mwra.memory_plan import exhausted_bytes, step_memory

    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (35.88G) "
           "exceeds available HBM (15.75G).")

    class Refused:
        def lower(self, *args):
            return self

        def compile(self):
            raise jax.errors.JaxRuntimeError(msg)

    arg = jax.ShapeDtypeStruct((1024,), jnp.float32)
    mem = step_memory(Refused(), arg)
    assert mem.exhausted and mem.temp == int(35.88 * 2 ** 30) and mem.args == 4096 and mem.peak > 35 * 2 ** 30
    assert exhausted_bytes("INTERNAL: something else") is None
    # the other form (seen: the Qwen3-1.7B + Llama-3.2-1B pair's update on v5e-8): everything the program needs
    used = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
            "memory space hbm. Used 15.77G of 15.75G hbm. Exceeded hbm capacity by 22.67M.\n\nTotal hbm usage >= "
            "10.34G:\n    reserved        258.00M \n    program           9.52G \n")
    assert exhausted_bytes(used) == int(15.77 * 2 ** 30)
    assert exhausted_bytes(used, args=2 ** 30) == int(15.77 * 2 ** 30) - 2 ** 30

    class RefusedToo(Refused):
        def compile(self):
            raise jax.errors.JaxRuntimeError(used)

    mem = step_memory(RefusedToo(), arg)
    assert mem.exhausted and mem.peak == int(15.77 * 2 ** 30)


@pytest.mark.parametrize("chips", [1, 2])
def test_the_slot_samplers_decode_compiles_the_paged_kernel_for_tpu(chips):
    """The slot sampler's decode loop (its round's steps at one rung) compiled for v5e chips with ``attention:
    splash``: a head dim of 128 runs JAX's Pallas paged attention kernel in every decode step (a Mosaic custom call
    in the compiled program; on 2 chips under ``shard_map``, slots split); 64-wide heads keep ours (no kernel
    call)."""
    code = ("import json, sys, numpy as np, jax\n"
            "from flax import nnx\n"
            "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
            "from mrl_jax import models\n"
            "from mrl_jax.mwra import tpu, row_sharding\n"
            "from mrl_jax.sampler import SamplingConfig\n"
            "from mrl_jax.sampler import slots as slot_sampler\n"
            "from mrl_jax.models import splash\n"
            f"mesh = Mesh(np.array(tpu.resolve('v5e-8').devices()[:{chips}]), ('data',))\n"
            "rows, repl = row_sharding(mesh), NamedSharding(mesh, P())\n"
            "out = {}\n"
            "for hidden in (256, 128):\n"
            "    m = models.abstract_model(models.tiny_config('llama', 300, hidden_size=hidden, num_heads=2,\n"
            "                                                  num_kv_heads=1, attention='splash'))\n"
            "    g, params = nnx.split(m)\n"
            "    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl), params)\n"
            "    cfg = SamplingConfig(max_new_tokens=24, eos_id=2, pad_id=0)\n"
            "    ids = jax.ShapeDtypeStruct((2, 8), np.int32, sharding=repl)\n"
            "    mask = jax.ShapeDtypeStruct((2, 8), np.bool_, sharding=repl)\n"
            "    key = jax.eval_shape(lambda: jax.random.key(0))\n"
            "    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=repl)\n"
            "    with splash.on_mesh(mesh):\n"
            "        start = jax.jit(lambda p, i, k_, s: slot_sampler._start(g, p, i, k_, s, cfg, num_samples=4,\n"
            "                        slots=4, width=8, rows=rows))\n"
            "        shapes = jax.eval_shape(start, params, ids, mask, key)[:2]\n"
            "        c0 = start.lower(params, ids, mask, key).compile()\n"
            "        pr, st = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,\n"
            "                              c0.output_shardings[:2])\n"
            "        loop = jax.jit(lambda p, a, b: slot_sampler._decode(nnx.merge(g, p), a, b, cfg, 4, 4, rows, None))\n"
            "        text = loop.lower(params, pr, st).compile().as_text()\n"
            "    out[hidden // 2] = {'paged': text.count('tpu_custom_call'), 'paged_cache': st.cache.paged}\n"
            "print(json.dumps(out))\n")
    out = _in_child(code)
    assert out["128"]["paged_cache"] and out["64"]["paged_cache"], out
    assert out["128"]["paged"] > 0 and out["64"]["paged"] == 0, out
