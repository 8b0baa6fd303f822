"""``mrl demo``: the embedded default — does sharing experience help two heterogeneous tiny policies?

Set-up (DESIGN.md, "embedded-default demo"): one task mixture, a shared skill (``copy``) and a synthetic
fact table split in parts A and B. Two policies of different families, sizes and tokenizer algorithms
(Llama-style + byte-level BPE; GPT-2-style + Unigram) are warm-started on the shared skill and on *their
own* part of the table, so each answers facts the other cannot, and GRPO alone has nothing to learn from
on the other part (all-zero groups). Then the same RL budget runs under every probe (same seeds, same
warm-started weights, same prompts) and both policies are evaluated greedily on own facts, foreign facts
and held-out ``copy`` prompts. The table reports what happened, including when a probe does not help.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from mrl_jax.report.progress import Progress, round_figures
from mrl_jax.tasks import FactTableTask, MixtureTask, RewardScorer, StringTask, task_reward
from mrl_jax.trainer.config import (ModelSpec, OptimizerSpec, PolicySpec, RunConfig, SamplingSpec, SeeSpec,
                                    TokenizerSpec, WarmStartSpec)
from mrl_jax.trainer.evaluation import evaluate_policy
from mrl_jax.trainer.loop import Run, Trainer
from mrl_jax.trainer.policy import PolicyState, param_count
from mrl_jax.trainer.round import ROUND_PHASES, RunState

DEFAULT_PROBES = ("none", "xgrpo", "prp", "sgt", "sgt+replay")
COUNTERS = ("frac_reward_zero_std", "sgt/rows_fired", "prp/ess", "xgrpo/adv_on_peer_solved", "replay/rows")


@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """Budget of the demo (``quick`` shrinks rounds and seeds)."""

    seeds: int = 3
    rounds: int = 40
    prompts_per_round: int = 32
    num_generations: int = 8
    sft_steps: int = 200
    sft_learning_rate: float = 3e-3   # each policy's warm_start.learning_rate
    num_facts: int = 32
    learning_rate: float = 1e-3
    eval_copy_prompts: int = 64
    eval_every: int = 5   # held-out greedy eval every this many RL rounds (success.png); 0 = start and end only

    @classmethod
    def make(cls, quick: bool, seeds: int | None) -> "DemoSettings":
        base = cls(seeds=1, rounds=20, sft_steps=150) if quick else cls()
        return dataclasses.replace(base, seeds=seeds or base.seeds)


def demo_task(num_facts: int) -> MixtureTask:
    """Shared skill ``copy`` + a fact table in parts A/B (facts are half of the prompts)."""
    return MixtureTask([StringTask("copy", min_len=3, max_len=6, alphabet="abcdef", n_train=1000, n_eval=100),
                        FactTableTask(num_facts, parts=("A", "B"))], weights=[1, 1], name="demo")


def demo_config(probe: str, s: DemoSettings, seed: int = 0) -> RunConfig:
    """The two heterogeneous policies, warm-started on the shared skill and their own part (A / B) of the fact
    table (the probe chain and the seed are the only differences between runs)."""
    common = dict(sampling=SamplingSpec(max_new_tokens=8), probes=probe,
                  optimizer=OptimizerSpec(learning_rate=s.learning_rate, max_grad_norm=1.0))
    warm = lambda part: WarmStartSpec(steps=s.sft_steps, part=part, learning_rate=s.sft_learning_rate, batch_size=64)
    return RunConfig(
        policies=[PolicySpec(name="llama-bpe", model=ModelSpec(family="llama", hidden_size=64, num_layers=2),
                             tokenizer=TokenizerSpec(kind="byte_bpe", vocab_size=300), warm_start=warm("A"),
                             **common),
                  PolicySpec(name="gpt2-unigram", model=ModelSpec(family="gpt2", hidden_size=96, num_layers=2),
                             tokenizer=TokenizerSpec(kind="unigram", vocab_size=400), warm_start=warm("B"),
                             **common)],
        seed=seed, rounds=s.rounds, prompts_per_round=s.prompts_per_round, num_generations=s.num_generations,
        see=SeeSpec(capacity=2048, per_prompt_cap=16, peer_rollouts_per_prompt=4, peer_successes_per_prompt=2,
                   own_successes_per_prompt=1))


def _evaluate(run: Run, state: RunState, eval_sets: dict) -> dict:
    out = {}
    for pol, st, own in zip(run.policies, state.policies, ("A", "B")):
        foreign = "B" if own == "A" else "A"
        res = {name: evaluate_policy(pol, st, run.task, prompts)["success"] for name, prompts in eval_sets.items()}
        out[pol.name] = {"own_facts": res[f"fact:{own}"], "foreign_facts": res[f"fact:{foreign}"], "copy": res["copy"]}
    return out


def _rl(run: Run, state: RunState, s: DemoSettings, scorer, eval_sets: dict, bar: Progress,
        label: str) -> tuple[RunState, list[dict], list[tuple]]:
    """The RL budget from ``state`` through the trainer's rounds (hooks record what the demo reports); returns
    the final state, per-round metrics and the held-out evaluations every ``s.eval_every`` rounds before the
    last, ``[(rounds done, {policy: {skill: f}}, seconds)]``."""
    history, evals = [], []
    trainer = Trainer(run, scorer)
    trainer.add_hook(lambda info: history.append(info.metrics))

    def periodic_eval(info):
        if not info.last:
            t0 = time.perf_counter()
            evals.append((info.round + 1, _evaluate(run, info.state, eval_sets), time.perf_counter() - t0))

    def progress(info):
        bar.done(round_figures(info.metrics))
        if not info.last:
            bar.start(f"{info.round + 1} {label}")

    if s.eval_every:
        trainer.add_hook(periodic_eval, every=s.eval_every)
    trainer.add_hook(progress)
    bar.start(f"0 {label}", compile=True)   # each run's first round compiles its update
    for info in trainer.rounds(state):
        state = info.state
    return state, history, evals


def _stats(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "std": float(np.std(values)), "values": [float(v) for v in values]}


def _success_curve(curves: list[list[tuple]], name: str) -> dict:
    """Held-out success of one policy over rounds: ``{"rounds": [..], skill: {"mean": [..], "std": [..]}}``
    from each seed's ``[(rounds done, {policy: {skill: f}}), ...]`` (warm start = round 0, final included)."""
    out = {"rounds": [int(point[0]) for point in curves[0]]}
    for c in ("own_facts", "foreign_facts", "copy"):
        vals = np.asarray([[point[1][name][c] for point in curve] for curve in curves], np.float64)
        out[c] = {"mean": vals.mean(0).tolist(), "std": vals.std(0).tolist()}
    return out


def _summarise(results: dict, names: list[str]) -> dict:
    """results[probe][seed] = {"eval": {policy: {...}}, "history": [...]} -> the summary.json entry."""
    probes = {}
    for probe, per_seed in results.items():
        entry = {}
        for name in names:
            cols = {c: _stats([r["eval"][name][c] for r in per_seed]) for c in ("own_facts", "foreign_facts", "copy")}
            counters = {}
            for c in COUNTERS:
                vals = [np.mean([h[name][c] for h in r["history"] if c in h[name]]) for r in per_seed
                        if any(c in h[name] for h in r["history"])]
                if vals:
                    counters[c] = float(np.mean(vals))
            curve = np.mean([[h[name]["reward/mean"] for h in r["history"]] for r in per_seed], axis=0)
            entry[name] = {**cols, "counters": counters, "reward_curve": [float(x) for x in curve],
                           "success_curve": _success_curve([r["curve"] for r in per_seed], name)}
        probes[probe] = entry
    return probes


def _table(summary: dict, names: list[str]) -> str:
    head = "| probe | " + " | ".join(f"{n} own | {n} foreign | {n} copy" for n in names) + " | counters |"
    lines = [head, "|" + "---|" * (3 * len(names) + 2)]
    fmt = lambda d: f"{d['mean']:.2f} ± {d['std']:.2f}"
    for probe, entry in summary["probes"].items():
        cells = [f"{fmt(entry[n]['own_facts'])} | {fmt(entry[n]['foreign_facts'])} | {fmt(entry[n]['copy'])}"
                 for n in names]
        counters = "; ".join(f"{n}: " + ", ".join(f"{k}={v:.3g}" for k, v in entry[n]["counters"].items())
                             for n in names if entry[n]["counters"])
        lines.append(f"| {probe} | " + " | ".join(cells) + f" | {counters} |")
    return "\n".join(lines)


def _verdict(summary: dict, names: list[str]) -> list[str]:
    """Plain sentences: did each probe move the foreign facts, and at what cost to the own ones?"""
    base = summary["probes"].get("none")
    out = []
    for probe, entry in summary["probes"].items():
        if probe == "none" or base is None:
            continue
        for n in names:
            df = entry[n]["foreign_facts"]["mean"] - base[n]["foreign_facts"]["mean"]
            do = entry[n]["own_facts"]["mean"] - base[n]["own_facts"]["mean"]
            a, b = entry[n]["foreign_facts"], base[n]["foreign_facts"]
            se = np.sqrt(a["std"] ** 2 / len(a["values"]) + b["std"] ** 2 / len(b["values"]))
            noise = max(2 * se, 1e-9)   # two standard errors of the difference of seed means
            moved = "gained" if df > noise else ("lost" if df < -noise else "did not change (within 2 s.e.)")
            out.append(f"{probe}, {n}: foreign facts {moved} ({df:+.2f} vs none); own facts {do:+.2f}.")
    return out


SKILLS = (("own_facts", "own facts"), ("foreign_facts", "foreign facts"), ("copy", "copy (shared skill)"))


def _eval_cost(results: dict, s: DemoSettings, wall_s: float) -> dict:
    """What the held-out evaluations between the start and the end (for success.png) cost."""
    seconds = float(sum(r["eval_s"] for per_seed in results.values() for r in per_seed))
    count = sum(len(r["curve"]) - 2 for per_seed in results.values() for r in per_seed)
    share = seconds / wall_s if wall_s > 0 else 0.0
    note = (f"Periodic held-out evaluation (every {s.eval_every} rounds, for success.png): {count} evaluations, "
            f"{seconds:.1f} s ({100 * share:.1f} % of the wall time).")
    return {"every": s.eval_every, "evaluations": count, "seconds": round(seconds, 2), "share_of_wall": share,
            "note": note}


def _plot_success(summary: dict, names: list[str], path: Path) -> None:
    """The main figure: held-out greedy success per skill (rows) over rounds for every probe, mean over seeds
    with a ±1 std band, one column per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    seeds = summary["settings"]["seeds"]
    fig, axes = plt.subplots(len(SKILLS), len(names), figsize=(5 * len(names), 2.8 * len(SKILLS)), squeeze=False,
                             sharex=True, sharey=True)
    for col, n in enumerate(names):
        for row, (skill, title) in enumerate(SKILLS):
            ax = axes[row, col]
            for probe, entry in summary["probes"].items():
                sc = entry[n]["success_curve"]
                mean, std = np.asarray(sc[skill]["mean"]), np.asarray(sc[skill]["std"])
                (line,) = ax.plot(sc["rounds"], mean, marker=".", label=probe)
                ax.fill_between(sc["rounds"], np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1),
                                color=line.get_color(), alpha=0.15, linewidth=0)
            ax.set_title(f"{n}: {title}", fontsize=10)
            ax.set_ylim(-0.03, 1.03)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if row == len(SKILLS) - 1:
                ax.set_xlabel("RL round (0 = warm start)")
            if col == 0:
                ax.set_ylabel("held-out greedy success\n(fraction of prompts)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.suptitle(f"held-out greedy success per skill, mean ± std over {seeds} seed(s)")
    fig.tight_layout(rect=(0, 0.4 / (2.8 * len(SKILLS)), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot(summary: dict, names: list[str], path: Path) -> None:
    """The second figure: mean training reward per round (sampled, temperature 1) for every probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.9), squeeze=False)
    for ax, n in zip(axes[0], names):
        for probe, entry in summary["probes"].items():
            ax.plot(entry[n]["reward_curve"], label=probe)
        ax.set_title(n)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("mean reward per sample (train prompts)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.4 / 3.9, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(out_dir: str | Path, *, quick: bool = False, num_seeds: int | None = None,
             probes: Sequence[str] | None = None, settings: DemoSettings | None = None) -> dict:
    """Run the demo; writes summary.json, summary.md, success.png (held-out success per skill over rounds) and
    curves.png (training reward) in ``out_dir`` and returns the summary.
    ``settings`` overrides the budget chosen by ``quick`` / ``num_seeds`` entirely."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    s = settings or DemoSettings.make(quick, num_seeds)
    probes = list(probes or DEFAULT_PROBES)
    task = demo_task(s.num_facts)
    facts = [p for p in task.eval_prompts() if p.task == "fact"]
    eval_sets = {"fact:A": [p for p in facts if p.meta["part"] == "A"],
                 "fact:B": [p for p in facts if p.meta["part"] == "B"],
                 "copy": [p for p in task.eval_prompts() if p.task == "copy"][:s.eval_copy_prompts]}
    results = {p: [] for p in probes}
    warm_eval = []
    bar = Progress(s.seeds * len(probes) * s.rounds, title="demo")
    with RewardScorer([task_reward(task)]) as scorer, bar:   # the bar stops on an error too
        for seed in range(s.seeds):
            runs = {p: Run(demo_config(p, s, seed), task=task) for p in probes}
            first = runs[probes[0]]
            params = first.warm_params()   # the configs' warm start, the same for every probe: done once
            # on the runs' meshes, as their evaluations see params: the same sampler programs, compiled once
            warm_state = first.place(RunState(policies=tuple(PolicyState(params=p, opt_state=None) for p in params),
                                              see=None))
            warm_eval.append(_evaluate(first, warm_state, eval_sets))
            print(f"[demo] seed {seed} warm start: {warm_eval[-1]}", flush=True)
            for probe in probes:
                run = runs[probe]
                state, history, evals = _rl(run, run.initial_state(params), s, scorer, eval_sets, bar,
                                            f"({probe}, seed {seed})")
                final = _evaluate(run, state, eval_sets)
                curve = [(0, warm_eval[-1])] + [(r, e) for r, e, _ in evals] + [(s.rounds, final)]
                results[probe].append({"eval": final, "history": history, "curve": curve,
                                       "eval_s": sum(t for _, _, t in evals)})
                print(f"[demo] seed {seed} {probe}: {results[probe][-1]['eval']}", flush=True)
    names = [pol.name for pol in first.policies]
    summary = {"settings": dataclasses.asdict(s), "policies": {
        pol.name: {"family": pol.spec.model.family, "tokenizer": pol.tokenizer.name,
                   "params": param_count(st), "own_part": pol.spec.warm_start.part}
        for pol, st in zip(first.policies, first.state_template().policies)}}
    summary["warm_start"] = {n: {c: _stats([w[n][c] for w in warm_eval]) for c in ("own_facts", "foreign_facts", "copy")}
                             for n in names}
    summary["probes"] = _summarise(results, names)
    summary["round_time_split_s"] = {
        k: float(np.mean([h[names[0]][f"time/{k}"] for p in probes for r in results[p] for h in r["history"]]))
        for k in ROUND_PHASES}
    summary["verdict"] = _verdict(summary, names)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["periodic_eval"] = _eval_cost(results, s, summary["wall_s"])
    md = ["# mrl demo", "", f"Held-out greedy success after {s.rounds} RL rounds ({s.prompts_per_round} prompts × "
          f"{s.num_generations} samples), mean ± std over {s.seeds} seed(s). own/foreign = the fact-table part the "
          "policy was / was not warm-started on; copy = shared skill (held-out prompts).", "",
          _table(summary, names), "", "Warm start (before RL): " + "; ".join(
              f"{n}: own {summary['warm_start'][n]['own_facts']['mean']:.2f}, foreign "
              f"{summary['warm_start'][n]['foreign_facts']['mean']:.2f}, copy {summary['warm_start'][n]['copy']['mean']:.2f}"
              for n in names), "", "## What happened", ""] + [f"- {v}" for v in summary["verdict"]] + [
          "", f"Round time split (s, mean): {json.dumps({k: round(v, 4) for k, v in summary['round_time_split_s'].items()})}",
          f"Wall time: {summary['wall_s']} s. {summary['periodic_eval']['note']}", "",
          "![held-out success per skill over rounds](success.png)", "",
          "![training reward per round](curves.png)"]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    _plot_success(summary, names, out / "success.png")
    _plot(summary, names, out / "curves.png")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(md))
    return summary
