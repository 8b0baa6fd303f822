"""One MRL round as a function composing the layers (DESIGN.md, data flow):

    rollout_i (dispatched for every policy before any is read) -> decode -> rewards (isolated)
    -> SEE.add of every policy's experience -> per consumer: THL view of the peers' texts
    -> update_i (dispatched for every policy) -> metrics

``run_round(policies, state, inputs, scorer) -> (state, metrics, samples)`` has no hidden state: the
arrays come in through ``RunState`` and go out in a new one; ``inputs`` (``RoundInputs``) holds the round's
prompts, dense SEE prompt ids, key and index. Inside, each policy's pieces of the round travel in one
``_Lane`` record. Wall time is split per phase in ``metrics[name]["time/<phase>"]``.

Placement (MWRA, `mrl_jax.trainer.placement`): a policy with a ``mesh`` has its rollout and update jitted for
that mesh. Its prompt rows are padded to a multiple of the data axis with copies of the last prompt (their
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
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mrl_jax import mwra
from mrl_jax import see as see_lib
from mrl_jax import thl
from mrl_jax.learner import Batch
from mrl_jax import rollout as _rollout
from mrl_jax.rollout import generate
from mrl_jax.tasks import gate_success
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
from mrl_jax.trainer.placement import fetch, pad_prompts
from mrl_jax.trainer.policy import Policy, PolicyState
from mrl_jax.trainer.reference import maybe_sync


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


@dataclasses.dataclass
class _Lane:
    """One policy's pieces of one round, filled phase by phase (host arrays unless noted)."""

    pol: Policy
    ps: PolicyState
    ids: np.ndarray = None          # int32[P, Tp] prompt ids (prefilled once)
    mask: np.ndarray = None         # [P, Tp]
    out: Any = None                 # Rollout: tokens int32[P*G, Tc], logprobs f32[P*G, Tc], mask, lengths, truncated
    texts: list = None              # [P*G] decoded completions
    content: list = None            # [P*G] content token ids (no stop token / pads)
    score: Any = None               # ScoreResult: rewards f32[P*G], stats
    see_info: dict = None           # SEE insertion counters
    view: Any = None                # SeeView of this consumer
    thl: list = dataclasses.field(default_factory=list)   # THL metrics of each align_batch call
    staged: tuple = None            # (Batch, SeeView, update keys) on the policy's mesh
    new_state: PolicyState = None
    raw: dict = None                # update metrics (device, then host)
    stamps: dict = dataclasses.field(default_factory=dict)   # seconds since the round began


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
    """``x`` (a key, a scalar) put on ``pol``'s mesh, replicated (explicit); unchanged without a mesh."""
    if pol.mesh is None:
        return x
    return mwra.put(x, jax.sharding.NamedSharding(pol.mesh, mwra.REPLICATED))


def _dispatch_rollout(pol: Policy, ps: PolicyState, ids: np.ndarray, mask: np.ndarray, key):
    """Launch policy ``pol``'s rollout (not awaited). On a mesh: prompt rows padded to a multiple of the data
    axis (copies of the last prompt; their samples are dropped by `_trim`) and put there explicitly."""
    if pol.mesh is None or pol.rollout is None or generate is not _rollout.generate:
        # unpinned: no mesh, or this module's ``generate`` replaced (tests inject degenerate samples that way)
        return generate(pol.graphdef, ps.params, jnp.asarray(ids), jnp.asarray(mask), key, pol.sampling,
                        num_samples=pol.num_generations)
    pids, pmask = pad_prompts(ids, mask, int(pol.mesh.devices.size))
    rows = mwra.batch_sharding(pol.mesh)
    return pol.rollout(ps.params, mwra.put(pids, rows), mwra.put(pmask, rows), _replicated(pol, key))


def _trim(out, rows: int):
    """The first ``rows`` rows of a fetched rollout (drops the padding prompts' samples)."""
    return jax.tree.map(lambda x: x[:rows], out)


def _iteration_keys(pol: Policy, key) -> list:
    """The keys of ``pol``'s ``num_iterations`` updates (``fold_in(key, it)``), on its mesh."""
    return [_replicated(pol, jax.random.fold_in(key, it)) for it in range(pol.spec.grpo.num_iterations)]


def _update_policy(pol: Policy, ps: PolicyState, batch: Batch, view, keys: Sequence, round_index: int):
    """``num_iterations`` updates of one policy on its batch (reference synced as TRL's callback would);
    ``keys``: one per iteration (`_iteration_keys`)."""
    params, opt_state, ref = ps.params, ps.opt_state, ps.ref_params
    mu = pol.spec.grpo.num_iterations
    skipped = None
    for it in range(mu):
        params, opt_state, m = pol.update(params, opt_state, batch, view, keys[it])
        skipped = m["skipped"] if skipped is None else skipped + m["skipped"]   # on the mesh: no transfer
        ref = maybe_sync(pol.spec, params, ref, round_index * mu + it + 1)
    m = dict(m, skipped=skipped)   # any skipped iteration counts (the last one's other metrics are kept)
    return PolicyState(params=params, opt_state=opt_state, ref_params=ref), m


def _rollouts(lanes: Sequence[_Lane], texts: Sequence[str], keys: Sequence, guard, t0: float) -> None:
    """Every policy's rollout dispatched before any result is read; results fetched to the host, trimmed."""
    for ln in lanes:
        ln.ids, ln.mask, _ = encode_prompts(ln.pol.tokenizer, ln.pol.prompt_format, texts,
                                            max_width=ln.pol.prompt_limit)   # [P, Tp]
        with guard():
            ln.out = _dispatch_rollout(ln.pol, ln.ps, ln.ids, ln.mask, keys[ln.pol.index])
        ln.stamps["rollout_dispatched"] = time.perf_counter() - t0
    for ln in lanes:
        ln.stamps["rollout_read"] = time.perf_counter() - t0
        ln.out = _trim(fetch(ln.pol.mesh, ln.out), len(texts) * ln.pol.num_generations)   # several processes: broadcast
        ln.stamps["rollout_ready"] = time.perf_counter() - t0


def _accuracy(score):
    """The verifier's values of a ``ScoreResult`` (None: the rewards are the verifier's own)."""
    return getattr(score, "accuracy", None)


def _add_experience(see, lanes: Sequence[_Lane], inputs: RoundInputs):
    """Every policy's samples of the round into SEE (``see.add``); returns the new buffer."""
    max_bytes, max_src = see.rollouts.text.shape[1], see.rollouts.src_ids.shape[1]
    for ln in lanes:   # the behaviour density a peer's importance weight needs: the filtered one if filtering
        lp = ln.out.sampling_logprobs if ln.pol.sampling.filters else ln.out.logprobs
        lps = [lp[b, :len(c)] for b, c in enumerate(ln.content)]
        rewards = gate_success(ln.score.rewards, _accuracy(ln.score), see.tau)   # success = the verifier's
        exp = see_lib.make_experience(ln.texts, np.repeat(inputs.dense_ids, ln.pol.num_generations), ln.pol.index,
                                      rewards, src_ids=ln.content, src_logp=lps, truncated=ln.out.truncated,
                                      round=inputs.index, max_bytes=max_bytes, max_src_tokens=max_src)
        see, ln.see_info = _see_add(see, exp)
    return see


def _views(see, lanes: Sequence[_Lane], dense_ids: np.ndarray, timer: PhaseTimer) -> None:
    """Each consumer's SEE view: THL-aligned peer rows when its probe needs peers, else an empty view. The
    SEE is read to the host once for every consumer."""
    policies, see = [ln.pol for ln in lanes], jax.device_get(see)
    for ln in lanes:
        pol, vs, Tc = ln.pol, ln.pol.view_shape, ln.pol.completion_length
        if pol.probe.needs_peers:
            ln.view = see_lib.build_view(
                see, pol.index, dense_ids, _aligner(pol, policies, Tc, ln.thl, timer), k_rollouts=vs.peer_rollouts,
                k_successes=vs.peer_successes, k_own=vs.own_successes, max_completion_len=Tc, max_chunks=Tc,
                pad_id=pol.sampling.pad_id, eos_id=pol.tokenizer.eos_id)
        else:
            stats = see_lib.peer_stats(see, pol.index, dense_ids)
            ln.view = see_lib.empty_view(len(dense_ids), vs.slots, Tc, Tc, len(lanes), consumer=pol.index,
                                         tau=see.tau).replace(peer_stats=jnp.asarray(stats))


def _stage(lanes: Sequence[_Lane], keys: Sequence) -> None:
    """Every policy's update inputs on its mesh (before any update is dispatched)."""
    for ln in lanes:
        pol, out, view = ln.pol, ln.out, ln.view
        if pol.mesh is None:
            batch = Batch(prompt_ids=jnp.asarray(ln.ids), prompt_mask=jnp.asarray(ln.mask),
                          completion_ids=jnp.asarray(out.tokens), completion_mask=jnp.asarray(out.mask, jnp.float32),
                          old_logp=jnp.asarray(out.logprobs), ref_logp=jnp.zeros(out.logprobs.shape, jnp.float32),
                          rewards=jnp.asarray(ln.score.rewards), truncated=jnp.asarray(out.truncated))
        else:   # host numpy -> the policy's mesh, rows split over the data axis where they divide it
            batch = mwra.shard_batch(Batch(
                prompt_ids=np.asarray(ln.ids), prompt_mask=np.asarray(ln.mask), completion_ids=np.asarray(out.tokens),
                completion_mask=np.asarray(out.mask, np.float32), old_logp=np.asarray(out.logprobs),
                ref_logp=np.zeros(out.logprobs.shape, np.float32), rewards=np.asarray(ln.score.rewards, np.float32),
                truncated=np.asarray(out.truncated)), pol.mesh, strict=False)
            view = mwra.to_mesh(view, pol.mesh, via_host=True)   # SEE (host / default device) -> consumer
        ln.staged = (batch, view, _iteration_keys(pol, keys[len(lanes) + pol.index]))


def _updates(lanes: Sequence[_Lane], round_index: int, guard, t0: float) -> None:
    """Every policy's update dispatched before any metric is read; the metrics fetched once."""
    for ln in lanes:
        batch, view, ukeys = ln.staged
        with guard():
            if ln.ps.ref_params is not None:      # beta > 0: the frozen reference's log-probs of the own rows
                batch = batch.replace(ref_logp=ln.pol.ref_logp(ln.ps.ref_params, batch))
            ln.new_state, ln.raw = _update_policy(ln.pol, ln.ps, batch, view, ukeys, round_index)
        ln.stamps["update_dispatched"] = time.perf_counter() - t0
    for ln in lanes:
        ln.stamps["update_read"] = time.perf_counter() - t0
        jax.block_until_ready(ln.raw)
        ln.stamps["update_ready"] = time.perf_counter() - t0
    if jax.process_count() == 1:
        raws = jax.device_get([ln.raw for ln in lanes])   # the round's one metrics fetch
    else:   # each policy's metrics read where its mesh is, broadcast to every process
        raws = [fetch(ln.pol.mesh, ln.raw) for ln in lanes]
    for ln, raw in zip(lanes, raws):
        ln.raw = raw


def _lane_metrics(ln: _Lane, inputs: RoundInputs, tau: float, times: dict) -> dict:
    """One policy's scalar metrics of the round and its per-prompt outcomes (``groups``)."""
    r = ln.score.rewards.reshape(len(inputs.prompts), ln.pol.num_generations)
    m = {k: float(np.asarray(v)) for k, v in ln.raw.items() if np.ndim(v) == 0}
    m.update({k: v for k, v in ln.score.stats.items() if np.isscalar(v)})
    acc = _accuracy(ln.score)
    success = (r if acc is None else np.asarray(acc).reshape(r.shape)) >= tau
    m.update({"reward/mean": float(r.mean()), "reward/success_rate": float(success.mean()),
              "completion/mean_length": float(np.asarray(ln.out.lengths).mean()),
              "completion/truncated": float(np.asarray(ln.out.truncated).mean())})
    m.update({f"see/{k}": float(np.asarray(v)) for k, v in ln.see_info.items()})
    m.update(_mean_metrics(ln.thl, "thl/"))
    m.update({f"time/{k}": v for k, v in times.items()})
    m.update({f"time/{k}": v for k, v in ln.stamps.items()})
    # -- per-prompt outcomes (issue 16, `mrl report`'s complementarity matrix): not a scalar; RunLog writes
    # it to groups.jsonl, not metrics.jsonl. rewards f32[P, G] in prompt order, tau = SEE success threshold.
    m["groups"] = {"prompt_ids": [p.id for p in inputs.prompts], "rewards": r.tolist(), "tau": float(tau)}
    if acc is not None:   # success is the verifier's, not reward >= tau (rewards: config with other components)
        m["groups"]["success"] = success.tolist()
    m.update(inputs.counts)
    return m


def _sample(lanes: Sequence[_Lane], prompts: Sequence, keys: Sequence, scorer, guard, timer: PhaseTimer,
            t0: float) -> None:
    """Phases rollout, decode and rewards of ``prompts`` for every lane (``keys``: the round's 2N keys)."""
    with timer("rollout"):
        _rollouts(lanes, [p.text for p in prompts], keys, guard, t0)
    with timer("decode"):
        for ln in lanes:
            ln.texts, ln.content = decode_completions(ln.pol.tokenizer, ln.out.tokens, ln.out.mask,
                                                      ln.pol.sampling.eos_ids)
    with timer("rewards"):
        for ln in lanes:
            ln.score = scorer.score([p for p in prompts for _ in range(ln.pol.num_generations)], ln.texts,
                                    completion_ids=ln.content)


def run_round(policies: Sequence[Policy], state: RunState, inputs: RoundInputs, scorer, *,
              num_samples_logged: int = 2, device_guard: str | None = None) -> tuple[RunState, dict, list]:
    """Run one round for every policy on ``inputs.prompts``; returns ``(state, {policy: metrics}, samples)``.

    Concurrency: every policy's rollout is dispatched before any result is read, every update before any
    metric is read, and the metrics are fetched once. Per-policy timestamps (seconds since the round began)
    go to ``time/rollout_dispatched``, ``time/rollout_read`` (reading its result begins), ``time/rollout_ready``
    (result on the host), ``time/update_dispatched``, ``time/update_read`` and ``time/update_ready``; a first
    round traces and compiles inside each dispatch, so overlap shows from the second round on.
    ``device_guard``: a ``jax.transfer_guard`` level (e.g. ``"disallow"``) around the device parts (rollout and
    update dispatch); every transfer there is an explicit ``mwra.put``.
    """
    timer, t0 = PhaseTimer(ROUND_PHASES), time.perf_counter()
    guard = (lambda: jax.transfer_guard(device_guard)) if device_guard else nullcontext
    prompts = list(inputs.prompts)
    lanes = [_Lane(pol=pol, ps=ps) for pol, ps in zip(policies, state.policies)]
    keys = list(jax.random.split(inputs.key, 2 * len(policies)))   # indexed here, outside any transfer guard
    _sample(lanes, prompts, keys, scorer, guard, timer, t0)
    if inputs.oversampler is not None:   # dynamic sampling: more prompt batches, the kept batch's lanes
        def more(extra: RoundInputs) -> list:
            fresh = [_Lane(pol=ln.pol, ps=ln.ps) for ln in lanes]
            _sample(fresh, list(extra.prompts), list(jax.random.split(extra.key, 2 * len(policies))), scorer,
                    guard, timer, t0)
            return fresh

        lanes, inputs = inputs.oversampler.fill(lanes, inputs, float(state.see.tau), more)
        prompts = list(inputs.prompts)
    with timer("see"):   # ready before the phase ends: the views read it at once, and its time is the SEE's
        see = jax.block_until_ready(_add_experience(state.see, lanes, inputs))
    with timer("views"):   # SEE selection and view assembly; the THL alignments inside it: phase "thl"
        _views(see, lanes, inputs.dense_ids, timer)
    with timer("stage"):
        _stage(lanes, keys)
    with timer("update"):
        _updates(lanes, inputs.index, guard, t0)
    metrics, samples = {}, []
    for ln in lanes:
        metrics[ln.pol.name] = _lane_metrics(ln, inputs, see.tau, timer.times)
        G = ln.pol.num_generations
        samples += [{"policy": ln.pol.name, "prompt": p.text, "answer": p.answer, "completion": ln.texts[k * G],
                     "reward": float(ln.score.rewards[k * G])} for k, p in enumerate(prompts[:num_samples_logged])]
    return RunState(policies=tuple(ln.new_state for ln in lanes), see=see), metrics, samples
