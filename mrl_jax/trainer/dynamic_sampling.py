"""Dynamic sampling (DAPO's ``filter_groups``, verl's ``algorithm.filter_groups``): groups whose rewards are
all equal have zero advantage, so they leave the policy-gradient loss and its denominators, and the round draws
more prompts to keep the batch full.

    dynamic_sampling: {enable: true, max_num_gen_batches: 4}

Two halves:

* ``filter_groups()`` (device, a probe chained first into every policy's probe): own rows of a group whose
  P x G rewards are all equal get ``pg_row = 0`` and ``pg_mask = 0``, so the PG term and KL term of every
  ``loss_type`` equal those of the batch without those groups (``scale_rewards: batch`` takes its std over the
  kept groups only). Peer rows and the probes' own terms are untouched: SGT's rescue term still fires on an
  all-fail group (its rescue set), PRP's peer rows on the prompt still train.
* ``Oversampler`` (host, round level; the prompts stay shared by all policies): after the round's first batch
  is sampled and scored, a prompt slot is *useful* when, for some policy, its group is not degenerate, or it is
  all-fail (no reward >= SEE's ``success_threshold``) and that policy's probe reads peers (SGT, PRP). While
  fewer than P prompts are useful and fewer than ``max_num_gen_batches`` batches were generated, another batch
  of P prompts is drawn (``np.random.default_rng([seed, round, k])``) and sampled with the key
  ``fold_in(round key, k)``, so row noise stays a function of (run key, round, batch k, row) on any device
  count. The batch keeps the first P useful prompts in draw order (so every useful prompt of the first batch
  stays), then fills with the first non-useful ones (their own rows masked by ``filter_groups``).

Per policy and round: ``dynamic_sampling/kept_groups`` (groups of this policy in the PG loss),
``dynamic_sampling/generated_batches`` and ``dynamic_sampling/drawn_prompts``. Filtering uses the reward the
advantage is computed from (the weighted sum of ``rewards:``), not the verifier's accuracy alone: a group that
differs only in a format bonus still has an advantage.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mrl_jax import grpo
from mrl_jax.configs import check, field
from mrl_jax.probes import Probe, RunOptions
from mrl_jax.rows import OWN, Rows
from mrl_jax.trainer.encoding import encode_prompts

PREFIX = "dynamic_sampling/"
MAX_GEN_BATCHES = 64   # a round's cost bound: batches of P x G completions per policy


@dataclasses.dataclass(frozen=True)
class DynamicSamplingSpec:
    """DAPO dynamic sampling (verl ``algorithm.filter_groups``; mrl_jax.trainer.dynamic_sampling)."""

    enable: bool = field(False, help="groups whose rewards are all equal leave the PG loss and its denominators "
                                     "(their prompts stay for SEE, SGT and PRP), and more prompts are drawn to "
                                     "keep the batch full")
    max_num_gen_batches: int = field(4, help="batches of prompts_per_round prompts a round may generate, the "
                                             "first included (1 = filter only, no oversampling; verl's 0 = "
                                             "unbounded is not offered: a round must end)")

    def __post_init__(self):
        check(self.max_num_gen_batches >= 1, "dynamic_sampling.max_num_gen_batches",
              f"must be >= 1 (1 = no oversampling), got {self.max_num_gen_batches}")
        check(self.max_num_gen_batches <= MAX_GEN_BATCHES, "dynamic_sampling.max_num_gen_batches",
              f"{self.max_num_gen_batches} is over {MAX_GEN_BATCHES}: each batch samples and scores prompts_per_round x "
              "num_generations completions per policy, and a reward whose groups are all uniform makes every round "
              f"draw them all (verl's default is 10); use at most {MAX_GEN_BATCHES}")


# ----------------------------------------------------------------------------------------------- device

def kept_groups(rewards: jax.Array) -> jax.Array:
    """bool[P]: groups whose rewards f32[P, G] are not all equal."""
    return jnp.max(rewards, -1) > jnp.min(rewards, -1)


def filter_groups(*, options: Optional[RunOptions] = None) -> Probe:
    """The loss half of dynamic sampling: own rows of degenerate groups leave the PG term and its denominators
    (``pg_row``, ``pg_mask`` zeroed); ``scale_rewards: batch`` advantages take their std over kept groups
    (``options``: the run's, bound as every probe's)."""
    options = RunOptions() if options is None else options

    def own_keep(rows: Rows) -> jax.Array:
        P, G = rows.num_prompts, rows.num_generations
        return jnp.repeat(kept_groups(rows.rewards[:rows.num_own].reshape(P, G)), G)

    def extend(rows, see_view, key):
        keep = own_keep(rows).astype(jnp.float32)
        tail = jnp.ones((rows.num_rows - rows.num_own,), jnp.float32)
        k = jnp.where(rows.row_kind == OWN, jnp.concatenate([keep, tail]), 1.0)
        return rows.replace(pg_row=rows.pg_row * k, pg_mask=rows.pg_mask * k[:, None]), {}

    def advantages(rewards, rows, see_view, adv):
        if options.scale_rewards != "batch":
            return adv   # group / none: a degenerate group's advantage is 0 already, and its rows are masked
        P, G, n = rows.num_prompts, rows.num_generations, rows.num_own
        mask = own_keep(rows).reshape(P, G)
        own = grpo.group_advantages(rewards[:n].reshape(P, G), "batch", options.reward_eps, mask=mask).reshape(-1)
        return adv.at[:n].set(own)

    return Probe("filter_groups", extend, advantages, options=options)


# ------------------------------------------------------------------------------------------------- host

def degenerate(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """bool[P]: groups of rewards f32[P*G] (prompt-major) that are all equal (in float32, as on device)."""
    r = np.asarray(rewards, np.float32).reshape(-1, num_generations)
    return r.max(-1) <= r.min(-1)


def useful(policies: Sequence[Any], sampled: Sequence[Any], tau: float) -> np.ndarray:
    """bool[P]: prompts that carry a loss term for some policy: a group that is not degenerate, or an all-fail
    group of a policy whose probe reads peers (SGT's rescue set, PRP's peer rows)."""
    out = None
    for pol, s in zip(policies, sampled):
        G = pol.num_generations
        r = np.asarray(s.score.rewards, np.float32).reshape(-1, G)
        u = ~degenerate(r, G)
        if pol.probe.needs_peers:
            u |= r.max(-1) < tau
        out = u if out is None else out | u
    return out


def select(useful_per_batch: Sequence[np.ndarray], P: int) -> list[tuple[int, int]]:
    """The batch's P (batch, prompt) slots in draw order: the first P useful ones, then the first others."""
    order = [(b, p) for b, u in enumerate(useful_per_batch) for p in range(len(u))]
    good = [(b, p) for b, p in order if useful_per_batch[b][p]][:P]
    rest = [(b, p) for b, p in order if not useful_per_batch[b][p]][:P - len(good)]
    return sorted(good + rest)


def _pad_cols(x: np.ndarray, width: int, value) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[1] == width:
        return x
    pad = np.full((x.shape[0], width - x.shape[1]) + x.shape[2:], value, x.dtype)
    return np.concatenate([x, pad], 1)


def _stats(stats: Sequence[dict]) -> dict:
    """Scorer statistics of several batches: counts (ints) and times summed, the rest from the first batch."""
    out = dict(stats[0])
    for st in stats[1:]:
        for k, v in st.items():
            if k in out and ((type(v) is int and type(out[k]) is int) or k.endswith("time_s")):
                out[k] += v
    return out


def _compose(pol, batches: Sequence[Any], picks: Sequence[tuple[int, int]], texts):
    """Policy ``pol``'s ``Sampled`` made of the picked (batch, prompt) groups of its ``Sampled`` of every batch."""
    first, G = batches[0], pol.num_generations
    rows = [(b, p * G + g) for b, p in picks for g in range(G)]
    width = max(np.asarray(s.rollout.tokens).shape[1] for s in batches)
    pad = {"tokens": pol.sampling.pad_id}

    def gather(name):
        parts = [_pad_cols(getattr(s.rollout, name), width, pad.get(name, 0)) for s in batches]
        return np.stack([parts[b][r] for b, r in rows])

    out = first.rollout.replace(**{f.name: gather(f.name) for f in dataclasses.fields(first.rollout)})
    sc = [s.score for s in batches]
    score = sc[0]._replace(
        rewards=np.asarray([sc[b].rewards[r] for b, r in rows], np.float32),
        per_function=np.stack([np.asarray(sc[b].per_function)[r] for b, r in rows]),
        accuracy=None if sc[0].accuracy is None else np.asarray([sc[b].accuracy[r] for b, r in rows], np.float32),
        stats=_stats([s.stats for s in sc]))
    ids, mask, _ = encode_prompts(pol.tokenizer, pol.prompt_format, texts, max_width=pol.prompt_limit)
    return dataclasses.replace(first, prompt_ids=ids, prompt_mask=mask, rollout=out, score=score,
                               texts=[batches[b].texts[r] for b, r in rows],
                               content=[batches[b].content[r] for b, r in rows])


@dataclasses.dataclass(frozen=True)
class Oversampler:
    """A round's dynamic sampling: ``draw(k) -> RoundInputs`` of extra batch k >= 1 (same P)."""

    max_num_gen_batches: int
    draw: Callable[[int], Any]

    def fill(self, policies: Sequence[Any], sampled: Sequence[Any], inputs, tau: float,
             sample: Callable[[Any], list]):
        """``(sampled, inputs)`` of the kept batch. ``sampled``: each policy's ``round.Sampled`` of the round's
        first batch; ``sample(inputs_k) -> [Sampled]`` samples and scores extra batch k. Adds the
        ``dynamic_sampling/*`` counters to each policy's scorer stats."""
        P = len(inputs.prompts)
        batches, metas = [list(sampled)], [inputs]
        u = [useful(policies, sampled, tau)]
        while sum(int(x.sum()) for x in u) < P and len(batches) < self.max_num_gen_batches:
            print(f"[dynamic sampling] round {inputs.index}: {sum(int(x.sum()) for x in u)} of {P} prompts useful "
                  f"after {len(batches)} batch(es); drawing batch {len(batches) + 1} of at most "
                  f"{self.max_num_gen_batches}", file=sys.stderr, flush=True)
            more = self.draw(len(batches))
            batches.append(sample(more))
            metas.append(more)
            u.append(useful(policies, batches[-1], tau))
        picks = select(u, P)
        if len(batches) > 1:
            prompts = tuple(metas[b].prompts[p] for b, p in picks)
            texts = [q.text for q in prompts]
            sampled = [_compose(pol, [b[i] for b in batches], picks, texts) for i, pol in enumerate(policies)]
            counts = {k: sum(m.counts.get(k, 0.0) for m in metas) for k in inputs.counts}
            inputs = dataclasses.replace(inputs, prompts=prompts, counts=counts,
                                         dense_ids=np.asarray([metas[b].dense_ids[p] for b, p in picks], np.int32))
        out = []
        for pol, s in zip(policies, sampled):
            kept = ~degenerate(s.score.rewards, pol.num_generations)
            if not kept.any():
                print(f"mrl train: warning: dynamic sampling: round {inputs.index} kept 0 of {P} groups of policy "
                      f"{pol.name!r} after {len(batches)} batch(es) (every group's rewards were equal), so its "
                      "policy-gradient loss is empty this round; check that the reward separates completions, or "
                      "raise dynamic_sampling.max_num_gen_batches", file=sys.stderr, flush=True)
            out.append(dataclasses.replace(s, score=s.score._replace(stats=dict(s.score.stats, **{
                PREFIX + "kept_groups": float(kept.sum()), PREFIX + "generated_batches": float(len(batches)),
                PREFIX + "drawn_prompts": float(P * len(batches))}))))
        return out, inputs


def oversampler(spec, draw_inputs, round_index: int) -> Oversampler | None:
    """The ``Oversampler`` of round ``round_index`` (None when dynamic sampling, ``spec``, is off); extra batch k is
    ``draw_inputs(round_index, k)`` (`trainer.run.Run.draw_inputs`: its own prompts and key)."""
    if not spec.enable:
        return None
    return Oversampler(spec.max_num_gen_batches, lambda k: draw_inputs(round_index, k))
