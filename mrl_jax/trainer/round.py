"""One MRL round as a function composing the layers (DESIGN.md, data flow):

    rollout_i (dispatched for every policy before any is read) -> decode -> rewards (isolated)
    -> SEE.add of every policy's experience -> per consumer: THL view of the peers' texts
    -> update_i (dispatched for every policy) -> metrics

``run_round(policies, state, prompts, ...) -> (state, metrics, samples)`` has no hidden state: the
arrays come in through ``RunState`` and go out in a new one. Wall time is split per phase in
``metrics[name]["time/<phase>"]``.

Placement (MWRA, `mrl_jax.trainer.placement`): a policy with a ``mesh`` has its rollout and update jitted for
that mesh. Its prompt rows are padded to a multiple of the data axis with copies of the last prompt (their
samples are dropped on the host: the sampler's noise per row does not depend on the row count, so the real
rows are those of an unpadded run). The update batch is put on the mesh explicitly, rows split over the data
axis where P and P*G divide it and replicated otherwise (own GRPO rows are not padded: a padding group would
enter the group / batch statistics and the per-sequence denominators); the consumer's SEE view goes there by
``mwra.to_mesh`` via the host. Nothing crosses meshes implicitly (``device_guard="disallow"`` proves it).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Sequence

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
from mrl_jax.tasks import Prompt
from mrl_jax.trainer.encoding import decode_completions, encode_prompts
from mrl_jax.trainer.placement import fetch, pad_prompts
from mrl_jax.trainer.policy import Policy, PolicyState
from mrl_jax.trainer.reference import maybe_sync


@struct.dataclass
class RunState:
    """Everything a round changes: each policy's arrays and the shared experience buffer."""

    policies: tuple
    see: see_lib.SEE


@struct.dataclass
class ViewShape:
    """Static layout of the peer slots (same for every probe, so every probe compiles the same shapes)."""

    peer_rollouts: int = struct.field(pytree_node=False, default=8)
    peer_successes: int = struct.field(pytree_node=False, default=2)
    own_successes: int = struct.field(pytree_node=False, default=1)

    @property
    def slots(self) -> int:
        return self.peer_rollouts + self.peer_successes + self.own_successes


_see_add = jax.jit(see_lib.add)


class PhaseTimer:
    """Wall time per phase of a round (seconds)."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - t0


def _aligner(consumer: Policy, policies: Sequence[Policy], max_chunks: int, thl_metrics: list):
    """``align_batch(texts, sources, src_ids)`` for ``see.build_view``: THL per source tokenizer."""

    def align(texts, sources, src_ids):
        n = len(texts)
        out = {"dst_ids": [None] * n, "dst_chunk": [None] * n, "src_chunk": [None] * n,
               "chunk_valid": [None] * n, "dst_len": np.zeros(n, np.int32)}
        sources = np.asarray(sources)
        for j in np.unique(sources):
            rows = np.nonzero(sources == j)[0]
            ba = thl.align_batch([texts[m] for m in rows], policies[int(j)].tokenizer, consumer.tokenizer,
                                 [src_ids[m] for m in rows], max_chunks=max_chunks)
            thl_metrics.append(ba.metrics)
            for k, m in enumerate(rows):
                out["dst_ids"][m], out["dst_chunk"][m] = ba.dst_ids[k], ba.dst_chunk[k]
                out["src_chunk"][m], out["chunk_valid"][m] = ba.src_chunk[k], ba.chunk_valid[k]
                out["dst_len"][m] = ba.dst_lengths[k]
        return out

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


def _dispatch_rollout(pol: Policy, ps: PolicyState, ids: np.ndarray, mask: np.ndarray, key, G: int):
    """Launch policy ``pol``'s rollout (not awaited). On a mesh: prompt rows padded to a multiple of the data
    axis (copies of the last prompt; their samples are dropped by `_trim`) and put there explicitly."""
    if pol.mesh is None or pol.rollout is None or generate is not _rollout.generate:
        # unpinned: no mesh, or this module's ``generate`` replaced (tests inject degenerate samples that way)
        return generate(pol.graphdef, ps.params, jnp.asarray(ids), jnp.asarray(mask), key, pol.sampling,
                        num_samples=G)
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


def run_round(policies: Sequence[Policy], state: RunState, prompts: Sequence[Prompt], dense_ids: np.ndarray, *,
              scorer, key: jax.Array, round_index: int, num_generations: int, view_shape: ViewShape,
              num_samples_logged: int = 2, device_guard: str | None = None) -> tuple[RunState, dict, list]:
    """Run one round for every policy on ``prompts`` (dense SEE prompt ids ``dense_ids int32[P]``).

    Concurrency: every policy's rollout is dispatched before any result is read, every update before any
    metric is read, and the metrics are fetched once. Per-policy timestamps (seconds since the round began)
    go to ``time/rollout_dispatched``, ``time/rollout_read`` (reading its result begins), ``time/rollout_ready``
    (result on the host), ``time/update_dispatched``, ``time/update_read`` and ``time/update_ready``; a first
    round traces and compiles inside each dispatch, so overlap shows from the second round on. ``device_guard``: a ``jax.transfer_guard`` level (e.g. ``"disallow"``) around
    the device parts (rollout and update dispatch); every transfer there is an explicit ``mwra.put``.
    """
    G, P = num_generations, len(prompts)
    timer = PhaseTimer()
    t0 = time.perf_counter()
    stamps = {pol.name: {} for pol in policies}
    guard = (lambda: jax.transfer_guard(device_guard)) if device_guard else nullcontext
    texts = [p.text for p in prompts]
    rep_prompts = [p for p in prompts for _ in range(G)]
    keys = list(jax.random.split(key, 2 * len(policies)))   # indexed here, outside any transfer guard

    with timer("rollout"):
        launched = []
        for pol, ps in zip(policies, state.policies):
            ids, mask, _ = encode_prompts(pol.tokenizer, pol.prompt_format, texts)   # [P, Tp]: prefilled once
            with guard():
                out = _dispatch_rollout(pol, ps, ids, mask, keys[pol.index], G)
            stamps[pol.name]["rollout_dispatched"] = time.perf_counter() - t0
            launched.append((ids, mask, out))
        rollouts = []
        for pol, (ids, mask, out) in zip(policies, launched):
            stamps[pol.name]["rollout_read"] = time.perf_counter() - t0
            out = _trim(fetch(pol.mesh, out), P * G)   # one process: device_get; several: read + broadcast
            stamps[pol.name]["rollout_ready"] = time.perf_counter() - t0
            rollouts.append((ids, mask, out))

    with timer("decode"):
        decoded = [decode_completions(pol.tokenizer, out.tokens, out.mask, pol.sampling.eos_ids)
                   for pol, (_, _, out) in zip(policies, rollouts)]

    with timer("rewards"):
        scores = [scorer.score(rep_prompts, comp_texts) for comp_texts, _ in decoded]

    with timer("see"):
        see = state.see
        see_info = []
        max_bytes = see.rollouts.text.shape[1]
        max_src = see.rollouts.src_ids.shape[1]
        for pol, (_, _, out), (comp_texts, content), sc in zip(policies, rollouts, decoded, scores):
            lps = [out.logprobs[b, :len(c)] for b, c in enumerate(content)]
            exp = see_lib.make_experience(comp_texts, np.repeat(dense_ids, G), pol.index, sc.rewards,
                                          src_ids=content, src_logp=lps, truncated=out.truncated,
                                          round=round_index, max_bytes=max_bytes, max_src_tokens=max_src)
            see, info = _see_add(see, exp)
            see_info.append(info)

    views, thl_metrics = [], [[] for _ in policies]
    with timer("thl"):
        for pol in policies:
            Tc = pol.completion_length
            stats = see_lib.peer_stats(see, pol.index, dense_ids)
            if pol.probe.needs_peers:
                view = see_lib.build_view(
                    see, pol.index, dense_ids, _aligner(pol, policies, Tc, thl_metrics[pol.index]),
                    k_rollouts=view_shape.peer_rollouts, k_successes=view_shape.peer_successes,
                    k_own=view_shape.own_successes,
                    max_completion_len=Tc, max_chunks=Tc, pad_id=pol.sampling.pad_id, eos_id=pol.tokenizer.eos_id)
            else:
                view = see_lib.empty_view(P, view_shape.slots, Tc, Tc,
                                          len(policies), consumer=pol.index, tau=see.tau)
                view = view.replace(peer_stats=jnp.asarray(stats))
            views.append(view)

    with timer("stage"):   # every policy's inputs on its mesh before any update is dispatched
        staged = []
        for pol, (ids, mask, out), sc, view in zip(policies, rollouts, scores, views):
            if pol.mesh is None:
                batch = Batch(prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(mask),
                              completion_ids=jnp.asarray(out.tokens),
                              completion_mask=jnp.asarray(out.mask, jnp.float32),
                              old_logp=jnp.asarray(out.logprobs), ref_logp=jnp.zeros(out.logprobs.shape, jnp.float32),
                              rewards=jnp.asarray(sc.rewards), truncated=jnp.asarray(out.truncated))
            else:   # host numpy -> the policy's mesh, rows split over the data axis where they divide it
                batch = mwra.shard_batch(Batch(
                    prompt_ids=np.asarray(ids), prompt_mask=np.asarray(mask), completion_ids=np.asarray(out.tokens),
                    completion_mask=np.asarray(out.mask, np.float32), old_logp=np.asarray(out.logprobs),
                    ref_logp=np.zeros(out.logprobs.shape, np.float32), rewards=np.asarray(sc.rewards, np.float32),
                    truncated=np.asarray(out.truncated)), pol.mesh, strict=False)
                view = mwra.to_mesh(view, pol.mesh, via_host=True)   # SEE (host / default device) -> consumer
            staged.append((batch, view, _iteration_keys(pol, keys[len(policies) + pol.index])))

    with timer("update"):
        new_states, raw_metrics = [], []
        for pol, ps, (batch, view, ukeys) in zip(policies, state.policies, staged):
            with guard():
                if ps.ref_params is not None:      # beta > 0: the frozen reference's log-probs of the own rows
                    batch = batch.replace(ref_logp=pol.ref_logp(ps.ref_params, batch))
                new_state, m = _update_policy(pol, ps, batch, view, ukeys, round_index)
            stamps[pol.name]["update_dispatched"] = time.perf_counter() - t0
            new_states.append(new_state)
            raw_metrics.append(m)
        for pol, m in zip(policies, raw_metrics):
            stamps[pol.name]["update_read"] = time.perf_counter() - t0
            jax.block_until_ready(m)
            stamps[pol.name]["update_ready"] = time.perf_counter() - t0
        if jax.process_count() == 1:
            raw_metrics = jax.device_get(raw_metrics)   # the round's one metrics fetch
        else:   # each policy's metrics read where its mesh is, broadcast to every process
            raw_metrics = [fetch(pol.mesh, m) for pol, m in zip(policies, raw_metrics)]

    metrics, samples = {}, []
    for pol, (_, _, out), (comp_texts, _), sc, upd, info in zip(
            policies, rollouts, decoded, scores, raw_metrics, see_info):
        r = sc.rewards.reshape(P, G)
        m = {k: float(np.asarray(v)) for k, v in upd.items() if np.ndim(v) == 0}
        m.update({k: v for k, v in sc.stats.items() if np.isscalar(v)})
        m.update({"reward/mean": float(r.mean()), "reward/success_rate": float((r >= see.tau).mean()),
                  "completion/mean_length": float(np.asarray(out.lengths).mean()),
                  "completion/truncated": float(np.asarray(out.truncated).mean())})
        m.update({f"see/{k}": float(np.asarray(v)) for k, v in info.items()})
        m.update(_mean_metrics(thl_metrics[pol.index], "thl/"))
        m.update({f"time/{k}": v for k, v in timer.times.items()})
        m.update({f"time/{k}": v for k, v in stamps[pol.name].items()})
        # -- per-prompt outcomes (issue 16, `mrl report`'s complementarity matrix): not a scalar; RunLog writes
        # it to groups.jsonl, not metrics.jsonl. rewards f32[P, G] in prompt order, tau = SEE success threshold.
        m["groups"] = {"prompt_ids": [p.id for p in prompts], "rewards": r.tolist(), "tau": float(see.tau)}
        metrics[pol.name] = m
        for p in range(min(num_samples_logged, P)):
            samples.append({"policy": pol.name, "prompt": prompts[p].text, "answer": prompts[p].answer,
                            "completion": comp_texts[p * G], "reward": float(sc.rewards[p * G])})
    return RunState(policies=tuple(new_states), see=see), metrics, samples
