"""How one MRL round's wall time grows with the number of policies and with the group size G.

Uses the trainer's own pieces: ``mrl_jax.trainer.Run`` builds the policies (tiny random-init models, tokenizers
trained on the task corpus, jitted update steps) and ``mrl_jax.trainer.run_round`` runs a round (rollout ->
decode -> rewards -> SEE -> THL views -> updates). Policies are heterogeneous, cycling through
(llama, byte_bpe), (gpt2, char), (qwen2, metaspace_bpe), (llama, unigram); task = 2-digit addition
(``arith``); every policy uses the probe chain ``PROBES`` (THL and peer rows active as soon as there are peers).

Sweeps: policies in (1, 2, 4) at G = 8, and G in (4, 8, 16) at 2 policies. For each setting the first
``warmup`` rounds compile and are excluded; reported per setting: the median round time over the timed rounds,
the time per policy, and the split by phase (rollout, decode, rewards, see, thl, update), plus the growth
relative to the smallest setting of the sweep.

    python benchmarks/bench_scaling.py [--quick] [--out FILE]

``run(quick) -> dict`` is what ``mrl bench`` calls. On CPU every policy shares the same cores, so rounds grow
at least linearly with the number of policies; with MWRA sub-meshes on separate accelerators the rollout and
update phases overlap instead.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

import numpy as np

POLICY_KINDS = [("llama", "byte_bpe", 320), ("gpt2", "char", 320), ("qwen2", "metaspace_bpe", 384),
                ("llama", "unigram", 384)]
PROBES = "xgrpo+sgt"
SETTINGS = {
    True: dict(prompts=8, new_tokens=16, warmup=1, timed=2, policies=(1, 2, 4), groups=(4, 8, 16)),
    False: dict(prompts=32, new_tokens=32, warmup=1, timed=3, policies=(1, 2, 4), groups=(4, 8, 16)),
}
PHASES = ("rollout", "decode", "rewards", "see", "views", "thl", "update")


def _config(num_policies: int, G: int, s: dict):
    from mrl_jax.trainer.config import (ModelSpec, PolicySpec, RunConfig, SamplingSpec, TaskSpec,
                                        TokenizerSpec)

    pols = []
    for i in range(num_policies):
        fam, kind, vocab = POLICY_KINDS[i % len(POLICY_KINDS)]
        pols.append(PolicySpec(
            name=f"p{i}_{fam}_{kind}", model=ModelSpec(family=fam, hidden_size=64, num_layers=2),
            tokenizer=TokenizerSpec(kind=kind, vocab_size=vocab),
            sampling=SamplingSpec(max_new_tokens=s["new_tokens"]), probes=PROBES))
    return RunConfig(policies=pols, task=TaskSpec(name="arith"), seed=0, rounds=s["warmup"] + s["timed"],
                     prompts_per_round=s["prompts"], num_generations=G)


def _measure(num_policies: int, G: int, s: dict, cache_dir: str) -> dict:
    import jax

    from mrl_jax.tasks import RewardScorer, task_reward
    from mrl_jax.trainer import Run, run_round

    cfg = _config(num_policies, G, s)
    t0 = time.perf_counter()
    run = Run(cfg, cache_dir=cache_dir)
    state = run.initial_state()   # warm_start.steps defaults to 0: the built weights
    build_s = time.perf_counter() - t0
    from mrl_jax.bench.load import section

    times, phases = [], []
    with RewardScorer([task_reward(run.task, timeout_s=cfg.reward_timeout_s)]) as scorer, \
            section(f"scaling_n{num_policies}_G{G}") as load:
        for r in range(cfg.rounds):
            t = time.perf_counter()
            state, metrics, _ = run_round(run.policies, state, run.round_inputs(r), scorer)
            jax.block_until_ready(jax.tree.leaves(state.policies))
            times.append(time.perf_counter() - t)
            m = next(iter(metrics.values()))  # the phase timer is shared by every policy of the round
            phases.append({p: m.get(f"time/{p}", 0.0) for p in PHASES})
    timed = times[s["warmup"]:]
    ph = {p: round(float(np.median([x[p] for x in phases[s["warmup"]:]])), 4) for p in PHASES}
    round_s = float(np.median(timed))
    return dict(policies=num_policies, G=G, completions_per_round=num_policies * G * s["prompts"],
                round_s=round(round_s, 4), round_s_per_policy=round(round_s / num_policies, 4),
                first_round_s=round(times[0], 2), build_s=round(build_s, 2), phases_s=ph,
                round_times=[round(x, 4) for x in times], load=load, contended=load["contended"])


def _growth(rows: list[dict]) -> None:
    base = rows[0]["round_s"]
    for r in rows:
        r["relative_to_first"] = round(r["round_s"] / base, 3)


def run(quick: bool = False) -> dict:
    import jax

    s = SETTINGS[bool(quick)]
    out = dict(setup=dict(probes=PROBES, task="arith", model="hidden 64, 2 layers", **{k: v for k, v in s.items()}),
               devices=[str(d) for d in jax.devices()])
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as cache:
        by_pol = [_measure(n, 8, s, cache) for n in s["policies"]]
        by_g = []
        for G in s["groups"]:
            same = next((r for r in by_pol if r["policies"] == 2 and r["G"] == G), None)
            by_g.append(dict(same) if same is not None else _measure(2, G, s, cache))
    _growth(by_pol)
    _growth(by_g)
    out["by_policies"] = by_pol
    out["by_group_size"] = by_g
    return out


def main(argv=None) -> int:
    from mrl_jax.bench import script_main

    return script_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
