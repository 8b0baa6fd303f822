"""One MRL round as a function composing the layers (DESIGN.md, data flow):

    rollout_i (dispatched for every policy before any is read) -> decode -> rewards (isolated)
    -> SEE.add of every policy's experience -> per consumer: THL view of the peers' texts
    -> update_i (dispatched for every policy) -> metrics

``run_round(policies, state, inputs, scorer) -> (state, metrics, samples)`` has no hidden state: the
arrays come in through ``RunState`` and go out in a new one; ``inputs`` (``RoundInputs``) holds the round's
prompts, dense SEE prompt ids, key and index. Each phase returns one immutable value per policy: the rewarded
samples (``Sampled``), SEE counters, views, the staged own rows (``rows.Rows``, the record the loss reads) and
the update's results. Wall time is split per phase in ``metrics[name]["time/<phase>"]``.

Placement (MWRA, `mrl_jax.trainer.placement`): every policy has its mesh (``Run`` places them; one device by
default) and its steps jitted for it. Its prompt rows are padded to a multiple of the data axis with copies of the last prompt (their
samples are dropped on the host: the sampler's noise per row does not depend on the row count, so the real
rows are those of an unpadded run). The update batch is put on the mesh explicitly, rows split over the data
axis where P and P*G divide it and replicated otherwise (own GRPO rows are not padded: a padding group would
enter the group / batch statistics and the per-sequence denominators); the consumer's SEE view goes there by
``mwra.to_mesh`` via the host. Nothing crosses meshes implicitly (``device_guard="disallow"`` proves it).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mrl_jax import mwra
from mrl_jax import see as see_lib
from mrl_jax import thl
from mrl_jax.sampler import Rollout
from mrl_jax.sampler import drive, launch
from mrl_jax.rows import Rows, own_rows
from mrl_jax.tasks import ScoreResult, gate_success
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
from mrl_jax.trainer.placement import fetch, pad_prompts
from mrl_jax.trainer.policy import Policy, PolicyState


@struct.dataclass
class RunState:
    """Everything a round changes: each policy's arrays and the shared experience buffer."""

    policies: tuple
    see: see_lib.SEE


@dataclasses.dataclass(frozen=True)
class RoundInputs:
    """One round's data: ``prompts`` [P], their dense SEE prompt ids ``dense_ids int32[P]``, the round's PRNG
    ``key``, its ``index`` and the prompt-length counts (``data/prompts_rejected``, ``data/prompts_truncated``,
    copied into every policy's metrics)."""

    index: int
    prompts: tuple
    dense_ids: np.ndarray
    key: jax.Array
    counts: dict = dataclasses.field(default_factory=dict)
    oversampler: Any = None   # dynamic sampling (``trainer.dynamic_sampling.Oversampler``); None = off


_see_add = jax.jit(see_lib.add)


ROUND_PHASES = ("rollout", "decode", "rewards", "see", "views", "thl", "stage", "update")
ROLLOUT, UPDATE = 0, 1   # the streams of a round key (`RoundKeys`), folded in by name


class PhaseTimer:
    """Wall time per phase of a round (seconds). Phases nest exclusively: time spent in an inner phase counts
    for the inner phase only (the ``thl`` alignments inside ``views``), so the phases add up to the round."""

    def __init__(self, phases: Sequence[str] = ()):
        self.times: dict[str, float] = dict.fromkeys(phases, 0.0)   # reported even when a phase did not run
        self._inner: list[float] = []   # per open phase: seconds its inner phases took

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.perf_counter() - t0
            inner = self._inner.pop()
            self.times[phase] = self.times.get(phase, 0.0) + took - inner
            if self._inner:
                self._inner[-1] += took


@dataclasses.dataclass(frozen=True)
class Sampled:
    """One policy's samples of the round on the host, once rewarded: prompt_ids int32[P, Tp] and prompt_mask
    (prefilled once), rollout (``Rollout``: tokens int32[P*G, Tc], logprobs f32[P*G, Tc], mask, lengths,
    truncated), texts [P*G] (decoded completions), content [P*G] (their token ids without stop token / pads),
    score (``ScoreResult``: rewards f32[P*G], stats)."""

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    rollout: Rollout
    texts: list[str]
    content: list[np.ndarray]
    score: ScoreResult


def _aligner(consumer: Policy, policies: Sequence[Policy], max_chunks: int, thl_metrics: list, timer: PhaseTimer):
    """``align_batch(texts, sources, src_ids) -> see.ViewAlignment`` for ``see.build_view``. Rows from a source
    with the consumer's tokenization (its own replayed successes, a peer sharing its tokenizer) keep their
    sampled ids (``ViewAlignment.identity``: re-encoding the text could change them); the others get one THL
    ``align_batch`` per source tokenizer (its metrics appended to ``thl_metrics``), timed as phase ``thl``."""

    def align(texts, sources, src_ids) -> see_lib.ViewAlignment:
        sources = np.asarray(sources)
        parts = []
        for j in np.unique(sources):
            rows = np.nonzero(sources == j)[0]
            tok = policies[int(j)].tokenizer
            if tok.fingerprint == consumer.tokenizer.fingerprint:   # cached per tokenizer object
                parts.append((rows, see_lib.ViewAlignment.identity([src_ids[m] for m in rows])))
                continue
            with timer("thl"):
                ba = thl.align_batch([texts[m] for m in rows], tok, consumer.tokenizer,
                                     [src_ids[m] for m in rows], max_chunks=max_chunks)
            thl_metrics.append(ba.metrics)
            parts.append((rows, ba))
        return see_lib.ViewAlignment.from_batches(len(texts), parts)

    return align


def _mean_metrics(dicts: list[dict], prefix: str) -> dict:
    keys = {k for d in dicts for k in d}
    out = {}
    for k in keys:
        vals = [float(d[k]) for d in dicts if k in d and np.isscalar(d[k])]
        if vals:
            out[f"{prefix}{k}"] = float(np.mean(vals))
    return out


def _replicated(pol: Policy, x):
    """``x`` (a key, a scalar) put on ``pol``'s mesh, replicated (explicit)."""
    return mwra.put(x, jax.sharding.NamedSharding(pol.mesh, mwra.REPLICATED))


def _dispatch_rollout(pol: Policy, ps: PolicyState, ids: np.ndarray, mask: np.ndarray, key):
    """Launch policy ``pol``'s rollout on its mesh (not awaited): prompt rows padded to a multiple of the data
    axis (copies of the last prompt; their samples are dropped by `_trim`) and put there explicitly; the slot
    sampler (`mrl_jax.sampler.launch`: its round's one program, read by `drive`; ``pol.slots`` slots over the data axis, rows
    admitted as slots free), on one process or several."""
    pids, pmask = pad_prompts(ids, mask, int(pol.mesh.devices.size))
    return launch(pol.graphdef, ps.params, pids, pmask, key, pol.sampling, num_samples=pol.num_generations,
                  slots=pol.slots, width=max(pol.slot_width, pids.shape[1]), mesh=pol.mesh,
                  shrink=pol.spec.sampling.ladder, ladder=pol.spec.sampling.ladder_shape)


def _trim(out, rows: int):
    """The first ``rows`` rows of a fetched rollout (drops the padding prompts' samples)."""
    return jax.tree.map(lambda x: x[:rows], out)


def _update_policy(pol: Policy, ps: PolicyState, rows: Rows, view, key, round_index: int):
    """The round's ``num_iterations`` updates of one policy on its own rows, the reference synced as TRL's callback
    would: one jitted step (`mrl_jax.learner.iterate`); ``key`` and the count of earlier updates on its mesh."""
    step = _replicated(pol, np.int32(round_index * pol.spec.grpo.num_iterations))
    params, opt_state, ref, m = pol.update(ps.params, ps.opt_state, ps.ref_params, rows, view, key, step)
    return PolicyState(params=params, opt_state=opt_state, ref_params=ref), m


class RoundKeys(NamedTuple):
    """A round key's streams by name, one key per policy in each: ``rollout[i]`` = ``split(fold_in(key, ROLLOUT),
    N)[i]`` (policy i's sampling noise), ``update[i]`` likewise from ``fold_in(key, UPDATE)`` (its update's
    dropout and probe keys). A new stream is a new name: the others keep their keys."""

    rollout: list
    update: list

    @classmethod
    def of(cls, key, num_policies: int) -> "RoundKeys":
        stream = lambda name: list(jax.random.split(jax.random.fold_in(key, name), num_policies))
        return cls(rollout=stream(ROLLOUT), update=stream(UPDATE))


def _rollouts(policies: Sequence[Policy], states: Sequence[PolicyState], texts: Sequence[str], keys: "RoundKeys",
              guard, t0: float) -> tuple[list, list, list]:
    """([(prompt_ids, prompt_mask, Rollout)] on the host, [stamps], [sampler figures]) of every policy: every
    rollout dispatched before any result is read; results (and the sampler's counts) fetched to the host on every
    process, trimmed."""
    encoded, launched, stamps = [], [], []
    for pol, ps in zip(policies, states):
        ids, mask, _ = encode_prompts(pol.tokenizer, pol.prompt_format, texts, max_width=pol.prompt_limit)  # [P, Tp]
        with guard():
            launched.append(_dispatch_rollout(pol, ps, ids, mask, keys.rollout[pol.index]))
        encoded.append((ids, mask))
        stamps.append({"rollout_dispatched": time.perf_counter() - t0})
    stats: list = []
    with guard():   # the slot samplers to the end, one program of each policy in turn
        launched = drive(launched, stats)
    out, samplers = [], []
    for pol, (ids, mask), run, st, info in zip(policies, encoded, launched, stamps, stats):
        st["rollout_read"] = time.perf_counter() - t0
        counts = None if info is None else info.get("counts")   # a mesh spanning processes: the mesh's array
        whole, counts = fetch(pol.mesh, (run, counts))   # several processes: broadcast, in one read
        out.append((ids, mask, _trim(whole, len(texts) * pol.num_generations)))
        st["rollout_ready"] = time.perf_counter() - t0
        samplers.append(_sampler_metrics(info, counts, whole))
    return out, stamps, samplers


def _sampler_metrics(stats: dict | None, counts, rollout) -> dict:
    """The slot sampler's figures of one rollout (``sampler/`` metrics): row-steps per kept token (1.0: no slot ever
    idle), decode steps and S, the padding prompts' rows counted as the sampler ran them. ``counts``: int[3] (decode
    steps, row-steps, deepest rung) fetched from a mesh spanning processes (`mrl_jax.sampler.read`), else None
    (``stats`` holds them). {} for a rollout that came without the sampler's figures (``stats`` None)."""
    if stats is None:
        return {}
    if counts is not None:
        decode, row_steps = np.asarray(counts).tolist()[:2]
    else:
        decode, row_steps = stats["decode_steps"], stats["row_steps"]
    return {"sampler/row_steps_per_token": row_steps / max(int(np.asarray(rollout.lengths).sum()), 1),
            "sampler/decode_steps": float(decode), "sampler/slots": float(stats["slots"])}


def _accuracy(score):
    """The verifier's values of a ``ScoreResult`` (None: the rewards are the verifier's own)."""
    return getattr(score, "accuracy", None)


def _add_experience(see, policies: Sequence[Policy], sampled: Sequence[Sampled], inputs: RoundInputs):
    """Every policy's samples of the round into SEE (``see.add``); returns (the new buffer, [insertion counters])."""
    max_bytes, max_src = see.rollouts.text.shape[1], see.rollouts.src_ids.shape[1]
    infos = []
    for pol, s in zip(policies, sampled):   # the behaviour density a peer's importance weight needs: the
        out = s.rollout                     # filtered one if filtering
        lp = out.sampling_logprobs if pol.sampling.filters else out.logprobs
        lps = [lp[b, :len(c)] for b, c in enumerate(s.content)]
        rewards = gate_success(s.score.rewards, _accuracy(s.score), see.tau)   # success = the verifier's
        exp = see_lib.make_experience(s.texts, np.repeat(inputs.dense_ids, pol.num_generations), pol.index,
                                      rewards, src_ids=s.content, src_logp=lps, truncated=out.truncated,
                                      round=inputs.index, max_bytes=max_bytes, max_src_tokens=max_src)
        see, info = _see_add(see, exp)
        infos.append(info)
    return see, infos


def _views(see, policies: Sequence[Policy], dense_ids: np.ndarray, timer: PhaseTimer) -> tuple[list, list]:
    """([SeeView], [THL metrics of each align_batch call]) of every consumer: THL-aligned peer rows when its
    probe needs peers, else an empty view. The SEE is read to the host once for every consumer."""
    see = jax.device_get(see)
    views, thl_metrics = [], []
    for pol in policies:
        vs, Tc, metrics = pol.view_shape, pol.max_completion_length, []
        if pol.probe.needs_peers:
            view = see_lib.build_view(
                see, pol.index, dense_ids, _aligner(pol, policies, Tc, metrics, timer), k_rollouts=vs.peer_rollouts,
                k_successes=vs.peer_successes, k_own=vs.own_successes, max_completion_length=Tc, max_chunks=Tc,
                pad_id=pol.sampling.pad_id, eos_id=pol.tokenizer.eos_id)
        else:
            stats = see_lib.peer_stats(see, pol.index, dense_ids)
            view = see_lib.empty_view(len(dense_ids), vs.slots, Tc, Tc, len(policies),
                                      consumer=pol.index).replace(peer_stats=jnp.asarray(stats))
        views.append(view)
        thl_metrics.append(metrics)
    return views, thl_metrics


def _stage(pol: Policy, s: Sampled, view, keys: "RoundKeys") -> tuple:
    """(own rows, view, update key) of one policy on its mesh: the rows built from its rollout on the host
    (``rows.own_rows``), then placed (rows split over the data axis where they divide it)."""
    out = s.rollout
    rows = own_rows(np.asarray(s.prompt_ids), np.asarray(s.prompt_mask), np.asarray(out.tokens),
                    np.asarray(out.mask, np.float32), np.asarray(out.logprobs), np.zeros(out.logprobs.shape, np.float32),
                    np.asarray(s.score.rewards, np.float32), np.asarray(out.truncated), consumer=pol.index)
    rows = mwra.shard_rows(rows, pol.mesh, strict=False)
    view = mwra.to_mesh(view, pol.mesh, via_host=True)   # SEE (host / default device) -> consumer
    return rows, view, _replicated(pol, keys.update[pol.index])


def _updates(policies: Sequence[Policy], states: Sequence[PolicyState], staged: Sequence[tuple], round_index: int,
             guard, t0: float, on_update=None) -> tuple[list, list, list]:
    """([new PolicyState], [update metrics on the host], [stamps]): every policy's update dispatched before any
    metric is read (``on_update(policy, rows, view)`` just before each); the metrics fetched once."""
    new_states, raws, stamps = [], [], []
    for pol, ps, (rows, view, ukey) in zip(policies, states, staged):
        if on_update is not None:
            on_update(pol, rows, view)
        with guard():
            new, raw = _update_policy(pol, ps, rows, view, ukey, round_index)
        new_states.append(new)
        raws.append(raw)
        stamps.append({"update_dispatched": time.perf_counter() - t0})
    for raw, st in zip(raws, stamps):
        st["update_read"] = time.perf_counter() - t0
        jax.block_until_ready(raw)
        st["update_ready"] = time.perf_counter() - t0
    if jax.process_count() == 1:
        raws = jax.device_get(raws)   # the round's one metrics fetch
    else:   # each policy's metrics read where its mesh is, broadcast to every process
        raws = [fetch(pol.mesh, raw) for pol, raw in zip(policies, raws)]
    return new_states, raws, stamps


def _policy_metrics(pol: Policy, s: Sampled, raw: dict, see_info: dict, thl_metrics: list, stamps: dict,
                    sampler: dict, inputs: RoundInputs, tau: float, times: dict) -> dict:
    """One policy's scalar metrics of the round and its per-prompt outcomes (``groups``)."""
    r = s.score.rewards.reshape(len(inputs.prompts), pol.num_generations)
    m = {k: float(np.asarray(v)) for k, v in raw.items() if np.ndim(v) == 0}
    m.update({k: v for k, v in s.score.stats.items() if np.isscalar(v)})
    acc = _accuracy(s.score)
    success = (r if acc is None else np.asarray(acc).reshape(r.shape)) >= tau
    m.update({"reward/mean": float(r.mean()), "reward/success_rate": float(success.mean()),
              "completion/mean_length": float(np.asarray(s.rollout.lengths).mean()),
              "completion/truncated": float(np.asarray(s.rollout.truncated).mean())})
    m.update({f"see/{k}": float(np.asarray(v)) for k, v in see_info.items()})
    m.update(_mean_metrics(thl_metrics, "thl/"))
    m.update({f"time/{k}": v for k, v in times.items()})
    m.update({f"time/{k}": v for k, v in stamps.items()})
    m.update(sampler)
    # per-prompt outcomes (`mrl report`'s complementarity matrix): not a scalar; RunLog writes
    # it to groups.jsonl, not metrics.jsonl. rewards f32[P, G] in prompt order, tau = SEE success threshold.
    m["groups"] = {"prompt_ids": [p.id for p in inputs.prompts], "rewards": r.tolist(), "tau": float(tau)}
    if acc is not None:   # success is the verifier's, not reward >= tau (rewards: config with other components)
        m["groups"]["success"] = success.tolist()
    m.update(inputs.counts)
    return m


def _sample(policies: Sequence[Policy], states: Sequence[PolicyState], prompts: Sequence, keys: "RoundKeys", scorer,
            guard, timer: PhaseTimer, t0: float) -> tuple[list, list, list]:
    """([Sampled], [stamps], [sampler figures]): phases rollout, decode and rewards of ``prompts`` for every
    policy (``keys``: the round's, or an extra batch's, `RoundKeys`)."""
    with timer("rollout"):
        launched, stamps, samplers = _rollouts(policies, states, [p.text for p in prompts], keys, guard, t0)
    with timer("decode"):
        decoded = [decode_completions(pol.tokenizer, out.tokens, out.mask, pol.sampling.eos_ids)
                   for pol, (_, _, out) in zip(policies, launched)]
    with timer("rewards"):
        scores = [scorer.score([p for p in prompts for _ in range(pol.num_generations)], texts, completion_ids=content)
                  for pol, (texts, content) in zip(policies, decoded)]
    return [Sampled(*ln, *dec, score) for ln, dec, score in zip(launched, decoded, scores)], stamps, samplers


def run_round(policies: Sequence[Policy], state: RunState, inputs: RoundInputs, scorer, *,
              num_samples_logged: int = 2, device_guard: str | None = None,
              on_update: Callable | None = None) -> tuple[RunState, dict, list]:
    """Run one round for every policy on ``inputs.prompts``; returns ``(state, {policy: metrics}, samples)``.

    Concurrency: every policy's rollout is dispatched before any result is read, every update before any
    metric is read, and the metrics are fetched once. Per-policy timestamps (seconds since the round began)
    go to ``time/rollout_dispatched``, ``time/rollout_read`` (reading its result begins), ``time/rollout_ready``
    (result on the host), ``time/update_dispatched``, ``time/update_read`` and ``time/update_ready``; a first
    round traces and compiles inside each dispatch, so overlap shows from the second round on.
    ``device_guard``: a ``jax.transfer_guard`` level (e.g. ``"disallow"``) around the device parts (rollout and
    update dispatch); every transfer there is an explicit ``mwra.put``. ``on_update(policy, rows, view)``: called
    with each policy's update inputs before its update is dispatched (e.g. to keep them for a failed update).
    """
    timer, t0 = PhaseTimer(ROUND_PHASES), time.perf_counter()
    guard = (lambda: jax.transfer_guard(device_guard)) if device_guard else nullcontext
    prompts, states, N = list(inputs.prompts), state.policies, len(policies)
    keys = RoundKeys.of(inputs.key, N)   # split here, outside any transfer guard
    sampled, stamps, samplers = _sample(policies, states, prompts, keys, scorer, guard, timer, t0)
    if inputs.oversampler is not None:   # dynamic sampling: more prompt batches, the kept batch's samples
        def more(extra: RoundInputs) -> list:
            return _sample(policies, states, list(extra.prompts), RoundKeys.of(extra.key, N), scorer, guard, timer,
                           t0)[0]

        sampled, inputs = inputs.oversampler.fill(policies, sampled, inputs, float(state.see.tau), more)
        prompts = list(inputs.prompts)
    with timer("see"):   # ready before the phase ends: the views read it at once, and its time is the SEE's
        see, see_infos = _add_experience(state.see, policies, sampled, inputs)
        see = jax.block_until_ready(see)
    with timer("views"):   # SEE selection and view assembly; the THL alignments inside it: phase "thl"
        views, thl_metrics = _views(see, policies, inputs.dense_ids, timer)
    with timer("stage"):
        staged = [_stage(pol, s, view, keys) for pol, s, view in zip(policies, sampled, views)]
    with timer("update"):
        new_states, raws, update_stamps = _updates(policies, states, staged, inputs.index, guard, t0, on_update)
    metrics, samples = {}, []
    for i, (pol, s) in enumerate(zip(policies, sampled)):
        metrics[pol.name] = _policy_metrics(pol, s, raws[i], see_infos[i], thl_metrics[i],
                                            {**stamps[i], **update_stamps[i]}, samplers[i], inputs, see.tau,
                                            timer.times)
        G = pol.num_generations
        samples += [{"policy": pol.name, "prompt": p.text, "answer": p.answer, "completion": s.texts[k * G],
                     "reward": float(s.score.rewards[k * G])} for k, p in enumerate(prompts[:num_samples_logged])]
    return RunState(policies=tuple(new_states), see=see), metrics, samples
