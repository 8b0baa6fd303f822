"""Real model shapes compiled for TPU slices from this CPU (XLA:TPU via libtpu; no TPU, nothing allocated).

Each case is `mrl plan` on a run config whose policies point at shape-only model directories (a Hugging Face
``config.json`` of the real model and a small byte-level ``tokenizer.json``; no weights: the plan reads
``config.json`` only) and a task of prompts long enough to fill ``max_prompt_length``; the figures are XLA:TPU's
per-device ``memory_analysis()`` (exact, load-independent) and each program's compile time (the machine's
load is printed beside it). Case ``a`` compiles the update alone (as ``bench_memory.py``) with our attention
and with the splash kernels.

    python benchmarks/bench_tpu.py --cases a,b,c,d,e      # RESULTS section 10
    python benchmarks/bench_tpu.py --cases c --work /tmp/tpu_shapes

  a  Qwen2.5-0.5B update, 16 x (256 + 4096), remat full, bf16: ours (blockwise) vs splash, one chip of v5e / v5p / v6e
  b  experiments/configs/real_checkpoints.yaml (Qwen2.5-0.5B + SmolLM2-360M, 64 x G 8, 512 + 512) on v5e-8
  c  Qwen3-1.7B + Llama-3.2-1B, 64 prompts x G 8, 1024 + 2048 tokens, on v5e-8
  d  Llama-3.1-8B alone, 8-way FSDP (v5p-16: 8 chips), 16 prompts x G 8, 1024 + 1024
  e  Llama-3.1-8B LoRA (bf16 base), 64 prompts x G 8, 1024 + 4096, on v5e-8: the slot count S the plan picks
  f  Llama-3.1-8B on v6e-4, 16 concurrent rows (4 prompts x G 4), 512 + 512: the decode step (TPOT)

Every case also prints XLA:TPU's estimate of each program's time (`mrl_jax.mwra.cost_model`; an estimate, never
a measurement): per policy the update (MFU), prefill, decode step and round, the idle fraction per sub-mesh, and
for case a the update's step time, MFU and breakdown.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HF_SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6),
    "smollm2-360m": dict(model_type="llama", vocab_size=49152, hidden_size=960, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, intermediate_size=2560, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=6144,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                              high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                              high_freq_factor=4.0,
                                                              original_max_position_embeddings=8192)),
}
_GRPO = {"loss_type": "dr_grpo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0}


def shape_dir(work: Path, name: str) -> Path:
    """``work/name``: the model's config.json and a 512-entry byte-level BPE tokenizer.json (made once)."""
    d = work / name
    if (d / "tokenizer.json").is_file():
        return d
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(HF_SHAPES[name], bos_token_id=0, eos_token_id=1)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"what is {a} plus {b}? the answer is {a + b}." for a in range(60) for b in range(60)],
                            trainer)
    tok.save(str(d / "tokenizer.json"))
    return d


def long_prompts(work: Path, n: int = 256) -> Path:
    """A jsonl task of ``n`` prompts far longer than any max_prompt_length (truncated to it)."""
    path = work / "long_prompts.jsonl"
    if not path.is_file():
        words = "the quick brown fox jumps over the lazy dog and counts to ten".split()
        with path.open("w") as f:
            for i in range(n):
                text = " ".join(words[(i + j) % len(words)] for j in range(3000)) + f" what is {i} plus 1?"
                f.write(json.dumps({"prompt": text, "answer": str(i + 1)}) + "\n")
    return path


def policy(work: Path, name: str, shape: str, Tp: int, Tc: int, micro_batch: int = 0, probes: str = "xgrpo+sgt",
           lora_rank: int = 0) -> dict:
    return {"name": name, "model": {"path": str(shape_dir(work, shape)), "dtype": "bfloat16", "remat": "full"},
            "max_prompt_length": Tp, "sampling": {"max_new_tokens": Tc},
            "optimizer": {"learning_rate": 1e-6, "micro_batch_size": micro_batch}, "grpo": dict(_GRPO),
            "probes": probes, "lora": {"rank": lora_rank, "alpha": 2 * max(lora_rank, 1)}}


def run_config(work: Path, policies: list, P: int, G: int) -> dict:
    return {"seed": 0, "rounds": 10, "prompts_per_round": P, "num_generations": G, "eval_prompts": 8,
            "overlong_prompts": "truncate", "task": {"name": "jsonl", "path": str(long_prompts(work)), "seed": 0},
            "see": {"capacity": 4096, "per_prompt_cap": 32, "peer_rollouts_per_prompt": 8,
                    "peer_successes_per_prompt": 2}, "policies": policies}


def plan_case(label: str, cfg: dict, topology: str) -> dict:
    from mrl_jax.configs import from_dict
    from mrl_jax.trainer.config import RunConfig
    from mrl_jax.trainer.tpu_plan import plan_for_topology

    t0 = time.perf_counter()
    report = plan_for_topology(from_dict(RunConfig, cfg), topology)
    print(report, flush=True)
    out = {"case": label, "topology": topology, "wall_s": round(time.perf_counter() - t0, 1),
           "load_1min": os.getloadavg()[0], "fits": report.fits, "misfits": list(report.memory.misfits),
           "policies": {f.name: {"devices": list(p.device_ids), "total_gib": round(f.total / 2 ** 30, 2),
                                 "update_peak_gib": round(f.update.peak / 2 ** 30, 2),
                                 "sampler_peak_gib": round(f.sampler.peak / 2 ** 30, 2),
                                 "state_gib": round(f.state / 2 ** 30, 2), "kernels": f.update.kernels,
                                 "slots": f.slots,
                                 "compile_s": {k: round(v, 1) for k, v in s.items()}}
                        for p, f, s in zip(report.plan.policies, report.memory.figures, report.memory.compile_seconds)}}
    if report.time is not None:
        out["round_s"] = report.time.seconds
        out["time"] = {p.shape.name: dict(update_s=p.update.seconds, mfu=p.mfu(), prefill_s=p.prefill.seconds,
                                          decode_step_s=p.decode_step.seconds, slots=p.shape.slots,
                                          decode_roofline=p.decode_roofline_fraction(), round_s=p.round_seconds(),
                                          idle=idle, shares=p.shares(), update=_breakdown(p.update))
                       for p, idle in zip(report.time.policies, report.time.idle())}
        out["allocations"] = [[list(a.sizes), a.round_seconds] for a in report.allocations[:5]]
    print(json.dumps(out), flush=True)
    return out


def _breakdown(t) -> dict:
    """A `StepTime`'s seconds by kind of op."""
    return {k: getattr(t, k) for k in ("matmul", "fusion", "pallas", "collective", "copy")}


def case_a(work: Path) -> list:
    """The update alone on one chip: ours (blockwise) vs splash."""
    import numpy as np
    import jax

    from benchmarks.bench_memory import SHAPES
    from mrl_jax.models.config import ModelConfig
    from mrl_jax.mwra import tpu

    out = []
    for topo in ("v5e-1", "v5p-8", "v6e-1"):
        device = tpu.resolve(topo).devices()[:1]
        for attention in ("blockwise", "splash"):
            cfg = ModelConfig(family="llama", **SHAPES["qwen2.5-0.5b"], dtype="bfloat16", param_dtype="bfloat16",
                              remat="full", attention=attention)
            t0 = time.perf_counter()
            m = _update_memory(cfg, 2, 8, 256, 4096, jax.sharding.Mesh(np.array(device), ("data",)))
            t = m.pop("time")
            rec = {"case": "a", "topology": topo, "attention": attention, "compile_s": round(time.perf_counter() - t0, 1),
                   "load_1min": os.getloadavg()[0], **{k: round(v / 2 ** 30, 2) if k != "kernels" else v
                                                       for k, v in m.items()},
                   "step_s": t.seconds, "mfu": _update_mfu(cfg, 2, 8, 256, 4096, t, device[0]), **_breakdown(t)}
            print(json.dumps(rec), flush=True)
            out.append(rec)
    return out


def _update_memory(config, P: int, G: int, Tp: int, Tc: int, mesh) -> dict:
    """The update's compiled memory (GiB fields) on ``mesh``: bench_memory's program, placed on the TPU device."""
    import jax
    from flax import nnx

    from mrl_jax import learner, see
    from mrl_jax.models.factory import abstract_model
    from mrl_jax.mwra import sharding
    from mrl_jax.mwra.memory_plan import step_memory, tree_bytes
    from mrl_jax.trainer.memory import abstract_rows, placed
    from mrl_jax.trainer.placement import on_mesh

    graphdef, params = nnx.split(abstract_model(config))
    opt = learner.make_optimizer(1e-6)
    opt_state = jax.eval_shape(opt.init, params)
    update = learner.make_update_step(graphdef, opt, "none", learner.GRPOConfig(num_generations=G,
                                                                               max_completion_length=Tc, beta=0.0),
                                      jit=False)
    ps = sharding.param_shardings(params, mesh)
    put = lambda t, s: jax.tree.map(lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=y), t, s)  # noqa
    params, opt_state = put(params, ps), put(opt_state, sharding.opt_state_shardings(opt_state, ps, mesh))
    view = jax.eval_shape(lambda: see.empty_view(P, 1, Tc, Tc, 2))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    args = (params, opt_state, placed(abstract_rows(P, G, Tp, Tc), mesh), placed(view, mesh), placed(key, mesh))
    mem = step_memory(jax.jit(on_mesh(mesh, update), donate_argnums=(0, 1)), *args)
    return dict(temp=mem.temp, total=mem.peak, state=tree_bytes(params) + tree_bytes(opt_state), kernels=mem.kernels,
                time=mem.time)


def _update_mfu(config, P: int, G: int, Tp: int, Tc: int, t, device) -> float:
    """The update's model FLOPs (`time_plan.model_flops`: no reference, one iteration) over the chip's peak for
    its estimated time ``t``."""
    from mrl_jax.mwra.cost_model import for_device
    from mrl_jax.trainer.time_plan import RoundShape, model_flops

    lookup = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    params = _param_count(config) - lookup
    shape = RoundShape(name="update", devices=1, rows=P * G, prompt_width=Tp, completion_length=Tc, slots=P * G,
                       micro_batches=1, iterations=1, reference_forward=False, matmul_params=params,
                       layers=config.num_layers, heads=config.num_heads, head_dim=config.head_dim, kv_bytes_per_token=0,
                       weight_bytes=0)
    return model_flops(shape) / (t.seconds * for_device(device).peak_flops)


def _param_count(config) -> int:
    import jax
    import numpy as np
    from flax import nnx

    from mrl_jax.models.factory import abstract_model

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract_model(config)))))


def case_b(work: Path) -> dict:
    cfg = yaml.safe_load((REPO / "experiments/configs/real_checkpoints.yaml").read_text())
    for pol, shape in zip(cfg["policies"], ("qwen2.5-0.5b", "smollm2-360m")):
        pol["model"]["path"] = str(shape_dir(work, shape))
    cfg["task"] = {"name": "jsonl", "path": str(long_prompts(work)), "seed": 0}
    cfg["overlong_prompts"] = "truncate"
    return plan_case("b", cfg, "v5e-8")


def case_c(work: Path) -> dict:
    pols = [policy(work, "qwen3_1_7b", "qwen3-1.7b", 1024, 2048), policy(work, "llama3_2_1b", "llama-3.2-1b", 1024, 2048)]
    return plan_case("c", run_config(work, pols, 64, 8), "v5e-8")


def case_d(work: Path) -> dict:
    return plan_case("d", run_config(work, [policy(work, "llama3_1_8b", "llama-3.1-8b", 1024, 1024, probes="none")],
                                     16, 8), "v5p-16")


def case_e(work: Path) -> dict:
    """The slots issue's shape: the sampler's KV cache at every row (512 x 5120 tokens x 128 KiB) is ~320 GiB,
    so the plan picks S; the update micro-batched (8 rows) over a LoRA policy on the bf16 base."""
    pol = policy(work, "llama3_1_8b", "llama-3.1-8b", 1024, 4096, micro_batch=8, probes="none", lora_rank=16)
    return plan_case("e", run_config(work, [pol], 64, 8), "v5e-8")


def case_f(work: Path) -> dict:
    """Decode at sglang-jax's published shape: 16 concurrent rows (4 prompts x G 4) of 512 + 512 tokens on v6e-4."""
    pol = policy(work, "llama3_1_8b", "llama-3.1-8b", 512, 512, probes="none")
    return plan_case("f", run_config(work, [pol], 4, 4), "v6e-4")


CASES = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f}


def run(quick: bool = False, work: Path | None = None) -> dict:
    """``mrl bench --only tpu``: cases a-d (hours of compiles on 2 cores); quick: Qwen2.5-0.5B's update at
    256 + 1024 tokens on one v5e chip, ours vs splash."""
    work = work or Path("runs/tpu_shapes")
    work.mkdir(parents=True, exist_ok=True)
    if not quick:
        return {c: CASES[c](work) for c in CASES}
    import jax
    import numpy as np

    from benchmarks.bench_memory import SHAPES
    from mrl_jax.models.config import ModelConfig
    from mrl_jax.mwra import tpu

    mesh = jax.sharding.Mesh(np.array(tpu.resolve("v5e-1").devices()), ("data",))
    out = {}
    for attention in ("blockwise", "splash"):
        cfg = ModelConfig(family="llama", **SHAPES["qwen2.5-0.5b"], dtype="bfloat16", param_dtype="bfloat16",
                          remat="full", attention=attention)
        m = _update_memory(cfg, 2, 8, 256, 1024, mesh)
        t = m.pop("time")
        out[attention] = {**m, "step_s": None if t is None else t.seconds}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="a,b,c,d")
    ap.add_argument("--work", type=Path, default=Path("runs/tpu_shapes"), help="shape-only model dirs go here")
    args = ap.parse_args(argv)
    from mrl_jax.cli import show_plan_progress
    from mrl_jax.mwra.tpu import quiet_default_backend

    quiet_default_backend()
    show_plan_progress()   # each compile on stderr as it starts: the cases take tens of minutes
    args.work.mkdir(parents=True, exist_ok=True)
    failed = 0
    for c in args.cases.split(","):
        try:
            CASES[c](args.work)
        except Exception as e:   # noqa: BLE001 -- one case's failure is reported, the others still run
            failed += 1
            print(json.dumps({"case": c, "error": f"{type(e).__name__}: {str(e)[:500]}"}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
