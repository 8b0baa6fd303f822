"""The run loop of ``mrl train``: a generator of rounds with hooks (``Trainer``), and ``train`` around it
(resume, logs, checkpoints, evaluation, the stop conditions, the summary).

Determinism: the prompts and RNG key of round ``r`` depend only on ``(seed, r)`` (``Run.round_inputs``), so a
run resumed from the checkpoint of round ``r`` continues exactly as an uninterrupted one would (same params, same
metrics); the checkpoint holds every policy's params, optimizer state and reference and the SEE buffer. A round's
records (metrics, held-out eval, samples, groups) are all written before its checkpoint, so a kill at any moment
leaves either the checkpoint and every record of its round, or records that a resume drops and redoes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
import optax

from mrl_jax.configs import ConfigError, load_yaml, to_dict
from mrl_jax.tasks import RewardFailure, RewardScorer, RewardSpec, Task, build_reward_specs, task_reward
from mrl_jax.trainer.checkpoint import CheckpointError, RunCheckpointer, host_template
from mrl_jax.trainer.compile_stats import CompileCounter
from mrl_jax.trainer.config import RunConfig, load_run_config
from mrl_jax.trainer.hooks import (CheckpointHook, Hook, RoundInfo, SkippedUpdatesStop, TrainingStopped, eval_hook,
                                   log_hook, reward_failure_hook)
from mrl_jax.trainer.metrics import RunLog
from mrl_jax.trainer.placement import fetch, placement_summary
from mrl_jax.trainer.policy import Policy, param_count
from mrl_jax.trainer.round import RunState, run_round
from mrl_jax.trainer.parts import build_task, task_corpus, text_budget
from mrl_jax.trainer.run import Run
from mrl_jax.trainer.run_lock import read_lock, run_lock


class Trainer:
    """The rounds of a run as a generator: ``rounds(state, start)`` runs round after round (``run_round``) and
    yields a ``RoundInfo`` for each, after the hooks registered with ``add_hook(fn, every=N)`` ran on it."""

    def __init__(self, run: Run, scorer, *, policies: Sequence[Policy] | None = None,
                 device_guard: str | None = None, on_update: Callable | None = None):
        """``policies``: the run's policies as the rounds use them (default ``run.policies``); ``device_guard``
        and ``on_update`` (e.g. `hooks.LastInputs.record`): see ``run_round``."""
        self.run, self.scorer = run, scorer
        self.policies = list(policies or run.policies)
        self.device_guard, self.on_update = device_guard, on_update
        self.hooks: list[Hook] = []

    def add_hook(self, fn: Callable[[RoundInfo], None], *, every: int = 1, at_end: bool = False):
        """Run ``fn(info)`` after every ``every``-th round (and after the last one when ``at_end``), in the order
        added; a hook that raises (e.g. ``TrainingStopped``) ends the generator with that exception."""
        if every < 1:
            raise ValueError(f"Trainer.add_hook: every={every}; pass every >= 1 (rounds between calls)")
        self.hooks.append(Hook(fn, every, at_end))
        return fn

    def rounds(self, state: RunState, start: int = 0) -> Iterator[RoundInfo]:
        """Rounds ``start .. cfg.rounds - 1`` from ``state``; each yields the finished round's ``RoundInfo``."""
        end = self.run.cfg.rounds
        for r in range(start, end):
            inputs = self.run.round_inputs(r)
            state, metrics, samples = run_round(self.policies, state, inputs, self.scorer,
                                                device_guard=self.device_guard, on_update=self.on_update)
            info = RoundInfo(inputs=inputs, state=state, metrics=metrics, samples=samples, last=r + 1 == end)
            for hook in self.hooks:
                if hook.due(info):
                    hook.fn(info)
            yield info


def _host_state(run: Run, state: RunState) -> RunState:
    """What a checkpoint saves. One process: ``state`` (sharded arrays as they are). Several: orbax cannot
    save an array that lives inside one process of a multi-host run, so each policy's state is read where
    its mesh is and broadcast (`placement.fetch`), and every process saves the same host values."""
    if jax.process_count() == 1:
        return state
    pols = tuple(jax.tree.map(np.asarray, fetch(run.placement.meshes[i], ps)) for i, ps in enumerate(state.policies))
    return state.replace(policies=pols, see=jax.device_get(state.see))


class _NullLog:
    """The run log of a non-primary process of a multi-host run: writes nothing."""

    def truncate_after(self, round_index: int) -> None:
        pass

    def log_round(self, round_index, per_policy) -> None:
        pass

    def log_samples(self, round_index, samples) -> None:
        pass

    def close(self, finished: bool = True) -> None:
        pass


def _flat(d, pre: str = "") -> dict:
    """A nested config dict as ``{"a.0.b": value}``."""
    if isinstance(d, dict):
        return {k: v for key, val in d.items() for k, v in _flat(val, f"{pre}{key}.").items()}
    if isinstance(d, list):
        return {k: v for i, val in enumerate(d) for k, v in _flat(val, f"{pre}{i}.").items()}
    return {pre[:-1]: d}


def _check_config_changes(out: Path, cfg: RunConfig) -> None:
    """On resume, compare with the config the run started with (``config.json``): another ``rounds`` under a
    schedule that depends on the total steps (cosine, linear) is a ``ConfigError`` (the continued run's learning
    rate curve would change); any other changed key is one warning line on stderr naming old and new values."""
    try:
        old = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return
    a, b = _flat(old), _flat(json.loads(json.dumps(to_dict(cfg))))
    if a.get("rounds") != b.get("rounds"):
        decaying = [f"policies[{i}].optimizer.schedule: {p.optimizer.schedule}" for i, p in enumerate(cfg.policies)
                    if p.optimizer.schedule != "constant"]
        if decaying:
            raise ConfigError(
                f"config key 'rounds': the run in {out} started with rounds: {a.get('rounds')}, this config has "
                f"rounds: {b.get('rounds')}; {', '.join(decaying)} decays over the total steps, so resuming would "
                f"change its learning-rate curve. Resume with rounds: {a.get('rounds')} (or start a new --out).")
    if a.get("num_generations") != b.get("num_generations"):
        raise ConfigError(
            f"config key 'num_generations': the run in {out} started with num_generations: "
            f"{a.get('num_generations')}, this config has {b.get('num_generations')}; its groups, SEE records and "
            f"metrics would mix two group sizes. Resume with num_generations: {a.get('num_generations')} (or start a "
            "new --out).")
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if changed:
        diffs = "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed)
        print(f"mrl train: warning: resuming {out} with a config that differs from the one it started with "
              f"(config.json) in {diffs}", file=sys.stderr, flush=True)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during ``train``: the message names the round and the intact checkpoint to resume from."""


def _interrupted(ckpt: RunCheckpointer, round_index: int) -> str:
    """Drop the temporary folder of a checkpoint write the interrupt cut short (orbax renames a finished one);
    the line naming the round and the checkpoint a resume starts from."""
    import shutil

    try:
        ckpt.close()   # first let a write in flight (orbax's own thread) end: it would make its folder again
    except Exception:  # noqa: BLE001 -- a write the interrupt cut short may fail here; its folder goes below
        pass
    for tmp in ckpt.directory.glob("*.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)
    done = ckpt.latest_round()
    kept = (f"the checkpoint of round {done} in {ckpt.directory} is intact (later rounds are redone)"
            if done is not None else "no checkpoint was complete yet (a new run starts over)")
    return f"interrupted in round {round_index}; {kept}"


def _reward_scorer(run: Run, reward_specs: Sequence[RewardSpec] | None) -> RewardScorer:
    if reward_specs:
        specs = list(reward_specs)
    elif run.cfg.rewards:
        specs = build_reward_specs(run.cfg.rewards, run.task, timeout_s=run.cfg.reward_timeout_s)
    else:
        specs = [task_reward(run.task, timeout_s=run.cfg.reward_timeout_s)]
    return RewardScorer(specs, max_consecutive_failures=run.cfg.max_reward_failures)


RUN_RECORDS = ("metrics.jsonl", "samples.jsonl", "groups.jsonl")


def _resume_round(ckpt: RunCheckpointer, out: Path, cfg: RunConfig, resume: bool) -> int | None:
    """The round of the checkpoint to resume from (None: start fresh). Refuses a new run into a directory that
    holds a run's checkpoints or records, and ``--resume`` where there is no complete checkpoint."""
    latest = ckpt.latest_round()
    records = [n for n in RUN_RECORDS if RunLog.read_records(out / n)]
    if not resume:
        if latest is not None:
            raise CheckpointError(f"{out} already holds checkpoints (latest round {latest}); pass --resume to "
                                  "continue it or choose a new --out directory.")
        if records:
            raise CheckpointError(f"{out} already holds a run's records ({', '.join(records)}); choose a new --out "
                                  "directory (or delete those files to start this run over there).")
        return None
    if latest is None:
        logged = max((int(r.get("round", -1)) for r in RunLog.read_records(out / "metrics.jsonl")), default=-1)
        if logged >= cfg.checkpoint_every:   # the checkpoint of round checkpoint_every - 1 came before this round
            raise CheckpointError(
                f"--resume: {out / 'metrics.jsonl'} has rounds up to {logged} but {ckpt.directory} holds no complete "
                "checkpoint (deleted or moved?). Put the checkpoints back, or start a new --out directory (or delete "
                "metrics.jsonl, samples.jsonl and groups.jsonl to start this run over).")
        start_over = (f"delete {', '.join(records)} in {out} and start without --resume" if records
                      else "start without --resume")
        raise CheckpointError(f"--resume: {ckpt.directory} holds no complete checkpoint (the run stopped before its "
                              f"first one, round {cfg.checkpoint_every - 1}); {start_over} to begin the run.")
    _check_config_changes(out, cfg)
    return latest


def _start(run: Run, ckpt: RunCheckpointer, out: Path, latest: int | None) -> tuple[RunState, int]:
    """``(state, first round)``: ``run.initial_state()`` for a new run, else the latest checkpoint restored
    (`restore_state`)."""
    if latest is None:
        return run.initial_state(), 0
    state, meta = restore_state(run, ckpt)
    return state, int(meta["round"]) + 1


def restore_state(run: Run, ckpt: RunCheckpointer) -> tuple[RunState, dict]:
    """``(state, meta)`` of the latest checkpoint, restored onto ``run``'s state template (several processes: onto
    the host -- orbax restores no process-local array) and placed. A checkpoint written before the optimizer state
    counted skipped updates (its optimizer states are the inner ones) is restored onto that layout and given zero
    counts, so a run resumes across the upgrade."""
    onto = (lambda t: t) if jax.process_count() == 1 else host_template
    template = run.state_template()
    try:
        state, meta = ckpt.restore(onto(template))
    except CheckpointError as error:
        if not all(isinstance(p.opt_state, optax.ApplyIfFiniteState) for p in template.policies):
            raise
        uncounted = template.replace(policies=tuple(p.replace(opt_state=p.opt_state.inner_state)
                                                    for p in template.policies))
        try:
            state, meta = ckpt.restore(onto(uncounted))
        except CheckpointError:
            raise error from None
        zero = np.zeros((), np.int32)
        state = state.replace(policies=tuple(p.replace(opt_state=optax.ApplyIfFiniteState(
            notfinite_count=zero, last_finite=np.asarray(True), total_notfinite=zero, inner_state=p.opt_state))
            for p in state.policies))
    return run.place(state), meta


def _write_plan(out: Path, run: Run, progress: bool) -> None:
    """config.json, and the device plan (printed, plan.txt, plan.json)."""
    (out / "config.json").write_text(json.dumps(to_dict(run.cfg), indent=2))
    if run.placement is not None:
        plan, samplers = run.placement.plan, run.sampler_lines()
        text = "\n".join([str(plan), *samplers])
        if progress:
            print(text, flush=True)
        (out / "plan.txt").write_text(text + "\n")
        (out / "plan.json").write_text(json.dumps({**plan.to_dict(), "samplers": samplers}, indent=2))
    if run.memory is not None:
        if progress:
            print(str(run.memory), flush=True)
        (out / "memory_plan.json").write_text(json.dumps(run.memory.to_dict(), indent=2))


def _sft_figures(losses: Sequence[float]) -> dict:
    """The SFT warm start's loss: steps, first, last and lowest step loss."""
    return {"steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1], "loss_min": min(losses)}


def _show_warm_starts(run: Run) -> None:
    """One progress line per warm-started policy: its SFT loss, first step -> last step."""
    for name, losses in run.warm_start_losses.items():
        f = _sft_figures(losses)
        print(f"[warm start] {name}: {f['steps']} SFT steps, loss {f['loss_first']:.4f} -> {f['loss_last']:.4f} "
              f"(lowest {f['loss_min']:.4f})", file=sys.stderr, flush=True)


BEFORE = "before.json"


def _before(run: Run, state: RunState, out: Path, start: int, primary: bool) -> dict | None:
    """The sampled evaluation of the starting (warm) state, for before/after pass@k (``eval_samples`` > 0):
    computed by a new run and written to ``before.json`` at once (atomically), read back by a resumed one."""
    if not run.cfg.eval_samples:
        return None
    path = out / BEFORE
    if start > 0:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            print(f"mrl train: warning: {path} is missing or unreadable, so summary.json has no 'before' (the "
                  "starting state's evaluation is only computed by a new run)", file=sys.stderr, flush=True)
            return None
    before = run.evaluate(state, run.cfg.eval_prompts)
    if primary:
        tmp = path.with_name(BEFORE + ".tmp")
        tmp.write_text(json.dumps(before, indent=2))
        tmp.replace(path)
    return before


def _finished(cfg: RunConfig, out: Path, resume: bool) -> dict | None:
    """``--resume`` of a run whose last round is checkpointed and whose summary.json is written: that summary,
    with nothing in ``out`` touched (None: there is a round to train, or the summary to write)."""
    if not resume or not (out / "checkpoints").is_dir():
        return None
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    try:
        latest = ckpt.latest_round()
    finally:
        ckpt.close()
    if latest is None or latest + 1 < cfg.rounds or not (out / "summary.json").is_file():
        return None
    _check_config_changes(out, cfg)
    try:
        summary = json.loads((out / "summary.json").read_text())
    except ValueError:
        return None
    print(f"mrl train: {out} is complete (checkpoint of round {latest}, rounds: {cfg.rounds}); nothing to train, "
          "its files are unchanged (raise rounds to train further)", file=sys.stderr, flush=True)
    return summary


def _summary(run: Run, state: RunState, start: int) -> dict:
    """summary.json: rounds, resume point, prompt counts, per policy params, final eval and placement."""
    cfg = run.cfg
    final = run.evaluate(state, cfg.eval_prompts)
    summary = {"rounds": cfg.rounds, "resumed_from": start - 1 if start else None, "prompts": run.prompt_stats,
               "policies": {p.name: {"params": param_count(s), "eval": final[p.name]}
                            for p, s in zip(run.policies, state.policies)}}
    for name, losses in run.warm_start_losses.items():
        summary["policies"][name]["warm_start"] = _sft_figures(losses)
    if "population" in final:
        summary["population"] = final["population"]
    if run.placement is not None:
        summary["plan"] = run.placement.to_dict()
        for name, pl in placement_summary(run.placement, state.policies).items():
            summary["policies"][name]["placement"] = pl
    return summary


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, task: Task | None = None,
          reward_specs: Sequence[RewardSpec] | None = None, progress: bool = True) -> dict:
    """Run (or resume) an MRL run into ``out_dir``; returns the summary (also written as summary.json).
    summary["compiles"]: the XLA programs this process built (``compile_stats.CompileCounter``). The run
    directory is locked (``run_lock``) for the whole call: a second ``train`` on it is refused, naming this PID."""
    primary = jax.process_index() == 0   # multi-host: process 0 owns the directory (it alone writes there)
    with run_lock(out_dir, resume=resume) if primary else contextlib.nullcontext():
        done = _finished(cfg, Path(out_dir), resume)
        if done is not None:
            return done
        with CompileCounter() as compiles:
            summary = _train(cfg, Path(out_dir), resume, task, reward_specs, progress)
        summary["compiles"] = compiles.summary()
        if primary:   # multi-host: only process 0 writes logs, config, plan and summary
            (Path(out_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _train(cfg: RunConfig, out: Path, resume: bool, task: Task | None, reward_specs, progress: bool) -> dict:
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    try:
        latest = _resume_round(ckpt, out, cfg, resume)
        if cfg.mwra.topology:
            cfg = _check_topology(cfg, out, progress)
        run = Run(cfg, task=task)   # its memory plan compiled before any RL work; ConfigError when it does not fit
        state, start = _start(run, ckpt, out, latest)
    except BaseException:
        ckpt.close()
        raise
    # on resume, drop the records (and TensorBoard events) of rounds after the checkpoint: they are redone
    primary = jax.process_index() == 0   # multi-host: only process 0 writes logs, config and plan
    log = RunLog(out, progress=progress, purge_step=start if resume else None, rounds=(start, cfg.rounds),
                 report_to=cfg.report_to, config=to_dict(cfg)) if primary else _NullLog()
    if resume:
        log.truncate_after(start - 1)
    if primary:
        _write_plan(out, run, progress)
        if progress:
            _show_warm_starts(run)
    save = CheckpointHook(ckpt, lambda s: _host_state(run, s))
    stop = SkippedUpdatesStop(cfg.max_skipped_updates, save, out, probes={p.name: p.probes for p in cfg.policies})
    r, finished = start, False
    before = _before(run, state, out, start, primary)
    try:
        with _reward_scorer(run, reward_specs) as scorer:
            trainer = Trainer(run, scorer, on_update=stop.recorder.record)
            trainer.add_hook(log_hook(log))
            if primary:
                trainer.add_hook(reward_failure_hook(scorer))
            if cfg.eval_every:   # before the checkpoint: a run killed after it has logged the round's eval too
                trainer.add_hook(eval_hook(run, log, cfg.eval_prompts), every=cfg.eval_every)
            trainer.add_hook(save, every=cfg.checkpoint_every, at_end=True)
            trainer.add_hook(stop)
            for info in trainer.rounds(state, start):
                state, r = info.state, info.round + 1
        finished = True
    except KeyboardInterrupt:
        raise RunInterrupted(_interrupted(ckpt, r)) from None
    except RewardFailure as e:
        done = ckpt.latest_round()
        raise RewardFailure(
            f"{e}\nThe run stopped in round {r}; that round was not logged. The last complete checkpoint is round "
            f"{done} in {ckpt.directory}: fix the reward, then resume with --resume.") from e
    finally:
        log.close(finished)   # a stopped run: no closing line of a finished one before the stop's own line
        ckpt.close()
    summary = _summary(run, state, start)
    if before is not None:
        summary["before"] = before
    return summary


def _check_topology(cfg: RunConfig, out: Path, progress: bool) -> RunConfig:
    """``mwra.topology``: the run compiled for that TPU slice (`tpu_plan.plan_for_topology`), its report printed
    and written to ``tpu_plan.json``; ``ConfigError`` with the fixes when a policy does not fit. Returns ``cfg``
    with the plan's sub-meshes (sized by estimated time) when the run runs on that slice (these devices are its
    TPU devices), else ``cfg``."""
    from mrl_jax.trainer.tpu_plan import plan_for_topology

    report = plan_for_topology(cfg, cfg.mwra.topology, key="config key 'mwra.topology'")
    if jax.process_index() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "tpu_plan.json").write_text(json.dumps(report.to_dict(), indent=2, default=str))
        if progress:
            print(report, file=sys.stderr)
    if not report.fits:
        raise ConfigError(f"config key 'mwra.topology': the run does not fit {cfg.mwra.topology}:\n"
                          + "\n".join(report.memory.misfits))
    local = jax.devices()
    if report.allocations and local[0].platform == "tpu" and len(local) == report.plan.num_devices:
        sizes = report.allocations[0].sizes
        return dataclasses.replace(cfg, policies=[dataclasses.replace(p, devices=n) for p, n in
                                                  zip(cfg.policies, sizes)])
    return cfg


def train_from_yaml(config_path, out_dir, *, resume=False, coordinator=None, num_processes=None,
                    process_id=None, topology: str | None = None) -> dict:
    """``mrl train``: multi-host set-up (a no-op on one host) and its watchdog (a lost process gets one line
    naming it and the resume point), config load (``topology`` sets ``mwra.topology``), ``train``."""
    from mrl_jax.mwra import initialize_distributed
    from mrl_jax.trainer.watchdog import Watchdog

    info = initialize_distributed(coordinator, num_processes, process_id)
    Watchdog(out_dir, info.heartbeat_timeout_s).start()   # stopped at exit, after every process has finished
    cfg = load_yaml(RunConfig, config_path)
    if topology is not None:   # the flag's errors name the flag: the config's would name mwra.topology
        from mrl_jax.trainer.tpu_plan import resolve_topology

        resolve_topology(topology, "--topology")
        cfg = dataclasses.replace(cfg, mwra=dataclasses.replace(cfg.mwra, topology=topology))
    return train(cfg, out_dir, resume=resume)


def evaluate_from_yaml(config_path, run_dir, *, samples: int | None = None, temperature: float | None = None) -> dict:
    """``mrl eval``: held-out success per policy from the run's latest checkpoint (``config_path``: the run's
    YAML config or its config.json); ``samples`` K > 0 adds avg@K, pass@k, maj@K and the population metrics
    (default: the config's eval_samples). The run is only read, under its lock held shared (`read_lock`): a
    ``train`` writing there refuses the evaluation, naming its PID."""
    cfg = load_run_config(config_path)
    if not (Path(run_dir) / "checkpoints").is_dir():
        raise CheckpointError(f"{run_dir} holds no run (no checkpoints/ directory); pass --run the --out directory "
                              "of `mrl train`, or --model an exported model directory")
    with read_lock(run_dir):
        ckpt = RunCheckpointer(run_dir, keep=cfg.keep_checkpoints)
        try:
            if ckpt.latest_round() is None:
                raise CheckpointError(f"{ckpt.directory} holds no complete checkpoint yet (one is written every "
                                      "checkpoint_every rounds); evaluate once the run has written one")
            run = Run(cfg)
            state, meta = restore_state(run, ckpt)
        finally:
            ckpt.close()
    res = run.evaluate(state, cfg.eval_prompts, samples=samples, temperature=temperature)
    out = {"round": meta["round"], "eval": res}
    if "population" in res:
        out["population"] = res.pop("population")
    return out


__all__ = ["ConfigError", "Run", "RunInterrupted", "Trainer", "TrainingStopped", "build_task", "evaluate_from_yaml", "task_corpus",
           "text_budget", "train", "train_from_yaml"]
