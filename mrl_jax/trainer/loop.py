"""The run loop of ``mrl train``: set-up, rounds, checkpoints, logs, evaluation, resume.

Determinism: the prompts and RNG key of round ``r`` depend only on ``(seed, r)``, so a run resumed from
the checkpoint of round ``r`` continues exactly as an uninterrupted one would (same params, same
metrics); the checkpoint holds every policy's params and optimizer state and the SEE buffer.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from mrl_jax import see as see_lib
from mrl_jax.configs import ConfigError, load_yaml, to_dict
from mrl_jax.tasks import (ArithmeticTask, JsonlTask, Prompt, RewardFailure, RewardScorer, RewardSpec, StringTask, Task,
                           default_mixture, task_reward)
from mrl_jax.trainer.checkpoint import CheckpointError, RunCheckpointer, host_template
from mrl_jax.trainer.config import RunConfig
from mrl_jax.trainer.evaluation import evaluate
from mrl_jax.trainer.metrics import RunLog
from mrl_jax.trainer.placement import Placement, fetch, make_placement, pin_policy, placement_summary
from mrl_jax.trainer.policy import Policy, build_model, build_policy, build_tokenizer, param_count
from mrl_jax.trainer.reference import initial_reference
from mrl_jax.trainer.round import RunState, ViewShape, run_round
from mrl_jax.trainer.sft import uniform_draw, warm_start


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (repeated non-finite updates, failing rewards); state is saved."""


def build_task(cfg: RunConfig) -> Task:
    t = cfg.task
    if t.name == "mixture":
        return default_mixture(t.seed, num_facts=t.num_facts)
    if t.name == "arith":
        return ArithmeticTask("add", 2, seed=t.seed)
    if t.name == "reverse":
        return StringTask("rev", seed=t.seed)
    return JsonlTask(t.path, seed=t.seed)


def task_corpus(task: Task) -> list[str]:
    """Texts a locally trained tokenizer learns from: every prompt and answer."""
    prompts = task.train_prompts() + task.eval_prompts()
    return [p.text for p in prompts] + [p.answer for p in prompts]


class Run:
    """The built pieces of a run: task, policies (static) and the initial state."""

    def __init__(self, cfg: RunConfig, *, task: Task | None = None, cache_dir: str | None = None, warm: bool = True,
                 place: bool = True, devices: Sequence | None = None):
        """``place``: plan the devices (MWRA, ``cfg.mwra``; ``devices`` defaults to ``jax.devices()``), put each
        policy's state on its mesh and pin its steps there; False = everything on the default device."""
        self.cfg = cfg
        self.task = task or build_task(cfg)
        self.train_prompts = self.task.train_prompts()
        self.eval_prompts = self.task.eval_prompts()
        self.dense = {p.id: k for k, p in enumerate(self.train_prompts)}
        corpus = task_corpus(self.task)
        self.policies: list[Policy] = []
        self.prompt_limits: list[int] = []
        states = []
        for i, spec in enumerate(cfg.policies):
            tok = build_tokenizer(spec, corpus, cache_dir)
            model = build_model(spec, tok, seed=cfg.seed * 1000 + i)
            self.prompt_limits.append(_prompt_limit(spec, model))
            pol, st = build_policy(i, spec, tok, model, cfg)
            if warm and spec.warm_start.steps > 0:
                ws = spec.warm_start
                params, _ = warm_start(pol.graphdef, st.params, tok, pol.prompt_format, self.sft_draw(ws.part),
                                       steps=ws.steps,
                                       batch_size=ws.batch_size, learning_rate=ws.learning_rate,
                                       completion_length=spec.sampling.max_new_tokens, seed=cfg.seed * 1000 + i)
                st = st.replace(params=params)
            st = st.replace(ref_params=initial_reference(spec, st.params))
            self.policies.append(pol)
            states.append(st)
        self._fit_prompts()
        self.placement: Placement | None = None
        if place:
            self.placement = make_placement(cfg, [param_count(s) for s in states], self._mean_prompt_tokens(),
                                            devices)
            states = [self.placement.place(i, s) for i, s in enumerate(states)]
            self.policies = [pin_policy(p, self.placement.meshes[i], self.placement.shardings(i, states[i]),
                                        cfg.num_generations) for i, p in enumerate(self.policies)]
        max_src = max(p.sampling.max_new_tokens for p in self.policies)
        see = see_lib.init(cfg.see.capacity, text_budget(cfg.see.max_text_bytes, self.policies), max_src,
                           len(self.policies),
                           len(self.train_prompts), per_prompt_cap=cfg.see.per_prompt_cap,
                           success_capacity=cfg.see.capacity, tau=cfg.see.success_threshold)
        self.state = RunState(policies=tuple(states), see=see)
        self.view_shape = ViewShape(peer_rollouts=cfg.see.peer_rollouts_per_prompt,
                                    peer_successes=cfg.see.peer_successes_per_prompt,
                                    own_successes=cfg.see.own_successes_per_prompt)

    def _mean_prompt_tokens(self, sample: int = 256) -> list[float]:
        """Mean prompt tokens per policy over (up to ``sample``) train prompts: the cost model's prompt part."""
        texts = [p.text for p in self.train_prompts[:sample]]
        if not texts:
            return [0.0] * len(self.policies)
        return [float(v) for v in self._prompt_lengths(texts).mean(axis=0)]

    def place(self, state: RunState) -> RunState:
        """``state`` (e.g. restored from a checkpoint, host arrays) with every policy's arrays on its mesh."""
        if self.placement is None:
            return state
        return state.replace(policies=tuple(self.placement.place(i, s) for i, s in enumerate(state.policies)))

    def sft_draw(self, part: str | None):
        """Warm-start batches: the mixture's weighted draw (a small fact table is not drowned), else uniform."""
        if hasattr(self.task, "sample_sft"):
            return lambda n, rng: self.task.sample_sft(n, rng, part=part)
        return uniform_draw(self.task.sft_examples(part))

    def _prompt_lengths(self, texts: Sequence[str]) -> np.ndarray:
        """int[N, num_policies]: each policy's prompt token count (template and BOS included), as
        ``encode_prompts`` encodes it."""
        out = np.zeros((len(texts), len(self.policies)), np.int64)
        for k, pol in enumerate(self.policies):
            out[:, k] = [len(q) for q in pol.prompt_format.encode(pol.tokenizer, texts)]
        return out

    def _fits(self, text: str) -> bool:
        return bool(np.all(self._prompt_lengths([text])[0] <= np.asarray(self.prompt_limits)))

    def _truncated(self, prompt: Prompt) -> Prompt:
        """``prompt`` with the longest tail of its text that fits every policy's limit."""
        text = prompt.text
        lo, hi = 0, len(text)  # find the smallest start whose tail fits
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._fits(text[mid:]) else (mid + 1, hi)
        while lo < len(text) and not self._fits(text[lo:]):
            lo += 1
        if not self._fits(text[lo:]):
            raise ConfigError(
                f"config key 'policies[*].max_prompt_length': limits {self.prompt_limits} are shorter than the "
                "prompt template alone; raise max_prompt_length (or shorten prompt_template).")
        return dataclasses.replace(prompt, text=text[lo:])

    def _fit_prompts(self) -> None:
        """Apply the prompt length limits (``overlong_prompts``) to the train and eval prompts."""
        limits = np.asarray(self.prompt_limits)
        self.rejected: set[int] = set()
        self.replacement: dict[int, Prompt] = {}
        self.prompt_stats = {}
        for split in ("train", "eval"):
            prompts = self.train_prompts if split == "train" else self.eval_prompts
            if not prompts:
                continue
            over = np.any(self._prompt_lengths([p.text for p in prompts]) > limits, axis=1)
            self.prompt_stats[f"{split}_prompts_overlong"] = int(over.sum())
            if not over.any():
                continue
            if self.cfg.overlong_prompts == "reject":
                if over.all():
                    raise ConfigError(
                        f"config key 'policies[*].max_prompt_length': every {split} prompt is longer than the "
                        f"limits {self.prompt_limits} (tokens per policy); raise max_prompt_length or set "
                        "overlong_prompts: truncate.")
                self.rejected.update(p.id for p, o in zip(prompts, over) if o)
                kept = [p for p, o in zip(prompts, over) if not o]
            else:
                kept = [self._truncated(p) if o else p for p, o in zip(prompts, over)]
                self.replacement.update((p.id, q) for p, q, o in zip(prompts, kept, over) if o)
            if split == "eval":
                self.eval_prompts = kept

    def round_data(self, round_index: int):
        """The prompts of round ``r`` (a function of (task seed, run seed, r) only) with their dense SEE ids
        and the prompt-length counts: ``(prompts, dense int32[P], {"data/prompts_rejected", ...})``."""
        rng = np.random.default_rng([self.cfg.seed, round_index])
        P = self.cfg.prompts_per_round
        prompts = self.task.sample_train(P, rng)
        rejected = 0
        if self.rejected:
            kept = [p for p in prompts if p.id not in self.rejected]
            rejected = P - len(kept)
            for _ in range(1000):
                if len(kept) >= P:
                    break
                more = self.task.sample_train(P, rng)
                rejected += sum(p.id in self.rejected for p in more)
                kept += [p for p in more if p.id not in self.rejected]
            if len(kept) < P:
                raise ConfigError("config key 'overlong_prompts': almost every train prompt is rejected as too long; "
                                  "raise policies[*].max_prompt_length or set overlong_prompts: truncate.")
            prompts = kept[:P]
        truncated = sum(p.id in self.replacement for p in prompts)
        prompts = [self.replacement.get(p.id, p) for p in prompts]
        counts = {"data/prompts_rejected": float(rejected), "data/prompts_truncated": float(truncated)}
        return prompts, np.asarray([self.dense[p.id] for p in prompts], np.int32), counts

    def round_prompts(self, round_index: int):
        """The prompts of round ``r``: a function of (task seed, run seed, r) only."""
        prompts, dense, _ = self.round_data(round_index)
        return prompts, dense

    def round_key(self, round_index: int) -> jax.Array:
        return jax.random.fold_in(jax.random.key(self.cfg.seed), round_index)

    def evaluate(self, state: RunState, num_prompts: int | None = None) -> dict:
        prompts = self.eval_prompts[:num_prompts] if num_prompts else self.eval_prompts
        return evaluate(self.policies, state.policies, self.task, prompts)


def text_budget(requested: int, policies: Sequence[Policy]) -> int:
    """SEE bytes per completion text: enough for ``max_new_tokens`` of the longest token of each policy's
    tokenizer (``requested`` 0 = exactly that; a smaller explicit value is a config error)."""
    need = {p.name: (int(p.tokenizer.byte_table.lengths.max()) * p.completion_length, p.completion_length)
            for p in policies}
    worst = max(need, key=lambda n: need[n][0])
    size, tokens = need[worst]
    if requested == 0:
        return size
    if requested < size:
        raise ConfigError(f"config key 'see.max_text_bytes': {requested} bytes may not hold {tokens} tokens of policy "
                          f"{worst!r} (its longest token is {size // tokens} bytes); set it to >= {size}, or 0 to "
                          "size it automatically.")
    return requested


def _prompt_limit(spec, model) -> int:
    """A policy's prompt token limit: ``max_prompt_length``, else its context minus the completion length."""
    if spec.max_prompt_length:
        return spec.max_prompt_length
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context is None:
        return 1 << 30
    limit = int(context) - spec.sampling.max_new_tokens
    if limit < 1:
        raise ConfigError(f"config key 'policies.{spec.name}.sampling.max_new_tokens': {spec.sampling.max_new_tokens} "
                          f"leaves no room for a prompt in the model's context of {context} tokens; lower it.")
    return limit


def _host_state(run: Run, state: RunState) -> RunState:
    """What a checkpoint saves. One process: ``state`` (sharded arrays as they are). Several: orbax cannot
    save an array that lives inside one process of a multi-host run, so each policy's state is read where
    its mesh is and broadcast (`placement.fetch`), and every process saves the same host values."""
    if jax.process_count() == 1 or run.placement is None:
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

    def close(self) -> None:
        pass


class _LastInputs:
    """Wraps each policy's jitted ``update`` to keep a reference to the last (batch, see_view) it got, so a
    batch that made the update non-finite can be saved for inspection (no copy, no device sync)."""

    def __init__(self):
        self.inputs: dict[str, tuple] = {}

    def wrap(self, policy: Policy) -> Policy:
        update = policy.update

        def recorded(params, opt_state, batch, see_view, key):
            self.inputs[policy.name] = (batch, see_view)
            return update(params, opt_state, batch, see_view, key)

        return dataclasses.replace(policy, update=recorded)

    def save(self, name: str, path: Path, prompts: Sequence[Prompt], round_index: int) -> Path | None:
        """Write the last batch and SEE view of ``name`` as ``path`` (.npz); arrays named by their field path."""
        if name not in self.inputs:
            return None
        arrays = {"round": np.asarray(round_index), "prompts": np.asarray([p.text for p in prompts]),
                  "answers": np.asarray([p.answer for p in prompts])}
        for prefix, tree in zip(("batch", "view"), self.inputs[name]):
            for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                key = prefix + jax.tree_util.keystr(kp).replace("'", "").replace("[", ".").replace("]", "")
                arrays[key] = np.asarray(jax.device_get(leaf))
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path


def _warn_config_changes(out: Path, cfg: RunConfig) -> None:
    """On resume, warn about keys that differ from the config the run was started with."""
    try:
        old = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return

    def flat(d, pre=""):
        if isinstance(d, dict):
            return {k: v for key, val in d.items() for k, v in flat(val, f"{pre}{key}.").items()}
        if isinstance(d, list):
            return {k: v for i, val in enumerate(d) for k, v in flat(val, f"{pre}{i}.").items()}
        return {pre[:-1]: d}

    a, b = flat(old), flat(json.loads(json.dumps(to_dict(cfg))))
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k != "rounds")
    if changed:
        warnings.warn(f"resuming {out} with a config that differs from the one it started with in: "
                      f"{', '.join(changed)}", stacklevel=3)


def _reward_scorer(run: Run, reward_specs: Sequence[RewardSpec] | None) -> RewardScorer:
    specs = list(reward_specs) if reward_specs else [task_reward(run.task, timeout_s=run.cfg.reward_timeout_s)]
    return RewardScorer(specs, max_consecutive_failures=run.cfg.max_reward_failures)


def train(cfg: RunConfig, out_dir: str | Path, *, resume: bool = False, task: Task | None = None,
          reward_specs: Sequence[RewardSpec] | None = None, progress: bool = True) -> dict:
    """Run (or resume) an MRL run into ``out_dir``; returns the summary (also written as summary.json)."""
    out = Path(out_dir)
    ckpt = RunCheckpointer(out, keep=cfg.keep_checkpoints)
    latest = ckpt.latest_round()
    if latest is not None and not resume:
        ckpt.close()
        raise CheckpointError(f"{out} already holds checkpoints (latest round {latest}); pass --resume to continue "
                              "it or choose a new --out directory.")
    logged = max((int(r.get("round", -1)) for r in RunLog.read_records(out / "metrics.jsonl")), default=-1)
    if resume and latest is None and logged >= cfg.checkpoint_every:
        ckpt.close()  # the run had saved the checkpoint of round checkpoint_every - 1 before logging this round
        raise CheckpointError(
            f"--resume: {out / 'metrics.jsonl'} has rounds up to {logged} but {ckpt.directory} holds no complete "
            "checkpoint (deleted or moved?). Put the checkpoints back, or start a new --out directory (or delete "
            "metrics.jsonl and samples.jsonl to start this run over).")
    try:
        run = Run(cfg, task=task, warm=not (resume and latest is not None))
        state, start = run.state, 0
        if resume and latest is not None:
            _warn_config_changes(out, cfg)
            # several processes: read onto the host, then place (orbax restores no process-local array there)
            template = run.state if jax.process_count() == 1 else host_template(run.state)
            state, meta = ckpt.restore(template)
            state = run.place(state)
            start = int(meta["round"]) + 1
    except BaseException:
        ckpt.close()
        raise
    # on resume, drop the records (and TensorBoard events) of rounds after the checkpoint: they are redone
    primary = jax.process_index() == 0   # multi-host: only process 0 writes logs, config, plan and summary
    log = RunLog(out, progress=progress, purge_step=start if resume else None, rounds=(start, cfg.rounds),
                 report_to=cfg.report_to, config=to_dict(cfg)) if primary else _NullLog()
    if resume:
        log.truncate_after(start - 1)
    if primary:
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    if run.placement is not None and primary:
        plan = run.placement.plan
        if progress:
            print(str(plan), flush=True)
        (out / "plan.txt").write_text(str(plan) + "\n")
        (out / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    recorder = _LastInputs()
    policies = [recorder.wrap(p) for p in run.policies]
    skipped = {p.name: 0 for p in run.policies}
    history = []
    r = start
    try:
        with _reward_scorer(run, reward_specs) as scorer:
            for r in range(start, cfg.rounds):
                prompts, dense, prompt_counts = run.round_data(r)
                state, metrics, samples = run_round(
                    policies, state, prompts, dense, scorer=scorer, key=run.round_key(r), round_index=r,
                    num_generations=cfg.num_generations, view_shape=run.view_shape)
                for m in metrics.values():
                    m.update(prompt_counts)
                log.log_round(r, metrics)
                log.log_samples(r, samples)
                history.append({n: m["reward/mean"] for n, m in metrics.items()})
                for name, m in metrics.items():
                    skipped[name] = skipped[name] + 1 if m.get("skipped", 0.0) > 0 else 0
                bad = [n for n, c in skipped.items() if c >= cfg.max_skipped_updates]
                if (r + 1) % cfg.checkpoint_every == 0 or r + 1 == cfg.rounds or bad:
                    ckpt.save(r, _host_state(run, state), {"round": r})
                if bad:
                    saved = [recorder.save(n, out / f"failed_batch_{n}_round{r}.npz", prompts, r) for n in bad]
                    raise TrainingStopped(
                        f"policies {bad} skipped {cfg.max_skipped_updates} updates in a row (non-finite loss or "
                        f"gradient); state saved at round {r} in {ckpt.directory}; the last batch of each is in "
                        f"{[str(p) for p in saved if p]}. Lower the learning rate or check the rewards, then --resume.")
                if cfg.eval_every and (r + 1) % cfg.eval_every == 0:
                    log.log_round(r, {f"{n}/eval": {"success": v["success"]}
                                      for n, v in run.evaluate(state, cfg.eval_prompts).items()})
    except RewardFailure as e:
        done = ckpt.latest_round()
        raise RewardFailure(
            f"{e}\nThe run stopped in round {r}; that round was not logged. The last complete checkpoint is round "
            f"{done} in {ckpt.directory}: fix the reward, then resume with --resume.") from e
    finally:
        log.close()
        ckpt.close()
    final = run.evaluate(state, cfg.eval_prompts)
    summary = {"rounds": cfg.rounds, "resumed_from": start - 1 if start else None, "prompts": run.prompt_stats,
               "policies": {p.name: {"params": param_count(s), "eval": final[p.name]}
                            for p, s in zip(run.policies, state.policies)}}
    if run.placement is not None:
        summary["plan"] = run.placement.to_dict()
        for name, pl in placement_summary(run.placement, state.policies).items():
            summary["policies"][name]["placement"] = pl
    if primary:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def train_from_yaml(config_path, out_dir, *, resume=False, coordinator=None, num_processes=None,
                    process_id=None) -> dict:
    """``mrl train``: multi-host set-up (a no-op on one host), config load, ``train``."""
    from mrl_jax.mwra import initialize_distributed

    initialize_distributed(coordinator, num_processes, process_id)
    return train(load_yaml(RunConfig, config_path), out_dir, resume=resume)


def evaluate_from_yaml(config_path, run_dir) -> dict:
    """``mrl eval``: held-out success per policy from the run's latest checkpoint."""
    cfg = load_yaml(RunConfig, config_path)
    run = Run(cfg, warm=False)
    ckpt = RunCheckpointer(run_dir, keep=cfg.keep_checkpoints)
    try:
        state, meta = ckpt.restore(run.state)
        state = run.place(state)
    finally:
        ckpt.close()
    return {"round": meta["round"], "eval": run.evaluate(state, cfg.eval_prompts)}


__all__ = ["Run", "TrainingStopped", "build_task", "evaluate_from_yaml", "train", "train_from_yaml", "ConfigError"]
